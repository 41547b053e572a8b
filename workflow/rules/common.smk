# Config -> plan, output paths, and the get_* input functions of every rule. (What the driver's own
# process sets up is vlft.jobs.driver's, called from the Snakefile.)
import functools
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from vlft.config import check_config_files, resolve_config, results_directory
from vlft.digests import DigestMemo, model_changes, model_digests, split_digest
from vlft.study_costs import StudyCosts, capacity_of
from vlft.empty_outputs import TO_REMAKE, remove_empty_outputs, still_to_remake
from vlft.files import write_json
from vlft.errors import ConfigError, InputError
from vlft.jobs.partition import Request, cpu_line, over_line, read_partition
from vlft.model_files import model_dir_problem
from vlft.training.trackers import PACKAGES, missing_packages
from vlft.plan import BASE_EXPERIMENT, build_plan, pixels_tag, retry_runtime
from vlft.trained_once import shared_lines, trained_once
from vlft.rerun_policy import apply_when_planned

try:
    # Snakemake has read the files already, keeping the last of a key written twice: say so instead.
    check_config_files(workflow.configfiles)
    # In place: the rules read `config` too. Keys the file leaves out take the schema's defaults.
    config.update(resolve_config(config))
    # A study of its own lands in results/<its config file's name> unless it names a directory.
    config["results"] = results_directory(config, workflow.overwrite_configfiles)
    PLAN = build_plan(config)
    # A checkpoint copied in part fails here, before any job. One not there yet leaves dry runs be
    # (Snakemake names it as a missing input of the first job that reads it); the demo's is made by a rule.
    model_path = Path(config["model"]["path"])
    if "model" not in config.get("demo", {}) and model_path.exists() and (problem := model_dir_problem(model_path)):
        raise ConfigError(f"model.path: {model_path} {problem}")
    if missing := missing_packages(config["report_to"]):
        raise ConfigError(
            f"report_to: {', '.join(missing)} is not installed here (pip install -e '.[trackers]', or pip install "
            f"{' '.join(PACKAGES[m] for m in missing)})"
        )
except ConfigError as err:
    raise WorkflowError(f"Invalid config: {err}") from None

RESULTS = config["results"]
# Outputs a stat shows unusable (an empty adapter, a cache without its index) are removed before
# the plan is made, and `all` asks for them until they are made again (vlft.empty_outputs).
for sentence in remove_empty_outputs(RESULTS, TO_REMAKE):
    print(sentence, file=sys.stderr)
MODEL = config["model"]["path"]
TRUST_REMOTE_CODE = "--trust-remote-code" if config["model"]["trust_remote_code"] else ""
# GPU jobs fail where CUDA is not usable, unless the config lets them run on the CPU (the demo's).
# A resource of the GPU rules, not a param: allowing it reruns nothing.
CPU_FALLBACK = int(config["cpu_fallback"])
# The datasets the demo builds, by name: {kind, sizes, seed}.
DEMO_DATASETS = config.get("demo", {}).get("datasets", {})
# The model, made by a rule of this workflow (the demo's, or one fetched by its Hub id) rather than given.
MODEL_MADE_HERE = "model" in config.get("demo", {}) or "hub_id" in config["model"]
# Digests of the model's and the datasets' content, kept between plans beside Snakemake's own
# records of the jobs (vlft.digests): a plan writes nothing under the results.
DIGESTS = DigestMemo(".snakemake/vlft/digests.json")
# Which of the model's files changed since the last plan, said once: a rerun's reason names a digest.
if not MODEL_MADE_HERE and Path(MODEL).is_dir():
    model_digests(MODEL, DIGESTS)
    if changes := model_changes(DIGESTS):
        print(changes, file=sys.stderr)
# Stages that would compute one adapter, trained once: stage id -> the stage trained for it, whose
# outputs are its outputs (`stage_path`, `eval_path`). One that has outputs of its own keeps them.
TRAINED_ONCE = trained_once(
    PLAN,
    lambda dataset, split: config["datasets"][dataset]["splits"][split],
    lambda stage: Path(f"{RESULTS}/train/{stage.experiment}/{stage.name}/summary.json").exists(),
)
for sentence in shared_lines(TRAINED_ONCE):
    print(sentence, file=sys.stderr)
