"""Turn the validated config into a plan: every experiment x stage with its resolved settings.

A stage's settings are the schema's defaults (vlft.config.stage_defaults), overridden by the
config's `defaults` section, overridden by the stage's own keys.
Each stage's resolved settings are exactly what its training job depends on, so Snakemake's
params trigger reruns a stage when, and only when, its own settings change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from vlft.config import METHOD_DEFAULTS, load_schema, stage_defaults
from vlft import parallelism
from vlft.errors import ConfigError, InputError
from vlft.model_files import checkpoint_pixels, hub_processor_dir, model_dir_problem
from vlft.data.answers import AnswerFormat
from vlft.data.records import selection_problem
from vlft.sweeps import arm_selections, expand_sweeps
from vlft.stage_params import (
    LEFT_OUT_WHEN_OFF,
    LEFT_OUT_WITH,
    LORA_KEYS,
    LOSS_TYPES,
    METHOD_KEYS,
    RUN_ONLY_KEYS,
    schedule_problem,
    trains_vision,
    warmup_steps,
)

BASE_EXPERIMENT = "base"
BASE_STAGE = "base"


@dataclass(frozen=True)
class Stage:
    experiment: str
    name: str
    index: int
    settings: dict
    init_from: str | None = None  # "experiment/stage"

    @property
    def id(self) -> str:
        return f"{self.experiment}/{self.name}"

    @property
    def key(self) -> str:
        return f"experiments.{self.experiment}.stages[{self.index}]"

    def train_params(self) -> dict:
        """What the training job computes from: everything but run-only keys."""
        return {k: v for k, v in self.settings.items() if k not in RUN_ONLY_KEYS and not self._off(k)}

    def _off(self, key: str) -> bool:
        methods = [method for method, keys in METHOD_KEYS.items() if key in keys]
        if methods and self.settings["method"] not in methods:
            return True
        key = LEFT_OUT_WITH.get(key, key)
        return key in LEFT_OUT_WHEN_OFF and self.settings[key] == LEFT_OUT_WHEN_OFF[key]

    @property
    def eval_split(self) -> str | None:
        """The split its evaluations during training draw from, where it has them; a preference
        stage's held-out pairs come from it too (vlft.training.held_out_pairs)."""
        if not self.settings["eval_every"] and self.settings["method"] != "dpo":
            return None
        return self.settings["eval_split"] or (self.settings["eval_splits"] or [None])[0]

    def pixels(self) -> str:
        return pixels_tag(self.settings["min_pixels"], self.settings["max_pixels"])


@dataclass
class Plan:
    stages: dict[str, Stage] = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)
    # Each experiment a sweep expanded into (vlft.sweeps): the sweep's name, its values, its last stage.
    sweeps: dict[str, dict] = field(default_factory=dict)
    # Sweeps that keep only their best arms past a stage (vlft.sweeps.arm_selections), by name.
    selections: dict[str, dict] = field(default_factory=dict)
    # What the plan decided otherwise than the config asked, a sentence each, said when it is made.
    notes: list[str] = field(default_factory=list)

    def selection_of(self, stage: Stage) -> str | None:
        """The sweep whose keep_best decides whether this stage trains: a stage after `after` of
        one of its arms; None for every other stage."""
        sweep = self.sweeps.get(stage.experiment)
        selection = sweep and self.selections.get(sweep["experiment"])
        if not selection:
            return None
        return sweep["experiment"] if stage.index > self.stage(stage.experiment, selection["after"]).index else None

    def stage(self, experiment: str, name: str) -> Stage:
        return self.stages[f"{experiment}/{name}"]

    def ancestors(self, stage: Stage) -> list[Stage]:
        """The chain of stages this one starts from, nearest first."""
        chain = []
        while stage.init_from:
            stage = self.stages[stage.init_from]
            chain.append(stage)
        return chain

    def base_stage(self, dataset: str) -> str:
        """The base model's "stage" on a dataset: `base` on the defaults' dataset, else the dataset's
        name (so that a one-dataset study's paths stay results/eval/base/base/<split>)."""
        return BASE_STAGE if dataset == self.defaults["dataset"] else dataset

    def base_dataset(self, stage: str) -> str:
        """The dataset of the base model's evaluation named `stage`: the inverse of base_stage."""
        return self.defaults["dataset"] if stage == BASE_STAGE else stage

    def evaluations(self) -> list[tuple[str, str, str]]:
        """(experiment, stage, split) for every trained stage, and for the untrained base model on
        every split of every dataset that a stage is evaluated on."""
        jobs = []
        base = set()
        for stage in self.stages.values():
            for split in stage.settings["eval_splits"]:
                jobs.append((stage.experiment, stage.name, split))
                base.add((self.base_stage(stage.settings["dataset"]), split))
        jobs += [(BASE_EXPERIMENT, stage, split) for stage, split in sorted(base)]
        return jobs

    def resources(self, experiment: str, stage: str) -> dict:
        """The cluster request of a stage's training job."""
        return self.stage(experiment, stage).settings["resources"]

    def eval_settings(self, experiment: str, stage: str, evaluation: dict) -> dict:
        """Everything an evaluation depends on: its stage's data and format, and the eval options."""
        if experiment == BASE_EXPERIMENT:
            # The base model answers directly: clicks on a dataset whose stages click, else the final answer.
            dataset = self.base_dataset(stage)
            clicks = any(
                s.settings["answer_format"] == AnswerFormat.CLICK
                for s in self.stages.values()
                if s.settings["dataset"] == dataset
            )
            source = dict(
                self.defaults,
                dataset=dataset,
                answer_format=(AnswerFormat.CLICK if clicks else AnswerFormat.FINAL).value,
            )
        else:
            source = self.stage(experiment, stage).settings
        keys = ("dataset", "answer_format", "min_pixels", "max_pixels", "max_seq_len")
        # Its resources say how the job runs, not what it computes.
        options = {k: v for k, v in evaluation.items() if k != "resources"}
        return {**{k: source[k] for k in keys}, **options}


