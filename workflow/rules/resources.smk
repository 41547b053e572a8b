# The GPU jobs' resources (time, memory, GPUs) from their stages and the predictions (plan.smk),
# and every request checked against the SLURM partition's nodes at plan time (vlft.jobs.partition).
import functools
import sys

from vlft.jobs.partition import Request, cpu_line, over_line, read_partition
from vlft.plan import retry_runtime

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


# A stage across nodes (resources.nodes > 1) is one SLURM job of that many nodes, whose command
# starts one launcher a node (vlft.jobs.distributed.relaunch: srun, then torchrun on each node).
# snakemake-executor-plugin-slurm builds its sbatch line from these resources: `mpi` runs the rule's
# command in the batch step (not under `srun -n1`), `tasks` asks for one task a node, and
# `tasks_per_gpu: 0` keeps it from turning `tasks` into --ntasks-per-gpu. Its `gpu` resource is a
# job-wide total (--gpus), so such a job asks for its GPUs as `gres`, which SLURM reads per node.
# Each is None (not set) for a stage on one node, whose job is submitted as before.
def get_node_resource(key):
    """A train job's SLURM resource `key` that only a stage across nodes sets (see above)."""

    def resource(wildcards, attempt):
        nodes = PLAN.resources(wildcards.experiment, wildcards.stage)["nodes"]
        gpus = get_stage_resource("gpus")(wildcards, attempt)
        if key == "gpu":
            return gpus if nodes == 1 else None
        if nodes == 1:
            return None
        return {"mpi": "srun", "tasks": nodes, "tasks_per_gpu": 0, "gres": f"gpu:{gpus}" if gpus else None}[key]

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


def job_threads(asked):
    """A rule's threads: `asked` (or `asked(wildcards)`, a stage's own), or the CPUs of the SLURM
    partition's nodes where they have fewer (a job asking for more would wait in the queue forever), said once."""

    def threads(wildcards):
        count = asked(wildcards) if callable(asked) else asked
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
