# The built-in demo: synthetic datasets and a tiny model (a Qwen3-VL unless it names another
# family), made here, so the same DAG runs with no downloads.

# One rule a demo dataset (make_demo_<name>): changing one dataset's sizes remakes that one alone.
for demo_name, demo_spec in DEMO_DATASETS.items():

    rule:
        name:
            f"make_demo_{demo_name}"
        output:
            records=[config["datasets"][demo_name]["splits"][s] for s in sorted(demo_spec["sizes"])],
            images=directory(config["datasets"][demo_name]["image_root"]),
        log:
            f"{RESULTS}/logs/make_demo_{demo_name}.log",
        resources:
            mem_mb=rule_memory(f"make_demo_{demo_name}", 2000),
            runtime=10,
        params:
            kind=demo_spec["kind"],
            # Sorted: the order of keys in the YAML file is not a change.
            sizes=" ".join(f"{k}={v}" for k, v in sorted(demo_spec["sizes"].items())),
            records=" ".join(
                shlex.quote(f"{k}={v}") for k, v in sorted(config["datasets"][demo_name]["splits"].items())
            ),
            seed=demo_spec.get("seed", 0),
            questions=demo_spec.get("questions_per_image", 1),
            # What the generators make: 2 since the shapes carry a rejected answer (CHANGELOG.md).
            version=2,
        shell:
            "python -m vlft.jobs.launch "
            "scripts/make_demo_dataset.py "
            "--kind {params.kind} "
            "--image-root {output.images:q} "
            "--records {params.records} "
            "--sizes {params.sizes} "
            "--seed {params.seed} "
            "--questions-per-image {params.questions} "
            "2>&1 | tee {log:q}"


# The tiny model's family is a param only where it is not the first demo's (qwen3_vl), so that a
# demo study made before the key existed keeps its model (a new param would make it again).
TINY_FAMILY = config["demo"]["model"]["family"]


rule make_tiny_model:
    output:
        directory(MODEL),
    log:
        f"{RESULTS}/logs/make_tiny_model.log",
    resources:
        mem_mb=rule_memory("make_tiny_model", 2000),
        runtime=10,
    params:
        **({} if TINY_FAMILY == "qwen3_vl" else {"family": TINY_FAMILY}),
        seed=config["demo"]["model"]["seed"],
        hidden_size=config["demo"]["model"]["hidden_size"],
        layers=config["demo"]["model"]["layers"],
    shell:
        "python -m vlft.jobs.launch "
        "scripts/make_tiny_model.py "
        "--output {output:q} "
        f"--family {TINY_FAMILY} "
        "--seed {params.seed} "
        "--hidden-size {params.hidden_size} "
        "--layers {params.layers} "
        "2>&1 | tee {log:q}"
