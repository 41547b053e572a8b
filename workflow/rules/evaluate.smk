rule evaluate:
    # Greedy answers and metrics of one trained stage (or of the untrained base model) on one split.
    input:
        unpack(get_eval_inputs),
    output:
        predictions=eval_path("{experiment}", "{stage}", "{split}", "predictions.jsonl"),
        metrics=eval_path("{experiment}", "{stage}", "{split}", "metrics.json"),
    log:
        f"{RESULTS}/logs/evaluate/{{experiment}}/{{stage}}/{{split}}.log",
    threads: job_threads(config["evaluation"]["threads"])
    resources:
        runtime=get_eval_resource("runtime"),
        mem_mb=get_eval_resource("mem_mb"),
        gpu=get_eval_resource("gpus"),
        cpu_fallback=CPU_FALLBACK,
        # The plan's prediction of the job's time, for its log (vlft.study_costs).
        predicted_s=get_predicted_seconds,
    params:
        model=model_content("whole"),
        model_path=model_path,
        trust_remote_code=TRUST_REMOTE_CODE,
        settings=lambda wildcards: json.dumps(get_eval_settings(wildcards), sort_keys=True),
        adapter=get_adapter_arg,
        trained_from=get_lineage_settings(include_stage=True),
    shell:
        # Launched with GPUs of its own among those visible (vlft.jobs.launch): one process a GPU, the
        # split's batches shared out among them.
        "python -m vlft.jobs.launch "
        "--gpus {resources.gpu} "
        "scripts/evaluate.py "
        "--model {params.model_path:q} "
        "{params.trust_remote_code} "
        "{params.adapter} "
        "--prepared {input.prepared:q} "
        "--cache {input.cache:q} "
        "--settings {params.settings:q} "
        "--predictions {output.predictions:q} "
        "--metrics {output.metrics:q} "
        "--threads {threads} "
        "--processes {resources.gpu} "
        "--cpu-fallback {resources.cpu_fallback} "
        "--predicted-seconds {resources.predicted_s} "
        "2>&1 | tee {log:q}"