def pixels_tag(min_pixels: int, max_pixels: int) -> str:
    return f"{min_pixels}-{max_pixels}"


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "filter":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def build_plan(config: dict) -> Plan:
    """Resolve every stage and check what the schema cannot: references between parts of the config."""
    datasets = config.get("datasets", {})
    defaults = _merge(stage_defaults(), config.get("defaults", {}))
    if "dataset" not in defaults:
        if len(datasets) != 1:
            # The untrained base model is evaluated on the defaults' dataset.
            raise ConfigError(
                f"defaults.dataset: must name one of the config's datasets ({', '.join(sorted(datasets))})"
            )
        defaults["dataset"] = next(iter(datasets))
    _checkpoint_pixels(defaults, config["model"])
    if BASE_STAGE in datasets and defaults["dataset"] != BASE_STAGE:
        # The base model's evaluations on a dataset other than the defaults' are named after it.
        raise ConfigError(f"datasets.{BASE_STAGE}: the name is reserved unless it is the defaults' dataset")
    experiments, sweeps = expand_sweeps(config, load_schema())
    plan = Plan(defaults=defaults, sweeps=sweeps)

    for experiment, spec in experiments.items():
        if experiment == BASE_EXPERIMENT:
            raise ConfigError(f"experiments.{BASE_EXPERIMENT}: the name is reserved for the untrained base model")
        names = set()
        for index, stage_spec in enumerate(spec["stages"]):
            key = f"experiments.{experiment}.stages[{index}]"
            name = stage_spec["name"]
            if name in names:
                raise ConfigError(f"{key}.name: stage '{name}' appears twice in experiment '{experiment}'")
            names.add(name)
            settings = _merge(defaults, {k: v for k, v in stage_spec.items() if k != "name"})
            _resolve_method_defaults(settings, key)
            _check_data(settings, datasets, key, made_here=set(config.get("demo", {}).get("datasets", {})))
            _check_schedule(settings, key)
            if settings["resources"]["parallelism"] == "shard" and (problem := parallelism.shard_refused(settings)):
                raise ConfigError(f"{key}.resources.parallelism: shard: {problem}")
            if (nodes := settings["resources"]["nodes"]) > 1 and settings["resources"]["gpus"] < 1:
                raise ConfigError(
                    f"{key}.resources.nodes: {nodes}: a stage across nodes trains on GPUs; give gpus: 1 or more"
                )
            init_from = settings.pop("init_from")
            if init_from is not None and "/" not in init_from:
                init_from = f"{experiment}/{init_from}"
            settings["init_from"] = init_from
            if note := _pixels_for_a_trained_tower(settings, key):
                plan.notes.append(note)
            stage = Stage(experiment, name, index, settings, init_from)
            plan.stages[stage.id] = stage

    for stage in plan.stages.values():
        _check_init_from(plan, stage)
    plan.selections = arm_selections(config, plan)
    _check_demo(config.get("demo", {}).get("datasets", {}), datasets)
    _check_runtimes(config, plan)
    return plan


