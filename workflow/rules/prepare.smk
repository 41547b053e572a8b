rule prepare_split:
    # Validate every record and image of a raw split once; write normalized JSONL.
    input:
        unpack(get_raw_split),
    output:
        prepared_path("{dataset}", "{split}"),
    log:
        f"{RESULTS}/logs/prepare_split/{{dataset}}/{{split}}.log",
    threads: job_threads(4)
    resources:
        mem_mb=rule_memory("prepare_split", 4000),
        runtime=60,
    params:
        # What it computes from: the content of the records and images (a change reruns it) ...
        content=get_split_content,
        # ... and where they lie, derived from the input: moved, they rerun nothing.
        records=lambda wildcards, input: raw_split(wildcards)[0],
        image_root=get_image_root,
    shell:
        "python -m vlft.jobs.launch "
        "scripts/prepare_split.py "
        "--records {params.records:q} "
        "--image-root {params.image_root:q} "
        "--output {output:q} "
        "--threads {threads} "
        "2>&1 | tee {log:q}"
