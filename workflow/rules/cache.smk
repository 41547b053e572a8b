rule cache_images:
    # Decode and resize every image of a split once, at one resolution range; uint8 safetensors shards.
    input:
        unpack(model_input),
        records=prepared_path("{dataset}", "{split}"),
    output:
        directory(cache_path("{dataset}", "{split}", "{pixels}")),
    log:
        f"{RESULTS}/logs/cache_images/{{dataset}}/{{split}}/{{pixels}}.log",
    threads: job_threads(8)
    resources:
        mem_mb=rule_memory("cache_images", 8000),
        runtime=120,
    params:
        # The image processor's settings are all of the model it reads (vlft.digests).
        model=model_content("processor"),
        model_path=model_path,
        image_root=get_image_root,
        trust_remote_code=TRUST_REMOTE_CODE,
        min_pixels=lambda wildcards: wildcards.pixels.split("-")[0],
        max_pixels=lambda wildcards: wildcards.pixels.split("-")[1],
    shell:
        "python -m vlft.jobs.launch "
        "scripts/cache_images.py "
        "--records {input.records:q} "
        "--image-root {params.image_root:q} "
        "--model {params.model_path:q} "
        "{params.trust_remote_code} "
        "--min-pixels {params.min_pixels} "
        "--max-pixels {params.max_pixels} "
        "--threads {threads} "
        "--output {output:q} "
        "2>&1 | tee {log:q}"


rule cache_vision:
    # The frozen vision tower's outputs for every image of a split, once, for experiments with
    # vision_cache: true; refused before it starts if larger than vision_cache_max_gb.
    input:
        unpack(model_input),
        pixels=cache_path("{dataset}", "{split}", "{pixels}"),
    output:
        directory(vision_cache_path("{dataset}", "{split}", "{pixels}")),
    log:
        f"{RESULTS}/logs/cache_vision/{{dataset}}/{{split}}/{{pixels}}.log",
    threads: job_threads(8)
    resources:
        runtime=get_stage_resource("runtime", default=True),
        mem_mb=get_stage_resource("mem_mb", default=True),
        gpu=get_stage_resource("gpus", default=True),
        cpu_fallback=CPU_FALLBACK,
    params:
        model=model_content("whole"),
        model_path=model_path,
        trust_remote_code=TRUST_REMOTE_CODE,
        max_gb=config["vision_cache_max_gb"],
    shell:
        # Launched with GPUs of its own among those visible (vlft.jobs.launch).
        "python -m vlft.jobs.launch "
        "--gpus {resources.gpu} "
        "scripts/cache_vision.py "
        "--pixels {input.pixels:q} "
        "--model {params.model_path:q} "
        "{params.trust_remote_code} "
        "--max-gb {params.max_gb} "
        "--gpus {resources.gpu} "
        "--cpu-fallback {resources.cpu_fallback} "
        "--output {output:q} "
        "2>&1 | tee {log:q}"
