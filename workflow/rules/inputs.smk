# The rules' inputs and params (the get_* functions), each from the plan (plan.smk) and the paths
# (paths.smk).
import json
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from vlft.digests import model_digests, split_digest
from vlft.errors import InputError
from vlft.files import write_json
from vlft.plan import BASE_EXPERIMENT, pixels_tag

# Content, not place (vlft.digests): a job that reads the model or a raw split takes the digest of
# its content as a param, so a changed file reruns it; the paths travel as params derived from the
# input (`lambda wildcards, input: ...`), which Snakemake leaves out of its comparison, so the same
# bytes moved or touched rerun nothing. Files are inputs only where a rule of this workflow makes
# them (the demo's: the job waits for them), or where they are missing (Snakemake names them).


def model_input(wildcards=None):
    return {"model": MODEL} if MODEL_MADE_HERE or not Path(MODEL).exists() else {}


def model_content(part):
    """A param: the digest of the model's content, "whole" or its image "processor" alone.
    Snakemake evaluates params again just before a job runs, so a model made earlier in the same
    run (the demo's) is seen as it is then."""

    def digest(wildcards):
        return model_digests(MODEL, DIGESTS)[part] if Path(MODEL).is_dir() else "not there yet"

    return digest


def model_path(wildcards, input):
    return MODEL


def raw_split(wildcards):
    dataset = config["datasets"][wildcards.dataset]
    return dataset["splits"][wildcards.split], dataset["image_root"]


def get_raw_split(wildcards):
    """A split's raw files as inputs: the demo's, made by its rule (one job makes the records and
    the image directory), or a records file that is missing."""
    records, image_root = raw_split(wildcards)
    if wildcards.dataset in DEMO_DATASETS:
        return {"records": records, "images": image_root}
    return {} if Path(records).exists() else {"records": records}


def get_split_content(wildcards):
    """A param: the digest of a raw split's records file and every image it names."""
    records, image_root = raw_split(wildcards)
    if not Path(records).is_file():
        return "not there yet"
    try:
        return split_digest(records, image_root, DIGESTS)
    except InputError as err:
        raise WorkflowError(str(err)) from None


def get_image_root(wildcards, input):
    return config["datasets"][wildcards.dataset]["image_root"]


def get_stage(wildcards):
    return PLAN.stage(wildcards.experiment, wildcards.stage)


def get_train_inputs(wildcards):
    stage = get_stage(wildcards)
    settings = stage.settings
    # The cache kind the stage trains from: its evaluations during training read the same kind.
    cache_of = vision_cache_path if settings["vision_cache"] else cache_path
    inputs = {
        **model_input(),
        "prepared": [prepared_path(settings["dataset"], s) for s in settings["train_splits"]],
        "caches": [cache_of(settings["dataset"], s, stage.pixels()) for s in settings["train_splits"]],
    }
    if stage.init_from:
        inputs["init_adapter"] = adapter_path(*stage.init_from.split("/"))
    if stage.eval_split:
        inputs["eval_prepared"] = prepared_path(settings["dataset"], stage.eval_split)
        inputs["eval_cache"] = cache_of(settings["dataset"], stage.eval_split, stage.pixels())
    return inputs


def get_train_eval_arg(wildcards, input):
    """The evaluation during training: its split and cache, and how it generates (the config's
    `evaluation`); a preference stage's held-out pairs: the split and cache alone; nothing where
    the stage has neither."""
    stage = get_stage(wildcards)
    if not stage.eval_split:
        return ""
    split = ["--eval-prepared", shlex.quote(input.eval_prepared), "--eval-cache", shlex.quote(input.eval_cache)]
    if not stage.settings["eval_every"]:
        return " ".join(split)
    settings = json.dumps(
        PLAN.eval_settings(wildcards.experiment, wildcards.stage, config["evaluation"]), sort_keys=True
    )
    return " ".join(split + ["--eval-settings", shlex.quote(settings)])


def get_train_settings(wildcards):
    return json.dumps(get_stage(wildcards).train_params(), sort_keys=True)


def get_lineage_settings(include_stage):
    """The settings of every stage a job's adapter was trained from (its own stage too, with
    `include_stage`), nearest first. As a job's params, they rerun it when any of those stages
    changed, even where that stage's outputs were lost in between and nothing else would notice."""

    def lineage(wildcards):
        if wildcards.experiment == BASE_EXPERIMENT:
            return "[]"
        stage = get_stage(wildcards)
        chain = ([stage] if include_stage else []) + PLAN.ancestors(stage)
        return json.dumps([s.train_params() for s in chain], sort_keys=True)

    return lineage


def get_eval_settings(wildcards):
    return PLAN.eval_settings(wildcards.experiment, wildcards.stage, config["evaluation"])


def get_eval_inputs(wildcards):
    settings = get_eval_settings(wildcards)
    pixels = pixels_tag(settings["min_pixels"], settings["max_pixels"])
    inputs = {
        **model_input(),
        "prepared": prepared_path(settings["dataset"], wildcards.split),
        "cache": cache_path(settings["dataset"], wildcards.split, pixels),
    }
    if wildcards.experiment != BASE_EXPERIMENT:
        inputs["adapter"] = adapter_path(wildcards.experiment, wildcards.stage)
    return inputs


