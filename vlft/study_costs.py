"""A study's jobs priced before they run: the plan's stages and evaluations joined to their data's
counts and to the throughputs of the device they will run on (vlft.costs), refined by the study's
own finished jobs; and the dry run's table of what the jobs that would run cost."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from functools import cached_property
from pathlib import Path

from vlft import parallelism
from vlft.parallelism import Layout
from vlft.costs import (
    CountsMemo,
    ModelShape,
    Prediction,
    Refinement,
    SplitCounts,
    attempts_needed,
    duration,
    eval_seconds,
    runtime_minutes,
    train_seconds,
    vision_cache_seconds,
    wall_seconds,
)
from vlft.devices import device_specs, devices, throughputs
from vlft.digests import DigestMemo, split_digest
from vlft.jobs.cli import took_seconds
from vlft.model_files import hub_files_dir
from vlft.plan import Plan


def local_gpu() -> str | None:
    """This machine's first GPU by its name in the throughput table (nvidia-smi's, "NVIDIA H100 80GB
    HBM3" -> H100), or None where it has none the table names."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = names.splitlines()[0] if names.strip() else ""
    return next((d for d in devices() if d.lower() != "cpu" and d.lower() in first.lower()), None)


# A GPU's one-time costs by the kind of job that pays them: (job names' start, the table's quantity, what it is).
ONCE_A_GPU = (
    ("train", "train_once_s", "the training step's compile"),
    ("evaluate", "eval_once_s", "the model's first read and the answering's compile"),
)


