# The built-in demo: a synthetic dataset and a tiny Qwen3-VL, made here, so the same DAG runs with no downloads.


rule make_demo_dataset:
    output:
        records=[config["datasets"][DEMO_DATASET]["splits"][s] for s in config["demo"]["dataset"]["sizes"]],
        images=directory(config["datasets"][DEMO_DATASET]["image_root"]),
    log:
        f"{RESULTS}/logs/make_demo_dataset.log",
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        # Sorted: the order of keys in the YAML file is not a change.
        sizes=" ".join(f"{k}={v}" for k, v in sorted(config["demo"]["dataset"]["sizes"].items())),
        records=" ".join(f"{k}={v}" for k, v in sorted(config["datasets"][DEMO_DATASET]["splits"].items())),
        seed=config["demo"]["dataset"]["seed"],
    shell:
        "python scripts/make_demo_dataset.py --image-root {output.images:q} --records {params.records} "
        "--sizes {params.sizes} "
        "--seed {params.seed} 2>&1 | tee {log:q}"


rule make_tiny_model:
    output:
        directory(MODEL),
    log:
        f"{RESULTS}/logs/make_tiny_model.log",
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        seed=config["demo"]["model"]["seed"],
        hidden_size=config["demo"]["model"]["hidden_size"],
        layers=config["demo"]["model"]["layers"],
    shell:
        "python scripts/make_tiny_model.py --output {output:q} --seed {params.seed} "
        "--hidden-size {params.hidden_size} --layers {params.layers} 2>&1 | tee {log:q}"
