"""Evaluation during training (`eval_every`), and keeping the best adapter it finds (`keep: best`).

Before the first step, every `eval_every` optimizer steps and after the last, the adapter as it
stands answers a fixed subset of an eval split (`eval_samples` records drawn with the stage's seed,
the same ones each time) through the evaluation's own engine (vlft.generation.evaluate.answer_records): its
accuracy, by category too, and its validation loss, as the evaluation job computes them. They go to
the job's log, to TensorBoard (eval/...), and to the run's evals.jsonl, which a resumed run cuts back
to its checkpoint as it does the step log; the summary lists them and the report draws them.

With `keep: best` the adapter of each new best evaluation after a step is saved in the run directory
(best-<step>) and the stage's adapter is the best one. A best is removed only once a newer one is
covered by a checkpoint, so that a run resumed from its newest checkpoint still has the best as of
that checkpoint; the ones after it belong to steps trained again, and go.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from vlft.data import clicks
from vlft.training import checkpoints

from vlft.jobs import distributed
from vlft.generation.evaluate import answer_records, prediction_of, scores
from vlft.files import atomic_path, remove_inside, storage_error
from vlft.modeling import unwrapped
from vlft.data.stage_data import load_stage_data

EVALS_LOG = "evals.jsonl"  # in the run directory, beside the step log
BEST_PREFIX = "best-"
# What an evaluation record keeps of the metrics: the judged figures, not the job's timings.
RECORDED = ("n", "accuracy", "accuracy_by_category", "loss", "n_with_box", "unparseable", "mean_distance")


class StepEvaluator:
    def __init__(
        self, prepared: str, cache: str, eval_settings: dict, settings: dict, builder, tokenizer, model, run_dir: Path
    ):
        self.every, self.keep, self.metric = settings.eval_every, settings.keep, settings.best_metric
        self.eval_settings, self.builder, self.tokenizer = eval_settings, builder, tokenizer
        self.run_dir, self.group = run_dir, distributed.join()
        answer_format = eval_settings["answer_format"]
        self.data = load_stage_data(
            [prepared],
            [cache],
            builder,
            filters={},
            answer_format=answer_format,
            max_seq_len=eval_settings["max_seq_len"],
            convention=clicks.convention_for(answer_format, model.config),
        )
        n = len(self.data.records)
        # The same records at every step and on every attempt, in the split's order.
        chosen = sorted(random.Random(settings.seed).sample(range(n), min(settings.eval_samples, n)))
        self.mine = chosen[self.group.rank :: self.group.size]  # this process's share

    def due(self, step: int, last_step: int) -> bool:
        """Whether the adapter after `step` is evaluated (step 0: before any)."""
        return step % self.every == 0 or step == last_step

    def __call__(self, model, step: int, device: torch.device, dtype: torch.dtype) -> dict | None:
        """The adapter after `step` evaluated: the record the main process logs (None elsewhere)."""
        started = time.time()
        model.eval()
        try:
            with torch.no_grad(), adapter_in_model_dtype(model, dtype):
                texts, losses = answer_records(
                    unwrapped(model),
                    self.data,
                    self.mine,
                    self.builder,
                    self.tokenizer,
                    self.eval_settings,
                    device=device,
                    dtype=dtype,
                )
        finally:
            model.train()
        answered = [(i, prediction_of(self.data.records[i], texts[i], self.data), *losses[i]) for i in self.mine]
        if self.group.size > 1:
            answered = [a for part in distributed.gathered(answered) for a in part]
            if not self.group.is_main:
                return None
        answered.sort(key=lambda a: a[0])  # the loss summed in the split's order, however many processes ran
        loss_sum, loss_tokens = 0.0, 0
        for _, _, loss, tokens in answered:
            loss_sum, loss_tokens = loss_sum + loss, loss_tokens + tokens
        metrics = scores([a[1] for a in answered], loss_sum, loss_tokens, self.eval_settings["answer_format"])
        recorded = {k: metrics[k] for k in RECORDED if k in metrics}
        return {"step": step, **recorded, "seconds": time.time() - started}

    def keep_if_best(self, record: dict, records: list[dict], model) -> None:
        """Save the adapter after a step where its evaluation is the best so far (`records`: those
        before it); main process."""
        if self.keep != "best" or record["step"] == 0:  # step 0 is the starting point, not a candidate
            return
        if not better(record, best_of(records, self.metric), self.metric):
            return
        with atomic_path(self.run_dir / f"{BEST_PREFIX}{record['step']:08d}") as tmp:
            model.save_pretrained(tmp)
        prune_bests(self.run_dir)


class EvaluationDuringTraining:
    """`eval_every`: the one object the training loop calls, before its first step and after each
    step, to evaluate where due, keep the best adapter (`keep: best`) and say so in the step log."""

    def __init__(self, evaluator: StepEvaluator, device: torch.device, dtype: torch.dtype):
        self.evaluator, self.device, self.dtype = evaluator, device, dtype
        self.group, self.run_dir = evaluator.group, evaluator.run_dir
        self.records: list[dict] = []  # the evaluations so far (main process)

    def resume(self, first_step: int) -> None:
        """A run resumed after `first_step`: the evaluations after it are of steps trained again."""
        if self.group.is_main:
            checkpoints.truncate_log(self.run_dir / EVALS_LOG, first_step)
            forget_after(self.run_dir, first_step)
            self.records = read(self.run_dir)

    def after(self, model, step: int, last_step: int, log) -> None:
        """Evaluate the adapter after `step` (0: before any) where it is due and not yet evaluated
        (a stopped attempt may have saved its checkpoint before it could); every process takes part."""
        if self.evaluator.keep == "best" and self.group.is_main:
            prune_bests(self.run_dir)  # a checkpoint may have been saved since
        if not self.evaluator.due(step, last_step) or not self._unevaluated(step):
            return
        record = self.evaluator(model, step, self.device, self.dtype)
        if self.group.is_main:
            self.evaluator.keep_if_best(record, self.records, model)
            self.records.append(record)
            append(self.run_dir, record)
            log.evaluation(record)
        log.restart_clock()  # a step's time leaves the evaluation out

    def _unevaluated(self, step: int) -> bool:
        """Whether the adapter after `step` has no evaluation yet, as the main process knows it."""
        missing = not any(r["step"] == step for r in self.records)
        return distributed.gathered(missing)[0] if self.group.size > 1 else missing

    def kept_step(self) -> int | None:
        """The step whose adapter the stage keeps, with `keep: best`."""
        if self.evaluator.keep != "best":
            return None
        kept = best_of(self.records, self.evaluator.metric)
        return kept["step"] if kept else None

    def summary(self, rows: list[dict]) -> dict:
        """The evaluations during training, their share of the stage's time (its steps' and theirs),
        and the kept step."""
        eval_s = sum(r["seconds"] for r in self.records)
        train_s = sum(r["samples"] / r["samples_per_s"] for r in rows)
        summary = {
            "evaluations_during_training": self.records,
            "eval_s": eval_s,
            "eval_share": eval_s / (eval_s + train_s),
        }
        if (step := self.kept_step()) is not None:
            kept = next(r for r in self.records if r["step"] == step)
            summary["kept"] = {"step": step, "best_metric": self.evaluator.metric} | {
                k: kept[k] for k in ("accuracy", "loss")
            }
        return summary


class NoEvaluation:
    """`eval_every: 0`: nothing evaluated, nothing kept but the last adapter."""

    def resume(self, first_step: int) -> None:
        pass

    def after(self, model, step: int, last_step: int, log) -> None:
        pass

    def kept_step(self) -> None:
        return None

    def summary(self, rows: list[dict]) -> dict:
        return {}


def better(record: dict, best: dict | None, metric: str) -> bool:
    """Whether `record` beats `best` by `metric` (so the earliest of equals stays)."""
    if best is None:
        return True
    return record["loss"] < best["loss"] if metric == "loss" else record[metric] > best[metric]


def best_of(records: list[dict], metric: str) -> dict | None:
    """The best of the evaluations after a step, the earliest of equals."""
    best = None
    for record in records:
        if record["step"] > 0 and better(record, best, metric):
            best = record
    return best


def best_dirs(run_dir: Path) -> dict[int, Path]:
    return {int(p.name.removeprefix(BEST_PREFIX)): p for p in run_dir.glob(f"{BEST_PREFIX}*") if p.is_dir()}


def prune_bests(run_dir: Path) -> None:
    """Remove each saved best that a newer one replaces as of the newest checkpoint."""
    newest = checkpoints.latest(run_dir)
    checkpoint_step = checkpoints.step_of(newest) if newest else 0
    saved = best_dirs(run_dir)
    covered = [step for step in saved if step <= checkpoint_step]
    for step, path in saved.items():
        if covered and step < max(covered):
            remove_inside(path, run_dir)


def forget_after(run_dir: Path, step: int) -> None:
    """A run resumed after `step`: the bests saved after it belong to steps it trains again."""
    for saved, path in best_dirs(run_dir).items():
        if saved > step:
            remove_inside(path, run_dir)


def append(run_dir: Path, record: dict) -> None:
    path = run_dir / EVALS_LOG
    try:
        with open(path, "a") as log:
            log.write(json.dumps(record) + "\n")
    except OSError as err:
        raise storage_error(err, path) or err


def read(run_dir: Path) -> list[dict]:
    path = run_dir / EVALS_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def describe(record: dict) -> str:
    """One line for the job's log."""
    by_category = ", ".join(f"{c} {a:.3f}" for c, a in record["accuracy_by_category"].items())
    return (
        f"evaluation after step {record['step']}: accuracy {record['accuracy']:.4f} of {record['n']} "
        f"({by_category}), validation loss {record['loss']:.4f}, {record['seconds']:.1f} s"
    )


