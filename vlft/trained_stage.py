"""A trained stage as the workflow publishes it: results/train/<experiment>/<stage>/ holding
`adapter/` (a PEFT adapter that `PeftModel.from_pretrained` loads), `log.jsonl` (a line a step) and
`summary.json` (what it trained on and how fast, how its adapter answers, the adapter files'
checksums). A finished run keeps the same layout in its run directory until it is published.

Written by vlft.training.runs; read by the stage that starts from it (init_from), evaluation,
predict.py, export and the checksum check (vlft.integrity)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ADAPTER, LOG, SUMMARY = "adapter", "log.jsonl", "summary.json"


@dataclass(frozen=True)
class TrainedStage:
    adapter: Path
    log: Path
    summary: Path

    @classmethod
    def at(cls, directory: str | Path) -> "TrainedStage":
        """The stage whose outputs lie in `directory`."""
        directory = Path(directory)
        return cls(directory / ADAPTER, directory / LOG, directory / SUMMARY)

    @classmethod
    def of_adapter(cls, adapter: str | Path) -> "TrainedStage":
        """The stage an adapter directory belongs to (its summary beside it)."""
        return cls.at(Path(adapter).parent)

    def read_summary(self) -> dict:
        return json.loads(self.summary.read_text())

    def steps_through(self) -> int:
        """Its optimizer steps and those of the stages it started from: where the curves of a stage
        that starts from it go on (a summary of a version that did not count the earlier ones
        counts its own)."""
        summary = self.read_summary()
        return summary.get("steps_before", 0) + summary["steps"]
