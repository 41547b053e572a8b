"""Train one stage: LoRA on the language model, from the pixel or vision cache, resumable, stoppable at any step.

A plain loop rather than transformers.Trainer: the stage's sample order is part of the experiment
(curricula), batches come from our caches (pixels, or the frozen vision tower's outputs) packed
into rows under a token budget, the loss is computed on answer tokens only and summed across
gradient accumulation, and a signal from SLURM or the job's time limit coming close must end in a
checkpoint at a step boundary (vlft.jobs.stopping). Each of those is a fight with Trainer's sampler,
collator and resume logic; here they are a few lines each. A job given several GPUs runs this in
one process each, every step's samples shared out among them and the gradients summed
(vlft.jobs.distributed): the step one process would take.

`train_stage` reads as a recipe: one setup per concern (the run directory, the base model, the
stage's data and step plan, the evaluation during training, the model with its adapter, the
optimizer and schedule, the token budget), then the loop, then the finished outputs published.
What a step trains on and how its loss is computed is the training method's
(vlft.training.methods); the loop knows nothing of which method runs.

train_stage's arguments: `params`, the stage's settings as the plan gives them (vlft.job_settings);
with `eval_every` among them, the stage evaluates as it trains, generating as `evaluation` (the
config's evaluation settings) says. `reuse_finished`: this job is a retry that may have been stopped
just after publishing a finished run, which it then restores. `dtype`: the model's, by default the
device's (bf16 on a GPU, float32 on the CPU); tests train in float64 to compare two layouts of one
computation beyond float32 rounding. `parallelism`: the stage's resources.parallelism (vlft.parallelism).
`curves_dir`: where the stage's TensorBoard run goes
(vlft.training.curves); `report_to`: the trackers its curves go to (vlft.training.trackers). `activation_checkpointing`: recompute activations in the backward pass (less
memory, the same result: a setting of how the job runs, not of what it computes). In a data-parallel
job every process calls it; the main one alone writes files.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from transformers import get_scheduler

from vlft.data import clicks
from vlft.data.prompts import PromptBuilder
from vlft.data.stage_data import StageData, load_stage_data, uses_vision_cache
from vlft.caches.vision_cache import use_vision_cache
from vlft.errors import ConfigError, TrainingError
from vlft.job_settings import StageSettings
from vlft.jobs import distributed
from vlft.training.sharding import is_sharded, shard_frozen_base, shards_the_base
from vlft.jobs.stopping import Preempted, StopRequest
from vlft.modeling import (
    adapter_autocast,
    compile_decoder_layers,
    load_base_model,
    load_tokenizer,
    pick_device,
    rope_index,
    use_activation_checkpointing,
    with_adapter,
    with_new_adapter,
)
from vlft.stage_params import schedule_problem, trains_vision, warmup_steps
from vlft.training import step_evals, token_budget
from vlft.forward.batching import FILLER, prefetched, to_device
from vlft.training.census import Census, trained_by
from vlft.training.host_batches import HostBatcher
from vlft.training.method_registry import METHODS
from vlft.training.methods import MethodInputs, TrainingMethod
from vlft.forward.packing import use_packed_attention
from vlft.trained_stage import TrainedStage
from vlft.training.runs import RunDirectory, StageInputs, run_key, training_fingerprint
from vlft.training.curves import Curves
from vlft.training.step_log import StepLog, throughput
from vlft.training.steps import image_of, plan_steps

# The settings that say how a stage's model reads images and answers (vlft.plan.Plan.eval_settings').
ANSWERING_KEYS = ("answer_format", "min_pixels", "max_pixels", "max_seq_len")

__all__ = ["Preempted", "StageInputs", "train_stage"]


def train_stage(
    inputs: StageInputs,
    params: dict,
    adapter_out: str | Path,
    log_out: str | Path,
    summary_out: str | Path,
    checkpoint_root: str | Path,
    checkpoint_every: int,
    stop: StopRequest | None = None,
    dtype: torch.dtype | None = None,
    reuse_finished: bool = False,
    curves_dir: str | Path | None = None,
    report_to: tuple[str, ...] = ("tensorboard",),
    activation_checkpointing: bool = False,
    evaluation: dict | None = None,
    parallelism: str = "replicate",
) -> dict:
    """Train the stage, or restore it where an earlier run finished its steps (vlft.training.runs).
    Its arguments are explained in the module's docstring, "train_stage's arguments"."""
    started, group = time.time(), distributed.join()
    settings = StageSettings.resolve(params)
    outputs = TrainedStage(Path(adapter_out), Path(log_out), Path(summary_out))
    run = RunDirectory(checkpoint_root, inputs, run_key(settings, evaluation), clean=group.is_main)
    if (restored := _restore_if_finished(run, outputs, reuse_finished, group)) is not None:
        return restored
    device, dtype = pick_device(dtype)
    torch.manual_seed(settings.seed)

    # Setup, one concern at a time.
    tokenizer = load_tokenizer(inputs.model_dir, inputs.trust_remote_code)
    base = load_base_model(inputs.model_dir, device, dtype, inputs.trust_remote_code, settings.quantization_bit)
    builder = PromptBuilder(tokenizer, base.config.image_token_id)
    data = _setup_data(inputs.prepared, inputs.caches, settings, builder, base.config)
    # Without image groups each record is a group of its own.
    steps = plan_steps(data.records, settings, image_of(data.images) if settings.image_groups else None)
    during = _setup_evaluation(inputs, settings, evaluation, builder, tokenizer, base, run, device, dtype)
    model = _setup_model(base, inputs, settings, data, device, (activation_checkpointing, parallelism), group)
    optimizer, scheduler = _setup_optimizer(model, settings, len(steps), len(data.records), device, group)
    # Before a checkpoint is restored: a method's reference and the census are of the starting weights.
    method = _setup_method(settings, inputs, data, model, tokenizer, builder, run, device, dtype, group, steps)
    census = Census.start(model, trained_by(settings))
    first_step = run.resume(model, optimizer, scheduler, method, group.is_main)
    during.resume(first_step)
    trainer = Trainer(model, method, optimizer, scheduler, settings.max_grad_norm, device, dtype, group)
    batcher, chosen = _setup_batcher(settings, tokenizer, builder, data, trainer, steps)

    # The loop. Each step's micro-batches are read and laid out on the host one step ahead, in a
    # background thread, while the GPU trains on the step before.
    todo = range(first_step, len(steps))
    curves = _setup_curves(curves_dir, report_to, params, first_step, inputs.init_adapter, method.logged, group)
    with StepLog(
        run.running_log, len(steps), first_step, outputs.adapter.parent.name, curves, device, group.is_main
    ) as log:
        during.after(model, first_step, len(steps), log)  # before the first step, where it is due
        said = partial(_out_of_memory_said, batcher.budget, chosen, method, device)
        for step, (groups, micro_batches) in _memory_told(_step_batches(method, steps, todo, batcher), todo, said):
            with said(step), _step_named(step, len(steps)):
                fields, lr, grad_norm = trainer.step(groups, micro_batches)
            done = step + 1
            fields |= batcher.work_spread(groups) | method.step_fields()  # a method's own sharing says its spread
            log.step(done, fields, lr, grad_norm, [s for g in groups for s in g.samples])
            if reason := _stop_reason(stop, done, len(steps), group, device):
                _save_and_stop(run, trainer, reason, done, len(steps))
            if done % checkpoint_every == 0 and done < len(steps) and group.is_main:
                run.save_checkpoint(done, model, optimizer, scheduler, method)
            during.after(model, done, len(steps), log)
        method.after_last_step(model, log)
    if not group.is_main:
        distributed.barrier()  # until the main process has written the outputs
        return run.kept.read_summary()

    # The finished outputs, kept in the run directory (the checkpoints have served), then published.
    summary = _summary(
        run, inputs, settings, evaluation, trainer, data, steps, first_step, chosen, during, started
    ) | census.finish(model)
    run.finish(summary, model, during.kept_step())
    result = run.publish(outputs)
    distributed.barrier()
    return result


