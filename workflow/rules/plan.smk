# The study's plan, from the config: the config checked and resolved, the plan of every stage
# (vlft.plan), the content digests, stages trained once, each job's predicted cost, and what a dry
# run prints of it. (What the driver's own process sets up is vlft.jobs.driver's, called from the
# Snakefile.) Paths are in paths.smk, the rules' inputs and params in inputs.smk, their resources
# in resources.smk.
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from vlft.config import check_config_files, resolve_config, results_directory
from vlft.digests import DigestMemo, model_changes, model_digests
from vlft.empty_outputs import TO_REMAKE, remove_empty_outputs, still_to_remake
from vlft.errors import ConfigError
from vlft.families import family_problem
from vlft.model_files import model_config_file, model_dir_problem
from vlft.plan import build_plan
from vlft.study_costs import StudyCosts, capacity_of
from vlft.study_progress import PlannedJob
from vlft.trained_once import shared_lines, trained_once
from vlft.training.trackers import PACKAGES, missing_packages

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
    # A family whose layers our packed rows or decode cache would compute wrong trains nothing (vlft.families).
    if (model_config := model_config_file(config["model"])) and (problem := family_problem(model_config)):
        raise ConfigError(f"model: {model_config} {problem}")
    if missing := missing_packages(config["report_to"]):
        raise ConfigError(
            f"report_to: {', '.join(missing)} is not installed here (pip install -e '.[trackers]', or pip install "
            f"{' '.join(p for m in missing for p in PACKAGES[m])})"
        )
except ConfigError as err:
    raise WorkflowError(f"Invalid config: {err}") from None

RESULTS = config["results"]
# Outputs a stat shows unusable (an empty adapter, a cache without its index) are removed before
# the plan is made, and `all` asks for them until they are made again (vlft.empty_outputs).
for sentence in remove_empty_outputs(RESULTS, TO_REMAKE):
    print(sentence, file=sys.stderr)
# What the plan decided otherwise than the config asked (vlft.plan.Plan.notes).
for sentence in PLAN.notes:
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


def priced_jobs(costs=COSTS):
    """The jobs this run would run, each as (job, its name, its predicted time or None, its GPUs), the
    CPU jobs counted by rule, and what each job waits for."""
    jobs, needs, cpu_jobs = [], {}, {}
    for job in workflow.dag.needrun_jobs(exclude_finished=False):
        needs[job] = list(workflow.dag.job_dependencies(job))
        w, step = job.wildcards, job.rule.name
        if step == "train":
            gpus = PLAN.resources(w.experiment, w.stage)["gpus"]
            jobs.append((job, f"train {w.experiment}/{w.stage}", costs.train(w.experiment, w.stage), gpus))
        elif step == "evaluate":
            prediction = costs.evaluation(w.experiment, w.stage, w.split)
            gpus = config["evaluation"]["resources"]["gpus"]
            jobs.append((job, f"evaluate {w.experiment}/{w.stage} on {w.split}", prediction, gpus))
        elif step == "cache_vision":
            prediction = costs.vision_cache(w.dataset, w.split, w.pixels)
            jobs.append((job, f"cache_vision {w.dataset}/{w.split}", prediction, PLAN.defaults["resources"]["gpus"]))
        elif step != "all":
            cpu_jobs[step] = cpu_jobs.get(step, 0) + 1
    return jobs, needs, cpu_jobs


def study_capacity():
    """The GPUs the run's jobs share, and how that was told (vlft.study_costs.capacity_of)."""
    resources = {name: getattr(value, "value", value) for name, value in workflow.global_resources.items()}
    if workflow.dryrun and resources.get("_cores") == 1:
        # Snakemake's dry run takes --cores 1 where none is given: the run's own --cores will say.
        resources.pop("_cores")
    return capacity_of(resources, resources.get("_nodes"))


def planned_jobs(again=False):
    """The run's jobs as the study's progress counts them (vlft.study_progress); `again`: priced anew,
    from the data and model this run has made since it started."""
    jobs, needs, _ = priced_jobs(StudyCosts(PLAN, config, DIGESTS, RESULTS) if again else COSTS)
    priced = {job: (prediction, gpus) for job, _, prediction, gpus in jobs}
    planned = []
    for job, waits_for in needs.items():
        prediction, gpus = priced.get(job, (None, 0))
        ids = tuple(workflow.dag.jobid(other) for other in waits_for if other in needs)
        planned.append(PlannedJob(workflow.dag.jobid(job), job.rule.name, prediction and prediction.seconds, gpus, ids))
    return planned


def print_dry_run_costs():
    """After a dry run (Snakemake calls no hook there: atexit), what the jobs that would run cost."""
    if not workflow.dryrun or workflow.dag is None:
        return
    jobs, needs, cpu_jobs = priced_jobs()
    capacity, named = study_capacity()
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
