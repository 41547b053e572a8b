"""Stages that would compute the very same adapter, trained once.

Two stages compute the same adapter when they start from the same place (no adapter, or adapters
that are themselves the same) and train on the same records, in the same order, with the same
settings. Their configs may say so differently: filters that select the same records (read from
the raw splits, where they exist when the plan is made), or evaluation during training on one of
them and not the other (with `keep: last` it changes nothing trained; tests/training/test_step_evals.py
checks the adapters bit for bit). The workflow then trains one of them, and every job of the others
(their evaluations, the stages that start from them, the report's rows) reads its outputs: their
paths are that stage's (workflow/rules/paths.smk, `stage_path` and `eval_path`).

The stage trained is one that evaluates as it trains where any does (its log holds that curve), else
the first in the config. A stage that already has its own outputs keeps them, so that upgrading to
this, or a study begun before, reruns nothing; removing those outputs lets it share.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from vlft.data.records import selected_by, raw_objects
from vlft.plan import Plan, Stage
from vlft.stage_params import WATCHING_KEYS

# What a stage's job trains from but that changes nothing trained: where it is evaluated after.
NOT_TRAINED = ("eval_splits",)
# With `keep: last`, its evaluations during training (and the settings they go with).
WATCHING = ("eval_every", *WATCHING_KEYS)


def trained_once(
    plan: Plan, raw_split: Callable[[str, str], str], has_outputs: Callable[[Stage], bool]
) -> dict[str, str]:
    """Each stage whose adapter another stage computes: its id -> that stage's id. `raw_split(dataset,
    split)` is a split's records file; `has_outputs(stage)`, whether a stage was trained already."""
    keys = _Keys(plan, raw_split)
    # Stages alike but for their filters first (nothing read), then among those, by the records
    # their filters select (their splits read only for them).
    alike: dict[str, list[Stage]] = {}
    for stage in plan.stages.values():
        alike.setdefault(keys.of(stage, read=False), []).append(stage)
    groups: dict[str, list[Stage]] = {}
    for stage in (s for group in alike.values() if len(group) > 1 for s in group):
        groups.setdefault(keys.of(stage, read=True), []).append(stage)
    shared = {}
    for group in groups.values():
        own = [s for s in group if has_outputs(s)]
        rest = [s for s in group if s not in own]
        if len(group) < 2 or not rest:
            continue
        trained = (own or [s for s in rest if s.settings.get("eval_every")] or rest)[0]
        shared |= {s.id: trained.id for s in rest if s is not trained}
    return shared


def shared_lines(shared: dict[str, str]) -> list[str]:
    """What a plan says of them, a line each."""
    return [
        f"{stage} trains on the same records with the same settings as {trained}: trained once, its jobs read {trained}'s"
        for stage, trained in sorted(shared.items())
    ]


class _Keys:
    """What each stage computes, as a string: two stages with one key compute one adapter."""

    def __init__(self, plan: Plan, raw_split: Callable[[str, str], str]):
        self.plan, self.raw_split = plan, raw_split
        self.keys: dict[tuple[str, bool], str] = {}
        self.selections: dict[str, object] = {}

    def of(self, stage: Stage, read: bool) -> str:
        """Its key; without `read`, with every filter along its chain left out."""
        name = (stage.id, read)
        if name not in self.keys:
            params = stage.train_params()
            left_out = NOT_TRAINED + (WATCHING if stage.settings.get("keep", "last") == "last" else ())
            key = {k: v for k, v in params.items() if k not in left_out}
            key["init_from"] = self.of(self.plan.stages[stage.init_from], read) if stage.init_from else None
            key["filter"] = self.selection(stage) if read else None
            self.keys[name] = json.dumps(key, sort_keys=True)
        return self.keys[name]

    def selection(self, stage: Stage):
        """The records a stage's filter selects, as a digest of their content in order, where its
        raw splits are there to read; else the filter as written (equal filters still match)."""
        settings = stage.settings
        if not settings["filter"]:
            return None
        paths = [self.raw_split(settings["dataset"], split) for split in settings["train_splits"]]
        if not all(Path(p).is_file() for p in paths):
            return settings["filter"]
        name = json.dumps([paths, settings["filter"]], sort_keys=True)
        if name not in self.selections:
            digest = hashlib.sha256()
            for record in raw_objects(paths):
                if selected_by(record, settings["filter"]):
                    digest.update(json.dumps(record, sort_keys=True).encode() + b"\n")
            self.selections[name] = {"records": digest.hexdigest()}
        return self.selections[name]