@contextmanager
def _out_of_memory_said(budget, chosen: dict | None, method, device, step: int):
    """Step `step` (from 0) running out of the GPU's memory, said in one sentence with what to change."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        beside = method.held_beside()  # a reward stage's rollout engine (vlft.training.grpo)
        gpu = f"GPU's {token_budget.memory_limit(device) / 2**30:.1f} GiB" if device.type == "cuda" else "memory"
        held = f"max_batch_tokens: {budget}{' (chosen by auto)' if chosen else ''}" if budget else "no max_batch_tokens"
        advice = (
            "a smaller number" if chosen else "max_batch_tokens: auto, which measures this GPU, or a smaller number"
        )
        raise ConfigError(
            f"this stage's step {step + 1} ran out of the {gpu} with {held}{beside}: "
            f"give {advice}, or activation_checkpointing: true"
        ) from error


def _memory_told(batches, todo: range, said):
    """Each step of `todo` with its batches, a step that runs out of memory while they are made (a
    reward stage's rollout) `said` so."""
    batches = iter(batches)
    for step in todo:
        with said(step):
            made = next(batches)
        yield step, made


def _setup_curves(curves_dir, report_to, params: dict, first_step: int, init_adapter: str | None, metrics, group):
    """The stage's live curves (TensorBoard, and the trackers `report_to` names), the main process's
    alone; a curriculum's go on from the steps of the stages it starts from (`init_adapter`'s)."""
    if not curves_dir or not group.is_main:
        return None
    return Curves(curves_dir, first_step, _steps_before(init_adapter), metrics, report_to, params)


def _step_batches(method, steps: list, todo: range, batcher):
    """Each step's groups and micro-batches: laid out one step ahead in a background thread, or
    where the method samples its answers (grpo: on-policy), at the step itself, after the step
    before has updated the adapter (the generator runs as the loop asks for the next step)."""
    if method.on_policy:
        upcoming = [steps[step + 1] if step + 1 < len(steps) else None for step in todo]
        return (method.step_batches(steps[step], step, batcher, next_step) for step, next_step in zip(todo, upcoming))
    return prefetched((g, batcher(g)) for g in (method.step_groups(steps[step]) for step in todo))


@dataclass
class Trainer:
    """One optimizer step of whichever method: its micro-batches' losses summed on the device, the
    gradients (and the sums) added up across processes, clipped, and the step taken."""

    model: torch.nn.Module
    method: TrainingMethod
    optimizer: torch.optim.Optimizer
    scheduler: object
    max_grad_norm: float
    device: torch.device
    dtype: torch.dtype
    group: distributed.Group

    def __post_init__(self):
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.forward_context = adapter_autocast(self.model, self.device, self.dtype)

    def step(self, groups: list, micro_batches: list[dict]) -> tuple[dict, float, float]:
        """The step's log fields (the method's metrics a mean over its weight), its learning rate
        (the scheduled one it used) and the gradient norm before clipping."""
        weight = self.method.step_weight(groups)  # of the whole step, whichever process computes it
        # The sums stay on the device until the step ends: no sync between micro-batches, so the
        # host queues the next one while the GPU still works on this one.
        dtype = torch.promote_types(self.dtype, torch.float32)
        totals = torch.zeros(len(self.method.METRICS), device=self.device, dtype=dtype)
        for host_batch in micro_batches:
            # A host batch, or what the method keeps on the device for itself (grpo: the prompts' forward).
            batch = to_device(host_batch, self.device, self.dtype) if isinstance(host_batch, dict) else host_batch
            with self.forward_context:
                sums = self.method.loss_sums(self.model, batch)
            if isinstance(host_batch, dict) and host_batch.get(FILLER):  # the sharded layers' collectives alone
                (sums[0] * 0).backward()
                continue
            (sums[0] / weight).backward()
            totals += torch.stack([s.detach() for s in sums])
        if self.group.size > 1:
            distributed.sum_across(self.trainable, totals)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        totals = totals.tolist()
        stop_if_not_finite(totals[0] / weight, float(grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses; the scheduler then sets the next
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {name: total / weight for name, total in zip(self.method.METRICS, totals)}, lr, float(grad_norm)


@contextmanager
def _step_named(step: int, total: int):
    """A step that cannot go on (vlft.errors.TrainingError), said with its number (from 1)."""
    try:
        yield
    except TrainingError as err:
        raise TrainingError(f"step {step + 1} of {total}: {err}") from None


def stop_if_not_finite(loss: float, grad_norm: float) -> None:
    """A step whose loss or gradient norm is not a finite number would make the adapter's weights NaN:
    the stage stops before that update, publishing nothing, rather than finish with an adapter that
    answers nothing (and could win the report). Its checkpoints from before the step stay."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    raise TrainingError(
        f"the loss is {loss} and the gradient norm {grad_norm}, not finite numbers: the stage stops here with "
        "no adapter (a lower learning_rate or max_grad_norm, or rewards that stay finite, may avoid it)"
    )


def _restore_if_finished(run: RunDirectory, outputs: TrainedStage, retry: bool, group) -> dict | None:
    """The published summary of an earlier run that finished its steps, where it is to be restored
    (vlft.training.runs) and its adapter is whole; None: train. Every process gets the main one's answer."""
    restore = run.restorable(retry)
    if group.size > 1:
        restore = distributed.gathered(restore)[0]  # as the main process saw it, before it changes anything
    if not restore:
        return None
    restored = run.restore(outputs) if group.is_main else None
    if group.size > 1:
        restored = distributed.gathered(restored)[0]
    return restored


def _setup_data(prepared: list[str], caches: list[str], settings: StageSettings, builder, model_config) -> StageData:
    """The stage's records and samples, click answers in the model family's coordinates."""
    return load_stage_data(
        prepared,
        caches,
        builder,
        filters=settings.filter,
        answer_format=settings.answer_format,
        max_seq_len=settings.max_seq_len,
        convention=clicks.convention_for(settings.answer_format, model_config),
        pairs=METHODS[settings.method].pairs,
    )


def _setup_evaluation(inputs: StageInputs, settings, evaluation, builder, tokenizer, base, run, device, dtype):
    """The evaluation during training (`eval_every`), or the object that does nothing."""
    if not settings.eval_every:
        return step_evals.NoEvaluation()
    evaluator = step_evals.StepEvaluator(
        inputs.eval_prepared, inputs.eval_cache, evaluation, settings, builder, tokenizer, base, run.path
    )
    return step_evals.EvaluationDuringTraining(evaluator, device, dtype)


def _setup_model(
    model,
    inputs: StageInputs,
    settings: StageSettings,
    data: StageData,
    device: torch.device,
    how: tuple[bool, str] = (False, "replicate"),
    group: distributed.Group = distributed.Group(),
):
    """A fresh adapter, or the adapter of the stage this one starts from; the frozen tower replaced
    by the vision cache's outputs, packed attention, compiled layers, the frozen base sharded across
    the processes, as the settings and `how` the job runs (activation checkpointing, parallelism) ask."""
    activation_checkpointing, parallelism_setting = how
    vision_cache = uses_vision_cache(data)
    if trains_vision(settings) and vision_cache:  # the plan gives such a stage the pixel cache
        raise ConfigError(
            "this stage trains the vision tower's LoRA or the merger, but was given the vision cache, the frozen "
            "tower's outputs: give it the pixel cache (the plan does, whatever its vision_cache says)"
        )
    init = inputs.init_adapter
    model = with_adapter(model, init, trainable=True) if init else with_new_adapter(model, settings)
    if vision_cache:
        use_vision_cache(model)
    if settings.packing:
        use_packed_attention(model)
    if activation_checkpointing:
        use_activation_checkpointing(model)
    shard = shards_the_base(parallelism_setting, inputs.model_dir, settings, device, group)
    if settings.compile and device.type == "cuda" and not shard:  # sharded layers: not yet measured compiled
        compile_decoder_layers(model)
    if shard:
        shard_frozen_base(model, group, device)
    model.train()
    return model


def _setup_optimizer(model, settings: StageSettings, n_steps: int, n_records: int, device: torch.device, group):
    """AdamW over the adapter (every process starting from the main one's weights) and its schedule."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if group.size > 1:
        distributed.broadcast_from_main(trainable)
    if problem := schedule_problem(settings, n_steps):  # epochs of few records: only now is the count known
        raise ConfigError(f"this stage's {n_records} records make {n_steps} step(s): {problem}")
    optimizer = torch.optim.AdamW(
        trainable, lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=device.type == "cuda"
    )
    scheduler = get_scheduler(
        settings.lr_schedule,
        optimizer,
        num_warmup_steps=warmup_steps(settings, n_steps),
        num_training_steps=n_steps,
    )
    return optimizer, scheduler


def _setup_method(
    settings: StageSettings,
    inputs: StageInputs,
    data: StageData,
    model,
    tokenizer,
    builder,
    run,
    device,
    dtype,
    group,
    steps: list,
):
    """The stage's training method (vlft.training.methods), built with what it computes once before
    the first step."""
    batcher_of = partial(_host_batcher, settings, tokenizer, builder, model=model, device=device, group=group)
    made = MethodInputs(settings, inputs, data, model, tokenizer, builder, run, device, dtype, group, batcher_of, steps)
    return METHODS[settings.method].build(made)


def _host_batcher(settings: StageSettings, tokenizer, builder, data: StageData, model, device, group) -> HostBatcher:
    """The stage's host batcher, without a token budget yet."""
    return HostBatcher(
        data.images,
        builder,
        rope_index(model),
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else builder.end_of_turn,
        settings.packing,
        settings.micro_batch,
        None,
        group,
        pin=device.type == "cuda",
        even=is_sharded(model),
    )


def _setup_batcher(settings: StageSettings, tokenizer, builder, data: StageData, trainer: Trainer, steps: list):
    """The host batcher with the stage's token budget, and for `max_batch_tokens: auto` what was
    chosen and why (vlft.training.token_budget): the tightest GPU's, in a data-parallel job."""
    batcher = _host_batcher(settings, tokenizer, builder, data, trainer.model, trainer.device, trainer.group)
    budget = settings.max_batch_tokens
    if budget != "auto":
        return replace(batcher, budget=budget), None
    samples = [data.samples[record["key"]] for record in data.records]
    # What a token of the update costs, measured with what the method holds beside it on the GPU.
    measured_with, beside = trainer.method.measured_as(), trainer.method.bytes_beside(steps)
    chosen = token_budget.auto_budget(
        trainer.model,
        samples,
        batcher,
        measured_with,
        trainer.optimizer,
        trainer.forward_context,
        trainer.device,
        trainer.dtype,
        beside,
    )
    if beside:  # a reward stage's: with or without its folded adapter, whichever holds its prompts once
        chosen = trainer.method.budget_chosen(chosen, steps)
    budget, group = chosen["max_batch_tokens"], trainer.group
    if group.size > 1:
        budget = min((b for b in distributed.gathered(budget) if b), default=None)
    if group.is_main:
        print(token_budget.describe(chosen), flush=True)
    return replace(batcher, budget=budget), chosen


def _summary(run, inputs, settings, evaluation, trainer, data, steps, first_step, chosen, during, started) -> dict:
    """What the stage did, from its step log: speed and memory, what it trained on, how its adapter
    is used (for predict.py: the base model, and how images and answers were made)."""
    rows = [json.loads(line) for line in run.running_log.read_text().splitlines()]
    summary = {
        "steps": len(steps),
        "resumed_from_step": first_step,
        "samples": len(data.records),
        "wall_time_s": time.time() - started,
        **throughput(rows),
        **trainer.method.summary(rows),
        "device": str(trainer.device),
        "processes": trainer.group.size,
        "sharded_base": is_sharded(trainer.model),  # vlft.training.sharding
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "data_and_settings": training_fingerprint(inputs, settings, evaluation, steps),
        "model": {
            "path": inputs.model_dir,  # as the config gave it: relative to the workflow's directory, maybe
            "resolved": str(Path(inputs.model_dir).resolve()),
            "trust_remote_code": inputs.trust_remote_code,
        },
        "answering": {k: getattr(settings, k) for k in ANSWERING_KEYS},
        "steps_before": _steps_before(inputs.init_adapter),
        "settings": settings.params,  # as the job was given them: what the report says each stage was
    }
    if chosen:
        summary["max_batch_tokens_auto"] = chosen
    return summary | during.summary(rows)


def _stop_reason(stop: StopRequest | None, done: int, total: int, group, device) -> str | None:
    """Why the stage stops after step `done` (a signal, the time limit near), or None; the same on
    every process: the first reason by rank, as a signal sent to every process may not yet have
    reached the one that saves."""
    reason = stop.reason() if stop is not None and done < total else None
    if group.size > 1 and distributed.any_of(reason is not None, device):
        reason = next(r for r in distributed.gathered(reason) if r)
    return reason


def _save_and_stop(run: RunDirectory, trainer: Trainer, reason: str, done: int, total: int) -> None:
    if trainer.group.is_main:
        # Said before saving: SLURM may kill the job while it saves, and this line must reach the log.
        print(f"{reason} after step {done} of {total}: saving a checkpoint", flush=True)
        run.save_checkpoint(done, trainer.model, trainer.optimizer, trainer.scheduler, trainer.method)
    distributed.barrier()  # no process leaves before the checkpoint is complete
    raise Preempted(
        f"{reason}: stopped after step {done} of {total} with a checkpoint saved; the retry (or a rerun) resumes from step {done}"
    )


def _steps_before(init_adapter: str | None) -> int:
    """The optimizer steps of the stages this one starts from; 0 for none."""
    return TrainedStage.of_adapter(init_adapter).steps_through() if init_adapter else 0