# Each training and evaluation job's predicted time, from its data's counts and measured
# throughputs (vlft.study_costs): its SLURM time limit where the config sets none, and the dry run's table.
COSTS = StudyCosts(PLAN, config, DIGESTS, RESULTS)


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


# Minutes a GPU job asks for where nothing predicts its time (its data or model is made by the run).
UNPREDICTED_RUNTIME = 360


def get_predicted_seconds(wildcards):
    """A resource: the job's predicted seconds (0 where it has none), for its log to set beside what
    it took; a resource, so a refined prediction reruns nothing."""
    if "split" in wildcards.keys():
        prediction = COSTS.evaluation(wildcards.experiment, wildcards.stage, wildcards.split)
    else:
        prediction = COSTS.train(wildcards.experiment, wildcards.stage)
    return round(prediction.seconds) if prediction else 0


def print_dry_run_costs():
    """After a dry run (Snakemake calls no hook there: atexit), what the jobs that would run cost."""
    if not workflow.dryrun or workflow.dag is None:
        return
    jobs, needs, cpu_jobs = [], {}, {}
    for job in workflow.dag.needrun_jobs(exclude_finished=False):
        needs[job] = list(workflow.dag.job_dependencies(job))
        w, step = job.wildcards, job.rule.name
        if step == "train":
            gpus = PLAN.resources(w.experiment, w.stage)["gpus"]
            jobs.append((job, f"train {w.experiment}/{w.stage}", COSTS.train(w.experiment, w.stage), gpus))
        elif step == "evaluate":
            prediction = COSTS.evaluation(w.experiment, w.stage, w.split)
            gpus = config["evaluation"]["resources"]["gpus"]
            jobs.append((job, f"evaluate {w.experiment}/{w.stage} on {w.split}", prediction, gpus))
        elif step == "cache_vision":
            prediction = COSTS.vision_cache(w.dataset, w.split, w.pixels)
            jobs.append((job, f"cache_vision {w.dataset}/{w.split}", prediction, PLAN.defaults["resources"]["gpus"]))
        elif step != "all":
            cpu_jobs[step] = cpu_jobs.get(step, 0) + 1
    resources = {name: getattr(value, "value", value) for name, value in workflow.global_resources.items()}
    capacity, named = capacity_of(resources, resources.get("_nodes"))
    # The most a job may run: max_runtime, else the SLURM partition's own limit.
    partition = slurm_partition()
    ceiling = config["max_runtime"] or (partition.time_limit_min if partition else None)
    retries = workflow.execution_settings.retries or 0
    for line in COSTS.lines(jobs, needs, capacity, named, ceiling, retries, cpu_jobs):
        print(line, file=sys.stderr)
    for sweep, selection in PLAN.selections.items():
        if any(job.rule.name == "keep_best_arms" and job.wildcards.sweep == sweep for job in needs):
            print(
                f"  sweep {sweep}: after {selection['after']}, the best {selection['arms']} of its "
                f"{len(selection['candidates'])} arms go on; their later stages are planned (and priced) then",
                file=sys.stderr,
            )


def get_stage_resource(key, default=False):
    """A GPU job's resource from its stage's `resources` (inherited from `defaults`; `default` takes
    `defaults` itself, for jobs of no one stage); runtime grows with each retry, so a job killed at
    its time limit gets longer the next time, up to max_runtime."""

    def resource(wildcards, attempt):
        if default:
            value, job, keys = PLAN.defaults["resources"][key], "a vision cache", f"defaults.resources.{key}"
            if value is None:  # runtime: from the prediction
                prediction = COSTS.vision_cache(wildcards.dataset, wildcards.split, wildcards.pixels)
                value = COSTS.runtime(prediction, UNPREDICTED_RUNTIME)
        else:
            value = PLAN.resources(wildcards.experiment, wildcards.stage)[key]
            job, keys = (
                f"train {wildcards.experiment}/{wildcards.stage}",
                f"resources.{key} of the stage or of defaults",
            )
            if value is None:  # runtime: from the prediction
                value = COSTS.runtime(COSTS.train(wildcards.experiment, wildcards.stage), UNPREDICTED_RUNTIME)
        return checked_request(job, key, value, keys, attempt)

    return resource


