"""Sweeps: a stage's setting given as a list of values, expanded into one experiment per value (per
combination, where several are swept), each named by its values.

    experiments:
      lr:
        stages:
          - name: stage1
          - name: stage2
            init_from: stage1
            sweep: {learning_rate: [1.0e-4, 3.0e-4, 1.0e-3]}

gives experiments `lr.learning_rate-0.0001`, `lr.learning_rate-0.0003` and `lr.learning_rate-0.001`,
each with stage2's learning rate set. What their stages share is computed once: their stage1s are
the same stage, trained once (vlft.trained_once), as are the caches and the base model's
evaluations, which every experiment shares anyway. The report groups a sweep's experiments and
plots each split's accuracy against the swept values (vlft.report.page).
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import re

from jsonschema import Draft202012Validator

from vlft.errors import ConfigError, InputError

SWEEP = "sweep"


def expand_sweeps(config: dict, schema: dict) -> tuple[dict, dict[str, dict]]:
    """The config's experiments with every sweep expanded, and each expanded experiment's sweep:
    {"experiment": the sweep's name, "values": {"<stage>.<setting>": value}, "final": its last
    stage}. Each value is checked against the schema as the stage's own setting would be."""
    experiments, sweeps = {}, {}
    for name, spec in config.get("experiments", {}).items():
        swept = [
            (index, stage["name"], key, values)
            for index, stage in enumerate(spec["stages"])
            for key, values in stage.get(SWEEP, {}).items()
        ]
        if not swept:
            experiments[name] = spec
            continue
        for index, stage, key, values in swept:
            _check_values(config, schema, name, index, key, values)
        keys = [key for _, _, key, _ in swept]
        for combination in itertools.product(*(values for *_, values in swept)):
            arm = copy.deepcopy(spec)
            for stage in arm["stages"]:
                stage.pop(SWEEP, None)
            words, values = [], {}
            for (index, stage, key, _), value in zip(swept, combination):
                arm["stages"][index][key] = value
                values[f"{stage}.{key}"] = value
                # The setting names the arm; with its stage where two stages sweep it.
                words.append(f"{stage + '.' if keys.count(key) > 1 else ''}{key}-{_word(value)}")
            arm_name = ".".join([name] + words)
            if arm_name in experiments or arm_name in config["experiments"]:
                raise ConfigError(
                    f"experiments.{name}: its sweep's experiment '{arm_name}' is named twice (values that read alike, "
                    "or an experiment of that name)"
                )
            if "description" in arm:
                arm["description"] += f" ({', '.join(f'{k}={json.dumps(v)}' for k, v in values.items())})"
            experiments[arm_name] = arm
            sweeps[arm_name] = {"experiment": name, "values": values, "final": arm["stages"][-1]["name"]}
    return experiments, sweeps


def _check_values(config: dict, schema: dict, experiment: str, index: int, key: str, values: list) -> None:
    at = f"experiments.{experiment}.stages[{index}].{SWEEP}.{key}"
    settings = schema["$defs"]["stage_settings"]["properties"]
    if key not in settings or key == "init_from":
        close = difflib.get_close_matches(key, [k for k in settings if k != "init_from"], n=1)
        raise ConfigError(f"{at}: not a setting a stage can sweep" + (f" (did you mean {close[0]}?)" if close else ""))
    if len({json.dumps(v, sort_keys=True) for v in values}) < len(values):
        raise ConfigError(f"{at}: a value is listed twice")
    validator = Draft202012Validator(schema)
    for n, value in enumerate(values):
        trial = copy.deepcopy(config)
        stage = trial["experiments"][experiment]["stages"][index]
        stage.pop(SWEEP)
        stage[key] = value
        error = next(iter(validator.iter_errors(trial)), None)
        if error is not None:
            raise ConfigError(f"{at}[{n}]: {error.message}")


def _word(value) -> str:
    """A value as part of a folder name: letters, digits, '_', '-' and '.'."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "_"


# Metrics of an evaluation where lower is better; every other is higher-is-better.
LOWER_IS_BETTER = ("loss", "mean_distance")


def arm_selections(config: dict, plan) -> dict[str, dict]:
    """Each sweep that keeps only its best arms past a stage (an experiment's `keep_best`), checked
    against the plan: {sweep: {after, arms, metric, split, candidates}}, `candidates` its arms in the
    config's order."""
    selections = {}
    for name, spec in config.get("experiments", {}).items():
        keep = spec.get("keep_best")
        if keep is None:
            continue
        at = f"experiments.{name}.keep_best"
        candidates = [arm for arm, sweep in plan.sweeps.items() if sweep["experiment"] == name]
        if not candidates:
            raise ConfigError(f"{at}: experiment '{name}' sweeps nothing: give one of its stages a sweep")
        names = [stage["name"] for stage in spec["stages"]]
        after = keep["after"]
        if after not in names:
            raise ConfigError(f"{at}.after: no stage '{after}' in experiment '{name}' (its stages: {', '.join(names)})")
        index = names.index(after)
        first_swept = min(i for i, stage in enumerate(spec["stages"]) if stage.get(SWEEP))
        if index == len(names) - 1:
            raise ConfigError(f"{at}.after: '{after}' is the experiment's last stage: no later stage would be saved")
        if index < first_swept:
            raise ConfigError(
                f"{at}.after: the arms differ from stage '{names[first_swept]}' on, so at the end of '{after}' they are one"
            )
        if keep["arms"] >= len(candidates):
            raise ConfigError(f"{at}.arms: {keep['arms']} of the sweep's {len(candidates)} arms: every arm would go on")
        eval_splits = plan.stage(candidates[0], after).settings["eval_splits"]
        split = keep.get("split") or (eval_splits or [None])[0]
        if split not in eval_splits:
            raise ConfigError(
                f"{at}.split: the arms are compared on an evaluation of '{after}', whose eval_splits are "
                f"[{', '.join(eval_splits)}]" + (f", not '{split}'" if split else "")
            )
        metric = keep.get("metric", "accuracy")
        selections[name] = {"after": after, "arms": keep["arms"], "metric": metric, "split": split}
        selections[name]["candidates"] = candidates
    return selections


def keep_best(metrics: dict[str, dict], arms: int, metric: str, where: dict[str, str]) -> dict:
    """The best `arms` of a sweep's arms by their evaluations' `metric` (`metrics`: arm -> its
    metrics.json; `where`: arm -> that file, for the sentence when one lacks the metric); ties go to
    the arm listed first. What the report says of each: kept, or stopped and why."""
    values = {}
    for arm, measured in metrics.items():
        if not isinstance(measured.get(metric), (int, float)):
            raise InputError(where[arm], f"has no {metric} to compare the sweep's arms by (keep_best.metric)")
        values[arm] = measured[metric]
    lower = metric in LOWER_IS_BETTER
    order = list(values)
    ranked = sorted(order, key=lambda arm: (values[arm] if lower else -values[arm], order.index(arm)))
    kept, stopped = ranked[:arms], ranked[arms:]
    bar = values[kept[-1]]
    side = "above" if lower else "below"
    return {
        "metric": metric,
        "values": values,
        "kept": kept,
        "stopped": {arm: f"{metric} {values[arm]:.4f}, {side} the last kept arm's {bar:.4f}" for arm in stopped},
    }
