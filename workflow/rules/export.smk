rule export:
    # A trained stage as a model of its own (vlft.export), on request: `snakemake results/export/exp4/stage2`.
    input:
        unpack(get_export_inputs),
    output:
        directory(f"{RESULTS}/export/{{experiment}}/{{stage}}"),
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
    shell:
        "python -m vlft.jobs.launch "
        "scripts/export.py "
        "--model {params.model_path:q} "
        "--stage {params.stage:q} "
        "--settings {params.settings:q} "
        "--metrics {input.metrics:q} "
        "--output {output:q} "
        "2>&1 | tee {log:q}"
