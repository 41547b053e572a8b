rule report_inputs:
    # What the report is of, in a file: its inputs and their labels, and how it groups sweeps. Given
    # on its command line they outgrew what Linux takes in one argument (128 KiB) at a few hundred
    # sweep arms, so the report of such a study never ran. Written where Snakemake runs (a few lines
    # of Python, no job of its own on a cluster).
    input:
        # Their paths, not their content or times: the file lists them (the report reads them).
        unpack(lambda wildcards: {name: ancient(paths) for name, paths in get_report_inputs(wildcards).items()}),
    output:
        inputs=report_path("inputs.json"),
    log:
        f"{RESULTS}/logs/report_inputs.log",
    localrule: True
    params:
        # What a rerun compares: the evaluations and stages the report is of, and its sweeps.
        labels=get_report_labels,
        sweeps=json.dumps(PLAN.sweeps, sort_keys=True),
        # Where the examples' images lie: derived from the input, so a moved dataset reruns nothing.
        image_roots=get_report_image_roots,
    run:
        write_report_inputs(output.inputs, log[0], input, params)


rule report:
    # One self-contained HTML page with every experiment x stage beside the base model, plus CSV
    # tables and the page's plots as files; each is an item of `snakemake --report`.
    input:
        unpack(get_report_inputs),
        inputs=report_path("inputs.json"),
    output:
        # index.html first: what a dry run names the job by.
        **report_outputs(),
    log:
        f"{RESULTS}/logs/report.log",
    resources:
        mem_mb=rule_memory("report", 2000),
        runtime=10,
    params:
        output_dir=lambda wildcards, output: os.path.dirname(output.html),
    shell:
        "python -m vlft.jobs.launch "
        "scripts/report.py "
        "--inputs {input.inputs:q} "
        "--output-dir {params.output_dir:q} "
        "2>&1 | tee {log:q}"
