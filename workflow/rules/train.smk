rule train:
    # One job per experiment x stage; a stage with init_from waits for that stage's adapter.
    input:
        unpack(get_train_inputs),
    output:
        adapter=directory(adapter_path("{experiment}", "{stage}")),
        log=stage_path("{experiment}", "{stage}", "log.jsonl"),
        summary=stage_path("{experiment}", "{stage}", "summary.json"),
    log:
        f"{RESULTS}/logs/train/{{experiment}}/{{stage}}.log",
    threads: job_threads(lambda wildcards: PLAN.resources(wildcards.experiment, wildcards.stage)["threads"])
    resources:
        runtime=get_stage_resource("runtime"),
        mem_mb=get_stage_resource("mem_mb"),
        # GPUs on each node; `gpu` (SLURM's job-wide count), `gres`, `mpi`, `tasks` and
        # `tasks_per_gpu` submit a stage across nodes (resources.smk, get_node_resource).
        gpus_per_node=get_stage_resource("gpus"),
        nodes=get_stage_resource("nodes"),
        gpu=get_node_resource("gpu"),
        gres=get_node_resource("gres"),
        mpi=get_node_resource("mpi"),
        tasks=get_node_resource("tasks"),
        tasks_per_gpu=get_node_resource("tasks_per_gpu"),
        # Whether the processes shard the frozen base or each hold it whole: the same steps, a resource.
        parallelism=get_stage_resource("parallelism"),
        # How often the job saves, not what it computes: a resource, so changing it reruns nothing.
        checkpoint_every=lambda wildcards: get_stage(wildcards).settings["checkpoint_every"],
        # Memory against time, the same result: a resource too.
        activation_checkpointing=lambda wildcards: int(get_stage(wildcards).settings["activation_checkpointing"]),
        # A retry (attempt 2 on) restores the outputs of an attempt that finished its steps.
        attempt=lambda wildcards, attempt: attempt,
        # The plan's prediction of the job's time (vlft.study_costs), for its log: a resource, so a
        # refined prediction reruns nothing.
        predicted_s=get_predicted_seconds,
        cpu_fallback=CPU_FALLBACK,
        # Where the curves go, not what is trained: a resource, so naming a tracker reruns nothing.
        report_to=",".join(config["report_to"]) or "none",
    params:
        model=model_content("whole"),
        model_path=model_path,
        trust_remote_code=TRUST_REMOTE_CODE,
        settings=get_train_settings,
        init_from_settings=get_lineage_settings(include_stage=False),
        init_adapter=get_init_adapter_arg,
        # Where the stage evaluates as it trains (`eval_every`): the config's evaluation settings too.
        evaluation=get_train_eval_arg,
        # Outside the declared outputs: Snakemake deletes those when a job fails.
        checkpoints=f"{RESULTS}/checkpoints/{{experiment}}/{{stage}}",
        # Live curves, also outside the outputs: a stopped attempt's continue in the retry's.
        tensorboard=f"{RESULTS}/tensorboard/{{experiment}}/{{stage}}",
        # Every attempt's log, appended: Snakemake starts the declared log afresh for each attempt.
        attempts_log=f"{RESULTS}/logs/train/{{experiment}}/{{stage}}.attempts.log",
    shell:
        # Launched as every job is (vlft.jobs.launch: GPUs of its own among those visible, a warm
        # process where one serves), then the script: one process a GPU, each step shared out among
        # them (vlft.jobs.distributed). At a time limit or a scancel SLURM signals every process of
        # the job, and Ctrl-C the terminal's. The shell and tee ignore SIGTERM, SIGUSR1 and SIGINT
        # (and so keep the log flowing); the trainer handles them: it saves a checkpoint, exits 75,
        # and the retry resumes. It also stops by itself before its job's time limit
        # (vlft.jobs.stopping).
        "trap '' TERM USR1 INT; python -m vlft.jobs.launch "
        "--gpus {resources.gpus_per_node} "
        "scripts/train.py "
        "--model {params.model_path:q} "
        "{params.trust_remote_code} "
        "--prepared {input.prepared:q} "
        "--caches {input.caches:q} "
        "{params.init_adapter} "
        "{params.evaluation} "
        "--settings {params.settings:q} "
        "--checkpoints {params.checkpoints:q} "
        "--tensorboard {params.tensorboard:q} "
        "--report-to {resources.report_to} "
        "--checkpoint-every {resources.checkpoint_every} "
        "--activation-checkpointing {resources.activation_checkpointing} "
        "--attempt {resources.attempt} "
        "--predicted-seconds {resources.predicted_s} "
        "--threads {threads} "
        "--processes {resources.gpus_per_node} "
        "--nodes {resources.nodes} "
        "--parallelism {resources.parallelism} "
        "--cpu-fallback {resources.cpu_fallback} "
        "--adapter {output.adapter:q} "
        "--log {output.log:q} "
        "--summary {output.summary:q} "
        "2>&1 | tee -a {log:q} {params.attempts_log:q}"
