"""A stage's run directory: where its checkpoints, running logs and finished outputs live until the
workflow's paths hold them (results/checkpoints/<experiment>/<stage>/<fingerprint>/).

Named by a fingerprint of the stage's settings and the content of its inputs, so a rerun after a kill
resumes and a rerun after a change starts over. A run that finished its steps is kept (`finished/`)
and restored rather than trained again where publishing it never completed (a full disk, a kill
while it copied), and, on a retry, where the attempt before may have published it and been stopped
just after. What it publishes, and keeps until then, is a trained stage (vlft.trained_stage).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from vlft.integrity import adapter_checksums, verify_adapter
from vlft.caches.shards import INDEX
from vlft.errors import InputError
from vlft.files import atomic_path, remove_inside, write_json
from vlft.stage_params import WATCHING_KEYS
from vlft.trained_stage import TrainedStage
from vlft.training import checkpoints, step_evals

# In a run directory: the outputs of a run that finished its steps, and in them, until they have
# reached the workflow's paths whole, a mark that they have not. (A mark of what is missing, so that
# a finished run of an earlier version, which has none, counts as published.)
FINISHED = "finished"
UNPUBLISHED = "unpublished"
RUNNING_LOG = "log.jsonl"
# In each run directory this project makes, from its start: what marks it as one. A stage removes
# the run directories of its earlier settings, and nothing else of its checkpoint directory (which
# may be a link to a directory of the user's, or lie in one).
MADE_HERE = ".vlft-run-directory"


@dataclass
class StageInputs:
    model_dir: str
    prepared: list[str]  # normalized JSONL of each training split
    caches: list[str]  # pixel cache of each training split, same order
    init_adapter: str | None  # adapter of the stage this one starts from
    trust_remote_code: bool = False
    # Where it evaluates as it trains (`eval_every`): the prepared split and its cache (of the kind it trains from).
    eval_prepared: str | None = None
    eval_cache: str | None = None

    def files(self) -> list[Path]:
        """The files whose content a stage computes from: its records, its caches' indexes (each
        image's checksum), the adapter it starts from."""
        files = [Path(p) for p in self.prepared] + [Path(c) / INDEX for c in self.caches]
        if self.init_adapter:
            files.append(Path(self.init_adapter) / "adapter_model.safetensors")  # PEFT's name for the weights
        return files

    def eval_files(self) -> list[Path]:
        """The files its evaluations during training read, where it has them."""
        return [Path(self.eval_prepared), Path(self.eval_cache) / INDEX] if self.eval_prepared else []


def run_key(settings, evaluation: dict | None) -> dict:
    """What names a stage's run besides its inputs: its params as the job was given them, and where
    it evaluates as it trains, how those evaluations generate."""
    return settings.params | ({"evaluation": evaluation} if settings.eval_every else {})


