rule report:
    # One self-contained HTML page with every experiment x stage beside the base model, plus CSV
    # tables and the page's plots as files; each is an item of `snakemake --report`.
    input:
        unpack(get_report_inputs),
    output:
        # index.html first: what a dry run names the job by.
        **report_outputs(),
    log:
        f"{RESULTS}/logs/report.log",
    resources:
        mem_mb=rule_memory("report", 2000),
        runtime=10,
        # How the report groups the experiments, not what any job computed: a resource, so that a
        # study without a sweep reruns nothing for it (a sweep's experiments are the report's inputs).
        # In hex: a job's resources travel on the command lines SLURM's jobs start Snakemake with.
        sweeps=json.dumps(PLAN.sweeps, sort_keys=True).encode().hex(),
    params:
        # What a rerun compares: the evaluations and stages the report is of.
        labels=get_report_labels,
        arguments=get_report_arguments,
        output_dir=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        "python -m vlft.jobs.launch scripts/report.py {params.arguments} --sweeps {resources.sweeps} "
        "--output-dir {params.output_dir:q} 2>&1 | tee {log:q}"