def get_export_inputs(wildcards):
    """The base model, the stage's outputs, and its evaluations (for the model card)."""
    stage = get_stage(wildcards)
    return {
        **model_input(),
        "adapter": adapter_path(wildcards.experiment, wildcards.stage),
        "summary": stage_path(wildcards.experiment, wildcards.stage, "summary.json"),
        "metrics": [
            eval_path(wildcards.experiment, wildcards.stage, split, "metrics.json")
            for split in stage.settings["eval_splits"]
        ],
    }


def get_adapter_arg(wildcards, input):
    return f"--adapter {shlex.quote(input.adapter)}" if "adapter" in input.keys() else ""


def get_init_adapter_arg(wildcards, input):
    return f"--init-adapter {shlex.quote(input.init_adapter)}" if "init_adapter" in input.keys() else ""


def report_jobs():
    """The evaluations and trained stages the report shows, sorted: the order of experiments in
    the config file is no change to the report. A sweep's arm that keep_best stopped shows its
    stages up to the comparison, not the ones it never trains."""
    evaluations = [
        (experiment, stage, split)
        for experiment, stage, split in PLAN.evaluations()
        if experiment == BASE_EXPERIMENT or goes_on(PLAN.stage(experiment, stage))
    ]
    return sorted(evaluations), sorted(filter(goes_on, PLAN.stages.values()), key=lambda s: s.id)


def goes_on(stage):
    """Whether a stage trains: every stage but those after keep_best's stage of the arms it stopped
    (known once its checkpoint has run: until then, Snakemake plans what comes before)."""
    sweep = PLAN.selection_of(stage)
    return sweep is None or stage.experiment in kept_arms(sweep)["kept"]


def kept_arms(sweep):
    return json.loads(Path(checkpoints.keep_best_arms.get(sweep=sweep).output.kept).read_text())


def get_arm_metrics(wildcards):
    """The evaluation of each of a sweep's arms that keep_best compares them by."""
    selection = PLAN.selections[wildcards.sweep]
    return [eval_path(arm, selection["after"], selection["split"], "metrics.json") for arm in selection["candidates"]]


def report_outputs():
    """The report's files, each with its caption in Snakemake's own report; the chart of rewards
    per step only where the study has a reward stage."""
    captions = {
        "html": ("index.html", "index.rst", "Report"),
        "results": ("results.csv", "results.rst", "Tables"),
        "categories": ("accuracy_by_category.csv", "categories.rst", "Tables"),
        "jobs": ("jobs.csv", "jobs.rst", "Tables"),
        "loss_curves": ("loss_curves.png", "loss_curves.rst", "Plots"),
        "category_chart": ("accuracy_by_category.png", "accuracy_by_category.rst", "Plots"),
    }
    if any(s.settings["method"] == "grpo" for s in PLAN.stages.values()):
        captions["reward_curves"] = ("reward_curves.png", "reward_curves.rst", "Plots")
    if PLAN.sweeps:
        captions["sweeps"] = ("sweeps.png", "sweeps.rst", "Plots")
    return {
        name: report(report_path(file), caption=f"../report/{caption}", category=category)
        for name, (file, caption, category) in captions.items()
    }


def get_report_inputs(wildcards):
    """Each evaluation's metrics, predictions and prepared split (for the examples' images), and each
    stage's summary and log, in the order of the labels below."""
    evaluations, stages = report_jobs()
    return {
        "metrics": [eval_path(*job, "metrics.json") for job in evaluations],
        "predictions": [eval_path(*job, "predictions.jsonl") for job in evaluations],
        "prepared": [
            prepared_path(PLAN.eval_settings(experiment, stage, config["evaluation"])["dataset"], split)
            for experiment, stage, split in evaluations
        ],
        "summaries": [stage_path(s.experiment, s.name, "summary.json") for s in stages],
        "logs": [stage_path(s.experiment, s.name, "log.jsonl") for s in stages],
        # Which of a sweep's arms keep_best stopped, and why.
        "selections": [checkpoints.keep_best_arms.get(sweep=sweep).output.kept for sweep in sorted(PLAN.selections)],
    }


def get_report_image_roots(wildcards, input):
    """The image root of each evaluation's split, in the order of the labels below: where the
    examples' images lie (derived from the input: a moved dataset reruns no report)."""
    evaluations, _ = report_jobs()
    datasets = [PLAN.eval_settings(e, s, config["evaluation"])["dataset"] for e, s, _ in evaluations]
    return [config["datasets"][d]["image_root"] for d in datasets]


def get_report_labels(wildcards):
    """What the report's inputs are of: experiment/stage/split per evaluation, experiment/stage per stage
    and the stage it started from."""
    evaluations, stages = report_jobs()
    return {
        "evaluations": ["/".join(job) for job in evaluations],
        "stages": [s.id for s in stages],
        "init_from": [s.init_from or "-" for s in stages],
    }


def write_report_inputs(path, log, input, params) -> None:
    """The report's inputs file (scripts/report.py --inputs): each list in the order of its labels."""
    names = ("metrics", "predictions", "prepared", "summaries", "logs", "selections")
    inputs = {name: list(input[name]) for name in names} | dict(params.labels)
    write_json(path, inputs | {"image_roots": list(params.image_roots), "sweeps": json.loads(params.sweeps)})
    Path(log).write_text(f"{len(inputs['metrics'])} evaluations and {len(inputs['summaries'])} stages\n")
