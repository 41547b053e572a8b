rule evaluate:
    # Greedy answers and metrics of one trained stage (or of the untrained base model) on one split.
    input:
        unpack(get_eval_inputs),
    output:
        predictions=f"{RESULTS}/eval/{{experiment}}/{{stage}}/{{split}}/predictions.jsonl",
        metrics=metrics_path("{experiment}", "{stage}", "{split}"),
    log:
        f"{RESULTS}/logs/evaluate/{{experiment}}/{{stage}}/{{split}}.log",
    params:
        settings=lambda wildcards: json.dumps(get_eval_settings(wildcards), sort_keys=True),
        adapter=get_adapter_arg,
    threads: 8
    resources:
        runtime=get_stage_resource("runtime"),
        mem_mb=get_stage_resource("mem_mb"),
        gpu=get_stage_resource("gpus"),
    shell:
        "python scripts/evaluate.py --model {input.model:q} {TRUST_REMOTE_CODE} {params.adapter} "
        "--prepared {input.prepared:q} --cache {input.cache:q} --settings {params.settings:q} "
        "--predictions {output.predictions:q} --metrics {output.metrics:q} --threads {threads} 2>&1 | tee {log:q}"