@contextmanager
def adapter_in_model_dtype(
    model, dtype: torch.dtype, into: list[torch.Tensor] | None = None, trained: list[torch.Tensor] | None = None
):
    """The adapter's float32 weights in the model's dtype while it answers, as the evaluation job's
    merged weights are (generation runs no autocast); its float32 weights, which the optimizer
    holds, are put back as they were. `into`: tensors of the model's dtype, one a trained
    parameter, that the answering weights are written into (a kept CUDA graph reads them there).
    `trained`: the model's trained parameters where the caller holds them (listing them walks an 8B PEFT
    model's modules, at each of a reward stage's rollouts)."""
    if dtype in (torch.float32, torch.float64):
        yield
        return
    if trained is None:
        trained = [p for p in model.parameters() if p.requires_grad]
    if into is None:
        answering = [p.data.to(dtype) for p in trained]
    else:  # one launch for all of them, as torch.optim's foreach steps do (an 8B's LoRA: 504 tensors)
        torch._foreach_copy_(into, [p.data for p in trained])
        answering = into
    with swapped_data(trained, answering):
        yield


@contextmanager
def swapped_data(parameters: list[torch.Tensor], values: list[torch.Tensor]):
    """The parameters holding `values` for a while, their own data back after."""
    kept = [p.data for p in parameters]
    for p, value in zip(parameters, values):
        p.data = value
    try:
        yield
    finally:
        for p, data in zip(parameters, kept):
            p.data = data