class StudyCosts:
    def __init__(self, plan: Plan, config: dict, digests: DigestMemo, results: str):
        self.plan, self.config, self.digests, self.results = plan, config, digests, results
        self.planning = config["planning"]
        self.memo = CountsMemo(Path(digests.path).parent / "counts")
        self.split_digests: dict[tuple, str] = {}

    @cached_property
    def device(self) -> tuple[str, str]:
        """The device the jobs are predicted on, and why that one."""
        if self.planning["device"]:
            return self.planning["device"], "planning.device"
        if gpu := local_gpu():
            return gpu, "this machine's GPU"
        if self.config["cpu_fallback"]:
            return "cpu", "no GPU here, and cpu_fallback"
        return "H100", "assumed: set planning.device to the GPU your jobs get"

    @cached_property
    def shape(self) -> ModelShape | None:
        """The model's size and image layout: from its directory, or for a model named by its Hub id
        and not fetched yet, from its config, processor and tokenizer files fetched alone."""
        model = Path(self.config["model"]["path"])
        needed = ("config.json", "preprocessor_config.json", "tokenizer.json")
        if not all((model / name).is_file() for name in needed[:2]):
            hub_id = self.config["model"].get("hub_id")
            model = hub_id and hub_files_dir(hub_id, self.config["model"].get("revision"), needed)
            if not model:
                return None
        try:
            return ModelShape.of(model)
        except (OSError, ValueError, KeyError, TypeError):  # a config of another shape: predict nothing
            return None

    @cached_property
    def rate(self):
        return throughputs(self.device[0], self.shape.compute_params) if self.shape else None

    def counts(self, dataset: str, splits: list[str], settings: dict, filters: dict) -> SplitCounts | None:
        """What the splits hold under the filter; None where a records file is not there yet."""
        described = self.config["datasets"][dataset]
        total = SplitCounts()
        for split in splits:
            records = described["splits"][split]
            if not Path(records).is_file():
                return None
            key = (records, described["image_root"])
            if key not in self.split_digests:  # once a plan: it stats each of the split's images
                self.split_digests[key] = split_digest(records, described["image_root"], self.digests)
            digest = self.split_digests[key]
            pixels = (settings["min_pixels"], settings["max_pixels"])
            total += self.memo.counts(digest, records, described["image_root"], self.shape, pixels, filters)
        return total

    def _unrefined_train(self, stage_id: str) -> Prediction | None:
        if self.rate is None:
            return None
        stage = self.plan.stages[stage_id]
        settings = stage.settings
        counts = self.counts(settings["dataset"], settings["train_splits"], settings, settings["filter"] or {})
        # A stage that starts from another trains that stage's adapter, made with its chain's first stage's dropout.
        made_by = ([stage] + self.plan.ancestors(stage))[-1]
        if not counts:
            return None
        return train_seconds(settings, counts, self.rate, made_by.settings["lora_dropout"], self.layout(settings))

    def layout(self, settings: dict) -> Layout:
        """How a stage's job runs on the planned device: its processes, and whether they shard the
        base (vlft.parallelism, decided with the device's memory)."""
        resources = settings["resources"]
        nodes = resources["nodes"]
        processes = max(resources["gpus"], 1) * nodes
        spec = {name.lower(): row for name, row in device_specs().items()}.get(self.device[0].lower())
        memory = float(spec["memory_gb"]) * 1e9 if spec else None
        weights = parallelism.weight_bytes(self.config["model"]["path"]) or 2 * self.shape.compute_params
        sharded = parallelism.chosen(resources["parallelism"], settings, processes, weights, memory) == "shard"
        link = float(spec["link_gb_s"]) if spec else 0.0
        return Layout(processes, nodes, sharded, 2 * self.shape.layer_params, link)  # bf16: 2 bytes a weight

    def _unrefined_eval(self, experiment: str, stage: str, split: str) -> Prediction | None:
        if self.rate is None:
            return None
        settings = self.plan.eval_settings(experiment, stage, self.config["evaluation"])
        counts = self.counts(settings["dataset"], [split], settings, {})
        shape = (settings["dataset"], split, settings["min_pixels"], settings["max_pixels"])
        return eval_seconds(self.config["evaluation"], counts, self.rate, shape) if counts else None

    def vision_cache(self, dataset: str, split: str, pixels: str) -> Prediction | None:
        if self.rate is None:
            return None
        low, high = (int(p) for p in pixels.split("-"))
        counts = self.counts(dataset, [split], {"min_pixels": low, "max_pixels": high}, {})
        return vision_cache_seconds(counts, self.rate) if counts else None

    @cached_property
    def refinement(self) -> Refinement:
        """Measured against predicted, over the study's jobs that have run on this kind of device."""
        refinement = Refinement()
        on_cpu = self.device[0].lower() == "cpu"

        def alike(measured: dict | None) -> bool:
            # Run on the kind of device predicted for (a GPU job's "cuda:0"), in one piece.
            device = (measured or {}).get("device")
            return device is not None and (device == "cpu") == on_cpu and not measured.get("steps_before")

        def whole(measured: dict, log: Path) -> float:
            # The job's time launch to exit, as predicted; its summary's own time (start to outputs)
            # where its log has none (a log from before logs said it).
            return took_seconds(log) or measured["wall_time_s"]

        for stage_id in self.plan.stages:
            measured = _read(Path(self.results, "train", stage_id, "summary.json"))
            if alike(measured) and (prediction := self._unrefined_train(stage_id)):
                log = Path(self.results, "logs", "train", f"{stage_id}.log")
                refinement.add("train", prediction, whole(measured, log))
        for experiment, stage, split in self.plan.evaluations():
            measured = _read(Path(self.results, "eval", experiment, stage, split, "metrics.json"))
            if alike(measured) and (prediction := self._unrefined_eval(experiment, stage, split)):
                log = Path(self.results, "logs", "evaluate", experiment, stage, f"{split}.log")
                refinement.add("evaluate", prediction, whole(measured, log))
        return refinement

    def train(self, experiment: str, stage: str) -> Prediction | None:
        prediction = self._unrefined_train(f"{experiment}/{stage}")
        return prediction and prediction.refined(self.refinement.ratio("train"))

    def evaluation(self, experiment: str, stage: str, split: str) -> Prediction | None:
        prediction = self._unrefined_eval(experiment, stage, split)
        return prediction and prediction.refined(self.refinement.ratio("evaluate"))

    def runtime(self, prediction: Prediction | None, fallback: int) -> int:
        """A job's time limit in minutes: its prediction with the margin and floor, or `fallback`
        where it has none (its data or model is made by the run itself)."""
        if prediction is None:
            return fallback
        return runtime_minutes(prediction.seconds, self.planning["margin"], self.planning["floor_minutes"])

    def heading(self) -> list[str]:
        """The table's first lines: the device and where its throughputs come from, and how this
        study's finished jobs refined them."""
        device, why = self.device
        if self.shape is None:
            source = "the model is not on disk yet: nothing can be counted"
        elif self.rate is None:
            source = f"vlft/throughputs.csv has no row for {device}: nothing can be timed"
        else:
            source = self.rate.derived or f"throughputs measured on {self.rate.model}"
        lines = [f"Predicted time of the jobs that would run, on {device} ({why}; {source}):"]
        refinement = self.refinement
        for kind in ("train", "evaluate"):
            if refinement.jobs(kind):
                lines.append(
                    f"  {kind}: refined by {refinement.jobs(kind)} of this study's finished jobs "
                    f"(measured / predicted {refinement.ratio(kind):.2f})"
                )
        return lines

    def lines(
        self,
        jobs: list[tuple],
        needs: dict,
        capacity: float,
        capacity_named: str,
        ceiling: int | None,
        retries: int,
        cpu_jobs: dict[str, int],
    ) -> list[str]:
        """The dry run's table: `jobs` as (job, name, prediction or None, GPUs), then the plan's
        GPU-hours and wall time at `capacity` GPUs, and the stages longer than `ceiling` minutes (a
        partition's limit) with the attempts they take, more than `retries` allows said."""
        priced = sorted(jobs, key=lambda job: (not job[1].startswith("train"), job[1]))
        if not priced:
            return []
        device = self.device[0]
        lines = self.heading()
        width = max(len(name) for _, name, _, _ in priced)
        split_up = []
        for job, name, prediction, gpus in priced:
            if prediction is None:
                lines.append(f"  {name:<{width}}  not predicted")
                continue
            lines.append(f"  {name:<{width}}  {duration(prediction.seconds):>8}  {prediction.what}")
            if ceiling and name.startswith("train ") and prediction.seconds * self.planning["margin"] > ceiling * 60:
                attempts = attempts_needed(prediction.seconds, self.planning["margin"], ceiling)
                short = (
                    f"; Snakemake's --retries ({retries}) allows {retries + 1}: raise it"
                    if attempts > retries + 1
                    else ""
                )
                split_up.append(
                    f"  {name} needs more than the {ceiling} min a job may run: it runs as {attempts} attempts, "
                    f"each stopping before its limit and the next resuming{short}"
                )
        durations = {job: (p.seconds if p else 0.0) for job, _, p, _ in priced}
        gpu_hours = sum((p.seconds * max(g, 1) if p else 0.0) for _, _, p, g in priced) / 3600
        wall = wall_seconds(durations, needs, {job: g for job, _, _, g in priced}, capacity)
        uncounted = sum(p is None for _, _, p, _ in priced)
        if cpu_jobs:
            named = ", ".join(f"{count} {rule}" for rule, count in sorted(cpu_jobs.items()))
            lines.append(f"  not predicted: the CPU jobs ({named})")
        hours = "GPU-hours" if device.lower() != "cpu" else "hours of jobs"
        # What each GPU pays with its first job of a kind (the layers' compile; for evaluations also the
        # model's first read): not in the jobs' times, so that each job's own can be checked.
        for kind, quantity, what in ONCE_A_GPU:
            once = self.rate[quantity] if self.rate else 0.0
            of_kind = sum(name.startswith(kind) for _, name, _, _ in priced)
            if once and of_kind:
                gpu_hours += once * min(capacity, of_kind) / 3600
                wall += once
                lines.append(f"  once a GPU, before its first {kind} job: {duration(once)} ({what})")
        shapes = {p.compiles for _, _, p, _ in priced if p and p.compiles}
        compile_s = len(shapes) * (self.rate["eval_compile_s"] if self.rate else 0.0)
        if compile_s:  # paid by whichever evaluation of each shape runs first
            gpu_hours += compile_s / 3600
            wall += compile_s
            lines.append(
                f"  once an evaluation shape (a split at its pixels), its decode step's compile: "
                f"{len(shapes)} x {duration(compile_s / len(shapes))}"
            )
        lines.append(
            f"  total: {gpu_hours:.2f} {hours}; wall time {duration(wall)} at {capacity_named}"
            + (f"; {uncounted} job(s) not predicted (their data or model is made by this run)" if uncounted else "")
        )
        if split_up:
            lines.append("Longer than the partition allows:")
            lines += split_up
        return lines


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def capacity_of(resources: dict, nodes) -> tuple[float, str]:
    """The GPUs the plan's jobs share: --resources gpu=N, else the jobs Snakemake runs at once (a
    SLURM profile's `jobs`; on this machine, one a core of --cores), else unbounded (the longest chain)."""
    gpu, cores = resources.get("gpu"), resources.get("_cores")
    if isinstance(gpu, int) and gpu < 10**9:
        return gpu, f"gpu={gpu}"
    if isinstance(nodes, int) and nodes < 10**9:
        return nodes, f"{nodes} jobs at once"
    if isinstance(cores, int) and cores < 10**9:
        return cores, f"{cores} jobs at once (--cores {cores})"
    return math.inf, "as many GPUs as jobs (the longest chain)"
