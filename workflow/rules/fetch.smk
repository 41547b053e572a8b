# The base model named by its Hub id (model.hub_id): fetched where the driver runs, never in a GPU
# job (a compute node may have no network). Its content's digest, not this rule, decides what reruns.


localrules:
    fetch_model,


rule fetch_model:
    output:
        directory(MODEL),
    log:
        f"{RESULTS}/logs/fetch_model.log",
    params:
        hub_id=config["model"]["hub_id"],
        revision=(f"--revision {shlex.quote(config['model']['revision'])}" if config["model"]["revision"] else ""),
    shell:
        "python -m vlft.jobs.launch "
        "scripts/fetch_model.py "
        "--hub-id {params.hub_id:q} "
        "{params.revision} "
        "--output {output:q} "
        "2>&1 | tee {log:q}"