def _pixels_for_a_trained_tower(settings: dict, key: str) -> str | None:
    """A stage that trains the tower's LoRA or the merger trains from the pixel cache: the vision
    cache holds the frozen tower's outputs, which its trained tower no longer computes. Said, not
    refused: `vision_cache: true` in `defaults` is a study's usual choice for its other stages."""
    if not (settings["vision_cache"] and trains_vision(settings)):
        return None
    settings["vision_cache"] = False
    trained = " and ".join(k for k in ("vision_lora", "train_merger") if settings[k])
    return (
        f"{key}.vision_cache: the stage trains from the pixel cache instead, as its {trained} trains the "
        "image's path, whose outputs the vision cache (the frozen tower's) does not hold"
    )


def _check_rewards(settings: dict, key: str) -> None:
    """A grpo stage's rewards, and what sampling needs, before any job is queued."""
    from vlft.data.rewards import Rewards

    if not settings["packing"]:
        raise ConfigError(
            f"{key}.method: grpo needs packing: true (a question's answers share their prompt in one packed row)"
        )
    Rewards(settings["rewards"], settings["answer_format"], f"{key}.rewards")


def _resolve_method_defaults(settings: dict, key: str) -> None:
    """A method's shared keys (beta, loss_type) where the stage leaves them null, and a value that
    belongs to another method refused in one sentence."""
    method = settings["method"]
    for name, value in METHOD_DEFAULTS.get(method, {}).items():
        if settings[name] is None:
            settings[name] = value
    if method in LOSS_TYPES and settings["loss_type"] not in LOSS_TYPES[method]:
        raise ConfigError(
            f"{key}.loss_type: '{settings['loss_type']}' is not a {method} loss (one of {', '.join(LOSS_TYPES[method])})"
        )
    if method == "dpo" and settings["beta"] <= 0:
        raise ConfigError(f"{key}.beta: dpo's β must be above 0 (its loss divides nothing without it)")


def _checkpoint_pixels(defaults: dict, model: dict) -> None:
    """min_pixels and max_pixels that the config leaves out are the checkpoint's own (its image
    processor's), read now so that they are part of every stage's settings: another checkpoint
    with other values reruns what it changes. A model named by its Hub id and not fetched yet: its
    image processor's settings alone, from the Hub."""
    if defaults["min_pixels"] is not None and defaults["max_pixels"] is not None:
        return
    model_dir = model["path"]
    if Path(model_dir).exists() and (problem := model_dir_problem(model_dir)):
        raise ConfigError(f"model.path: {model_dir} {problem}")  # what a partial copy lacks, not its symptom
    try:
        if not Path(model_dir).exists() and "hub_id" in model:
            model_dir = hub_processor_dir(model["hub_id"], model.get("revision"))
        low, high = checkpoint_pixels(model_dir)
    except InputError as err:
        raise ConfigError(
            f"defaults.min_pixels: left out, so the checkpoint's image processor decides, but {err}; "
            "set min_pixels and max_pixels, or point model.path at the checkpoint"
        ) from None
    defaults["min_pixels"] = low if defaults["min_pixels"] is None else defaults["min_pixels"]
    defaults["max_pixels"] = high if defaults["max_pixels"] is None else defaults["max_pixels"]


def _check_demo(demo_datasets: dict, datasets: dict) -> None:
    """A demo dataset is built where its entry under `datasets` points, one records file per split."""
    for name, demo in demo_datasets.items():
        if name not in datasets:
            known = ", ".join(sorted(datasets)) or "none"
            raise ConfigError(f"demo.datasets.{name}: not a dataset of the config (it defines: {known})")
        if set(demo["sizes"]) != set(datasets[name]["splits"]):
            raise ConfigError(
                f"demo.datasets.{name}.sizes: must give a size for each split of datasets.{name} "
                f"({', '.join(sorted(datasets[name]['splits']))}), and for no other"
            )


def retry_runtime(minutes: int, attempt: int, ceiling: int | None) -> int:
    """A retry of a job stopped at its time limit asks for more time: runtime x attempt, up to the
    config's max_runtime (a partition's limit), never past it."""
    return min(minutes * attempt, ceiling) if ceiling else minutes * attempt


def _check_runtimes(config: dict, plan: "Plan") -> None:
    ceiling = config.get("max_runtime")
    if not ceiling:
        return
    asked = [("defaults.resources.runtime", plan.defaults["resources"]["runtime"])]
    asked += [(f"{s.key}.resources.runtime", s.settings["resources"]["runtime"]) for s in plan.stages.values()]
    asked.append(("evaluation.resources.runtime", config.get("evaluation", {}).get("resources", {}).get("runtime", 0)))
    for key, minutes in asked:
        if minutes is not None and minutes > ceiling:  # None: predicted, and held within the ceiling
            raise ConfigError(
                f"{key}: {minutes} minutes, more than max_runtime ({ceiling}), the most a job may ask for"
            )