class RunDirectory:
    def __init__(self, checkpoint_root: str | Path, inputs: StageInputs, key: dict, clean: bool):
        """This exact stage's directory (`key`: run_key's); those of the stage's earlier settings go
        (`clean`: the main process's): no run of this stage will resume them."""
        root = Path(checkpoint_root)
        self.path = root / checkpoints.fingerprint(key, inputs.files() + inputs.eval_files())
        for earlier in made_here(root) if clean else ():
            if earlier != self.path:
                remove_inside(earlier, root)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MADE_HERE).touch()
        self.finished = self.path / FINISHED
        self.kept = TrainedStage.at(self.finished)  # the finished outputs, as they will be published
        self.running_log = self.path / RUNNING_LOG

    def restorable(self, retry: bool) -> bool:
        """Whether a finished run's outputs are to be published instead of training: they never
        reached the workflow's paths whole, or this job is a retry that may have been stopped after
        they did."""
        return self.kept.summary.exists() and (retry or (self.finished / UNPUBLISHED).exists())

    def restore(self, outputs: TrainedStage) -> dict | None:
        """Publish the outputs of an earlier run that finished its steps; None where its adapter was
        damaged since (it is removed, and the stage trains)."""
        try:
            verify_adapter(self.kept.adapter)
        except InputError as err:
            print(f"cannot restore the finished run ({err}): training the stage", flush=True)
            remove_inside(self.finished, self.path)
            return None
        print(
            f"this stage finished its steps in an earlier run: restoring its outputs from {self.finished}", flush=True
        )
        return self.publish(outputs)

    def resume(self, model, optimizer, scheduler, method, is_main: bool) -> int:
        """Restore the newest complete checkpoint, if any; the step it was saved after (0 for none).
        The main process cuts its logs back to that step: what came after is trained again."""
        first_step = 0
        if (checkpoint := self.newest_checkpoint(is_main)) is not None:
            first_step = checkpoints.restore(checkpoint, model, optimizer, scheduler)
            method.restore(checkpoints.method_tensors(checkpoint))
            if is_main:  # the others' go unsaid
                print(f"resuming from step {first_step} ({checkpoint})", flush=True)
        if is_main:
            checkpoints.truncate_log(self.running_log, first_step)
        return first_step

    def newest_checkpoint(self, is_main: bool) -> Path | None:
        """The newest checkpoint that can be read whole. One that cannot (cut short, overwritten,
        emptied) is set aside with one sentence naming it, and the one before it serves; checkpoints
        of an earlier version, which were pickled, are never loaded (that could run code), and say so."""
        for older in checkpoints.older_format(self.path):
            if is_main:
                print(
                    f"{older}: a checkpoint of an earlier version, saved with pickle, which this version does not "
                    "load (loading it could run code): set aside; the stage resumes from an older checkpoint or trains "
                    "from its first step",
                    flush=True,
                )
                remove_inside(older, self.path)
        for checkpoint in checkpoints.complete(self.path)[::-1]:  # newest first; every process alike
            problem = checkpoints.readable(checkpoint)
            if problem is None:
                return checkpoint
            if is_main:
                print(f"{checkpoint}: damaged ({problem}): set aside; resuming from the one before it", flush=True)
                remove_inside(checkpoint, self.path)
        return None

    def save_checkpoint(self, step: int, model, optimizer, scheduler, method) -> None:
        checkpoints.save(self.path, step, model, optimizer, scheduler, method.checkpoint_tensors())

    def finish(self, summary: dict, model, kept_step: int | None) -> None:
        """Keep the finished outputs in the run directory (the adapter after the last step, or the
        kept best's), marked unpublished, and drop what only a resume needed."""
        with atomic_path(self.finished) as tmp:
            tmp.mkdir()
            stage = TrainedStage.at(tmp)
            if kept_step is not None:
                shutil.copytree(self.path / f"{step_evals.BEST_PREFIX}{kept_step:08d}", stage.adapter)
            else:
                model.save_pretrained(stage.adapter)
            summary["adapter_crc32"] = adapter_checksums(stage.adapter)  # checked wherever it is loaded
            shutil.copyfile(self.running_log, stage.log)
            write_json(stage.summary, summary)
            (tmp / UNPUBLISHED).touch()
        for checkpoint in [*self.path.glob("step-*"), *step_evals.best_dirs(self.path).values()]:
            remove_inside(checkpoint, self.path)
        self.running_log.unlink()
        (self.path / step_evals.EVALS_LOG).unlink(missing_ok=True)

    def publish(self, outputs: TrainedStage) -> dict:
        """Copy the finished outputs to the workflow's paths, each complete or not at all, then remove
        the mark that they are not: until then, any rerun restores them."""
        with atomic_path(outputs.adapter) as tmp:
            shutil.copytree(self.kept.adapter, tmp)
        for source, target in ((self.kept.log, outputs.log), (self.kept.summary, outputs.summary)):
            with atomic_path(target) as tmp:
                shutil.copyfile(source, tmp)
        (self.finished / UNPUBLISHED).unlink(missing_ok=True)
        return self.kept.read_summary()


def made_here(root: Path) -> list[Path]:
    """The run directories under a stage's checkpoint directory that this project made: real
    directories (not links) named by a fingerprint, with the mark it writes into each."""
    return [
        path
        for path in root.glob("*")
        if re.fullmatch(r"[0-9a-f]{16}", path.name) and not path.is_symlink() and (path / MADE_HERE).is_file()
    ]


def training_fingerprint(inputs: StageInputs, settings, evaluation: dict | None, steps: list) -> str:
    """What a stage trained on, however its config said it: its inputs' content, its params with
    the filter replaced by the records it selected (and without the splits it is evaluated on), and
    every step's records in order. Two stages with one fingerprint compute the same adapter (the
    report says so: a repeat is no second finding)."""
    key, files = run_key(settings, evaluation), inputs.files()
    left_out = ["filter", "eval_splits"]
    if settings.keep == "last":  # evaluating as it trains changes nothing it trains
        left_out += ["eval_every", *WATCHING_KEYS, "evaluation"]
    else:
        files += inputs.eval_files()
    computed = {k: v for k, v in key.items() if k not in left_out} | {"steps": steps}
    return checkpoints.fingerprint(computed, files)
