# Vision-language LoRA fine-tuning experiments: caches -> training stages -> evaluations -> report.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


if "demo" in config:

    include: "workflow/rules/demo.smk"


rule all:
    input:
        get_report_outputs(),
    default_target: True