def get_eval_resource(key):
    """An evaluation job's resource, from the config's `evaluation.resources`; runtime grows with each retry, up to max_runtime."""

    def resource(wildcards, attempt):
        value = config["evaluation"]["resources"][key]
        if value is None:  # runtime: from the prediction
            prediction = COSTS.evaluation(wildcards.experiment, wildcards.stage, wildcards.split)
            value = COSTS.runtime(prediction, UNPREDICTED_RUNTIME)
        return checked_request("evaluate", key, value, f"evaluation.resources.{key}", attempt)

    return resource


def checked_request(job, key, value, keys, attempt):
    """A GPU job's request for its attempt (runtime grows with each retry, up to max_runtime), checked
    against the SLURM partition's nodes, max_runtime too (the last retries ask for it)."""
    resource = "gpu" if key == "gpus" else key
    if key == "runtime":
        if config["max_runtime"] is not None:
            within_partition("the retries of train and evaluate", "runtime", config["max_runtime"], "max_runtime")
        value = retry_runtime(value, attempt, config["max_runtime"])
    return within_partition(job, resource, value, keys)


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


def outputs_to_remake():
    """The outputs removed as damaged and not made since, where this config's plan still makes them."""
    datasets = config["datasets"]
    evaluations = {"/".join(job) for job in PLAN.evaluations()}

    def planned(path):
        if not Path(path).is_relative_to(RESULTS):  # another study's (a results directory of its own)
            return False
        parts = Path(path).relative_to(RESULTS).parts
        if parts[0] == "train":
            return f"{parts[1]}/{parts[2]}" in PLAN.stages
        if parts[0] == "eval":
            return "/".join(parts[1:4]) in evaluations
        dataset, split = (parts[1], parts[2].removesuffix(".jsonl")) if parts[0] == "prepared" else parts[2:4]
        return dataset in datasets and split in datasets[dataset]["splits"]

    return [path for path in still_to_remake(TO_REMAKE) if planned(path)]


@functools.cache
def slurm_partition():
    """The SLURM partition the jobs go to, as sinfo describes it, under the SLURM executor (and in its
    dry runs, where a partition is named); None elsewhere (vlft.jobs.partition)."""
    named = (workflow.resource_settings.default_resources or {}).get("slurm_partition")
    executor = workflow.executor_plugin.name if workflow.executor_plugin is not None else None
    if named is None or executor not in ("slurm", "dryrun"):
        return None
    return read_partition(str(named.raw).strip("'\""))


def within_partition(job, resource, value, keys):
    """A job's request, unchanged; where it is more than the SLURM partition offers (the job would
    wait in the queue forever), one line says so at plan time, naming `keys`, what sets it."""
    partition = slurm_partition()
    if partition is not None and (line := over_line(partition, Request(job, resource, value, keys))):
        say_once(line)
    return value


@functools.cache
def say_once(line):
    print(line, file=sys.stderr)


def job_threads(count):
    """A rule's threads: `count`, or the CPUs of the SLURM partition's nodes where they have fewer (a
    job asking for more would wait in the queue forever), said once."""

    def threads(wildcards):
        partition = slurm_partition()
        if partition is None or partition.cpus >= count:
            return count
        say_once(cpu_line(partition))
        return partition.cpus

    return threads


def rule_memory(name, mb):
    """A rule's own memory request (mem_mb), checked against the SLURM partition's nodes."""
    return lambda wildcards: within_partition(
        name, "mem_mb", mb, f"the {name} rule's own; set-resources {name}: mem_mb"
    )
