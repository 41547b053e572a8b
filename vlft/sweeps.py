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
plots each split's accuracy against the swept values (vlft.report).
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import re

from jsonschema import Draft202012Validator

from vlft.errors import ConfigError

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
