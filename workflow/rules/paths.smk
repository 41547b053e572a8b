# Where each output lies: one function a kind of output, used by the rules and the input functions.


wildcard_constraints:
    dataset="|".join(config["datasets"]),
    split="[^/]+",
    pixels=r"\d+-\d+",
    experiment="[^/]+",
    stage="[^/]+",
    sweep="[^/]+",


def prepared_path(dataset, split):
    return f"{RESULTS}/prepared/{dataset}/{split}.jsonl"


def cache_path(dataset, split, pixels):
    return f"{RESULTS}/cache/images/{dataset}/{split}/{pixels}"


def vision_cache_path(dataset, split, pixels):
    return f"{RESULTS}/cache/vision/{dataset}/{split}/{pixels}"


def trained_as(experiment, stage):
    """The stage whose outputs are this one's: itself, or the one trained for it (TRAINED_ONCE)."""
    return TRAINED_ONCE.get(f"{experiment}/{stage}", f"{experiment}/{stage}")


def stage_path(experiment, stage, name):
    """A trained stage's outputs: adapter (directory), log.jsonl, summary.json."""
    return f"{RESULTS}/train/{trained_as(experiment, stage)}/{name}"


def adapter_path(experiment, stage):
    return stage_path(experiment, stage, "adapter")


def eval_path(experiment, stage, split, name):
    """An evaluation's outputs: predictions.jsonl, metrics.json."""
    return f"{RESULTS}/eval/{trained_as(experiment, stage)}/{split}/{name}"


def report_path(name):
    """The report's outputs: index.html and its CSV tables."""
    return f"{RESULTS}/report/{name}"
