checkpoint keep_best_arms:
    # A sweep's arms compared at the end of a stage (an experiment's keep_best): only the best train
    # their later stages. A checkpoint: the plan of the later stages is made again from its output.
    input:
        metrics=get_arm_metrics,
    output:
        kept=f"{RESULTS}/sweeps/{{sweep}}/kept.json",
    log:
        f"{RESULTS}/logs/keep_best_arms/{{sweep}}.log",
    resources:
        mem_mb=rule_memory("keep_best_arms", 1000),
        runtime=10,
    params:
        selection=lambda wildcards: json.dumps(PLAN.selections[wildcards.sweep], sort_keys=True),
    shell:
        "python -m vlft.jobs.launch "
        "scripts/keep_best_arms.py "
        "--selection {params.selection:q} "
        "--metrics {input.metrics:q} "
        "--out {output.kept:q} "
        "2>&1 | tee {log:q}"
