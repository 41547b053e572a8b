rule prepare_split:
    # Validate every record and image of a raw split once; write normalized JSONL.
    input:
        unpack(get_raw_split),
    output:
        prepared_path("{dataset}", "{split}"),
    log:
        f"{RESULTS}/logs/prepare_split/{{dataset}}/{{split}}.log",
    threads: 4
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        image_root=lambda wildcards: config["datasets"][wildcards.dataset]["image_root"],
    shell:
        "python -m vlft.jobs.launch scripts/prepare_split.py --records {input.records:q} --image-root {params.image_root:q} "
        "--output {output:q} --threads {threads} 2>&1 | tee {log:q}"
