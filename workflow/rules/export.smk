rule export:
    # A trained stage as a model of its own (vlft.export), on request: `vlft export results/train/exp4/stage2`.
    # Its output is the model's config.json, not the directory: Snakemake would leave a timestamp file
    # of its own in a directory output, which the folder, a model to upload or serve, must not hold.
    input:
        unpack(get_export_inputs),
    output:
        f"{RESULTS}/export/{{experiment}}/{{stage}}/config.json",
    log:
        f"{RESULTS}/logs/export/{{experiment}}/{{stage}}.log",
    resources:
        # On the CPU: the base weights in their dtype, twice over while merging (an 8B: some 40 GB).
        mem_mb=rule_memory("export", 64000),
        runtime=60,
    params:
        model=model_content("whole"),
        model_path=model_path,
        settings=lambda wildcards: json.dumps(get_stage(wildcards).settings, sort_keys=True),
        stage=lambda wildcards, input: os.path.dirname(input.summary),
        folder=lambda wildcards, output: os.path.dirname(output[0]),
    shell:
        "python -m vlft.jobs.launch "
        "scripts/export.py "
        "--model {params.model_path:q} "
        "--stage {params.stage:q} "
        "--settings {params.settings:q} "
        "--metrics {input.metrics:q} "
        "--output {params.folder:q} "
        "2>&1 | tee {log:q}"
