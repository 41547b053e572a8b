rule cache_images:
    # Decode and resize every image of a split once, at one resolution range; uint8 safetensors shards.
    input:
        records=prepared_path("{dataset}", "{split}"),
        model=MODEL,
    output:
        directory(cache_path("{dataset}", "{split}", "{pixels}")),
    log:
        f"{RESULTS}/logs/cache_images/{{dataset}}/{{split}}/{{pixels}}.log",
    params:
        min_pixels=lambda wildcards: wildcards.pixels.split("-")[0],
        max_pixels=lambda wildcards: wildcards.pixels.split("-")[1],
    threads: 8
    shell:
        "python scripts/cache_images.py --records {input.records:q} --model {input.model:q} {TRUST_REMOTE_CODE} "
        "--min-pixels {params.min_pixels} --max-pixels {params.max_pixels} --threads {threads} "
        "--output {output:q} 2>&1 | tee {log:q}"
