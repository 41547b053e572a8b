# Vision-language LoRA fine-tuning experiments: caches -> training stages -> evaluations -> report.
# The workflow lives in workflow/Snakefile (where the Snakemake workflow catalog looks for it); this
# file is where a clone runs it from: `snakemake` here, or `snakemake -s <clone>/Snakefile`.


include: "workflow/Snakefile"


# An include keeps the including file's default target: the workflow's own, `all`, made this one's.
workflow.default_target = "all"