def _check_schedule(settings: dict, key: str) -> None:
    """What the config alone decides: a set number of steps, or a warmup of every step."""
    if settings["max_steps"] and (problem := schedule_problem(settings, settings["max_steps"])):
        raise ConfigError(f"{key}.max_steps: {problem}")
    if settings["warmup_ratio"] >= 1 and warmup_steps(settings, 1):
        raise ConfigError(
            f"{key}.warmup_ratio: {settings['warmup_ratio']} makes every step warmup, so the stage never trains at "
            "learning_rate; give a ratio below 1"
        )


def _check_data(settings: dict, datasets: dict, key: str, made_here: set[str] = frozenset()) -> None:
    name = settings["dataset"]
    if name not in datasets:
        known = ", ".join(sorted(datasets)) or "none"
        raise ConfigError(f"{key}.dataset: unknown dataset '{name}' (the config defines: {known})")
    splits = datasets[name]["splits"]
    for field_name in ("train_splits", "eval_splits"):
        for split in settings[field_name]:
            if split not in splits:
                known = ", ".join(sorted(splits))
                raise ConfigError(f"{key}.{field_name}: unknown split '{split}' of dataset '{name}' (it has: {known})")
    if settings["order"] == "by_field" and not settings["order_field"]:
        raise ConfigError(f"{key}.order_field: order 'by_field' needs the field to sort by")
    if settings["min_pixels"] > settings["max_pixels"]:
        raise ConfigError(f"{key}.min_pixels: larger than max_pixels")
    if settings["eval_split"] is not None and settings["eval_split"] not in splits:
        known = ", ".join(sorted(splits))
        raise ConfigError(
            f"{key}.eval_split: unknown split '{settings['eval_split']}' of dataset '{name}' (it has: {known})"
        )
    if settings["eval_every"] and settings["eval_split"] is None and not settings["eval_splits"]:
        raise ConfigError(f"{key}.eval_every: evaluating during training needs eval_split, or a split in eval_splits")
    if settings["keep"] == "best" and not settings["eval_every"]:
        raise ConfigError(f"{key}.keep: 'best' is chosen among the evaluations during training: set eval_every too")
    if settings["image_groups"] and not settings["packing"]:
        raise ConfigError(f"{key}.image_groups: needs packing: true (a group is laid out in one packed row)")
    if settings["method"] == "dpo" and settings["answer_format"] == "click":
        raise ConfigError(f"{key}.method: dpo learns from answers in words (answer_format final or cot), not clicks")
    if settings["method"] == "dpo" and not settings["packing"]:
        raise ConfigError(
            f"{key}.method: dpo needs packing: true (a pair's two answers share their prompt in one packed row)"
        )
    if settings["method"] == "grpo":
        _check_rewards(settings, key)
    if settings["method"] == "dpo" and settings["max_batch_tokens"] == "auto":
        raise ConfigError(
            f"{key}.max_batch_tokens: auto is measured on single answers, not on preference pairs: give a number (or null) for a dpo stage"
        )
    # On the stage's splits as a whole, from the raw records where they exist already: before any
    # job is queued, not in a GPU job. Not the demo's (`made_here`): a job makes them, perhaps again
    # over older ones, and the training job checks them.
    train_records = [splits[split] for split in settings["train_splits"]]
    order_field = settings["order_field"] if settings["order"] == "by_field" else None
    pair_field = "rejected" if settings["method"] == "dpo" else None
    if name in made_here:
        return
    if (settings["filter"] or order_field or pair_field) and all(Path(path).is_file() for path in train_records):
        if problem := selection_problem(train_records, settings["filter"], order_field, pair_field):
            raise ConfigError(f"{key}.{problem}, so the stage cannot train")


def _check_init_from(plan: Plan, stage: Stage) -> None:
    seen = [stage.id]
    current = stage
    while current.init_from:
        if current.init_from not in plan.stages:
            raise ConfigError(
                f"{current.key}.init_from: stage '{current.init_from}' does not exist "
                f"(stages: {', '.join(plan.stages)})"
            )
        source = plan.stages[current.init_from]
        if source.id in seen:
            cycle = " -> ".join(seen + [source.id])
            raise ConfigError(f"{stage.key}.init_from: the stages start from each other in a cycle: {cycle}")
        for lora_key in LORA_KEYS:
            if current.settings[lora_key] != source.settings[lora_key]:
                raise ConfigError(
                    f"{current.key}.{lora_key}: must equal that of '{source.id}', whose adapter it starts from "
                    f"({current.settings[lora_key]!r} != {source.settings[lora_key]!r})"
                )
        seen.append(source.id)
        current = source
