"""Train one stage: LoRA on the language model, from the pixel or vision cache, resumable, stoppable at any step.

A plain loop rather than transformers.Trainer: the stage's sample order is part of the experiment
(curricula), batches come from our caches (pixels, or the frozen vision tower's outputs) packed
into rows under a token budget (vlft.packing), the loss is summed per token across gradient
accumulation and computed on answer tokens only (vlft.loss), and a signal from SLURM or the job's
time limit coming close must end in a checkpoint at a step boundary (vlft.stopping). Each of those
is a fight with Trainer's sampler, collator and resume logic; here they are a few lines each. A job
given several GPUs runs this in one process each, every step's samples shared out among them and the
gradients summed (vlft.distributed): the step one process would take. It reads top to bottom:
data -> model -> optimizer -> resume -> loop -> save.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import get_scheduler

from vlft import checkpoints, clicks, distributed, step_evals, token_budget
from vlft.curves import Curves
from vlft.batching import collate, prefetched, to_device, token_budget_batches
from vlft.loss import answer_loss_sum
from vlft.errors import ConfigError, InputError
from vlft.files import atomic_path, remove_inside, storage_error, write_json
from vlft.integrity import adapter_checksums, verify_adapter
from vlft.modeling import (
    adapter_autocast,
    load_base_model,
    load_tokenizer,
    pick_device,
    rope_index,
    unwrapped,
    use_activation_checkpointing,
    with_adapter,
    with_new_adapter,
)
from vlft.image_groups import ImageGroup, group_rows, grouped_steps
from vlft.packing import pack, pack_groups, packed_batches, use_packed_attention
from vlft.prompts import PromptBuilder
from vlft.plan import LEFT_OUT_WITH, schedule_problem, warmup_steps
from vlft.records import order_records
from vlft.shards import INDEX
from vlft.stage_data import load_stage_data, uses_vision_cache
from vlft.stopping import StopRequest
from vlft.vision_cache import use_vision_cache

# In a run directory: the outputs of a run that finished its steps, and in them, until they have
# reached the workflow's paths whole, a mark that they have not. (A mark of what is missing, so that
# a finished run of an earlier version, which has none, counts as published.)
FINISHED = "finished"
UNPUBLISHED = "unpublished"
# The settings that say how a stage's model reads images and answers (vlft.plan.Plan.eval_settings').
ANSWERING_KEYS = ("answer_format", "min_pixels", "max_pixels", "max_seq_len")


class Preempted(Exception):
    """Raised after a stop request (a signal, the time limit near) and a saved checkpoint."""


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


def plan_steps(records: list[dict], settings: dict) -> list[list[list[str]]]:
    """Every optimizer step of the run as its micro-batches of record keys, in training order."""
    micro, accum = settings["micro_batch"], settings["grad_accum"]
    steps_per_epoch = math.ceil(math.ceil(len(records) / micro) / accum)
    total = settings["max_steps"] or settings["epochs"] * steps_per_epoch
    steps, epoch = [], 0
    while len(steps) < total:
        ordered = order_records(
            records, settings["order"], settings["order_field"], settings["order_descending"], settings["seed"], epoch
        )
        keys = [r["key"] for r in ordered]
        batches = [keys[i : i + micro] for i in range(0, len(keys), micro)]
        steps += [batches[i : i + accum] for i in range(0, len(batches), accum)]
        epoch += 1
    return steps[:total]


def compile_decoder_layers(model, backend: str = "inductor") -> None:
    """torch.compile each decoder layer of the language model: fused elementwise work around the
    matmuls, one graph reused by every layer; dynamic shapes, as batch widths vary.

    Floats specialized: with dynamic shapes dynamo otherwise passes each Python float the layer
    reads (LoRA's scaling, the norms' epsilon) into the graph as a float64 tensor on the CPU, and
    inductor compiles a C++ kernel to convert it. Loading that kernel in a later job probes the
    CPU's vector instructions with a C++ compiler and a Python subprocess per instruction set: on
    the GPU machine some 40 s of each training job's 48 s warm compile (benchmarks/README.md). The
    floats are constants of the model, so specializing them costs no recompiles."""
    torch._dynamo.config.specialize_float = True
    for layer in unwrapped(model).model.language_model.layers:
        layer.compile(dynamic=True, backend=backend)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def train_stage(
    inputs: StageInputs,
    settings: dict,
    adapter_out: str | Path,
    log_out: str | Path,
    summary_out: str | Path,
    checkpoint_root: str | Path,
    checkpoint_every: int,
    stop: StopRequest | None = None,
    dtype: torch.dtype | None = None,
    reuse_finished: bool = False,
    curves_dir: str | Path | None = None,
    activation_checkpointing: bool = False,
) -> dict:
    """A run that finished its steps is kept (`finished` in its run directory) and restored rather
    than trained again where publishing it never completed (a full disk, a kill while it copied),
    whichever step failed; and, with `reuse_finished`, where this job is a retry of one that may
    have published it and been stopped just after (a time limit reached as it wrote its outputs).
    Otherwise, a new run or one forced with -f or -R, it trains. `dtype`: the model's, by default
    the device's (bf16 on a GPU, float32 on the CPU); tests train in float64 to compare two layouts
    of one computation beyond float32 rounding. In a data-parallel job every process calls this;
    the main one alone writes files. `curves_dir`: where the stage's TensorBoard run goes (vlft.curves).
    `activation_checkpointing`: recompute activations in the backward pass (less memory, the same
    result: a setting of how the job runs, not of what it computes). With `eval_every` in the
    settings, the stage evaluates as it trains (vlft.step_evals), as `settings["evaluation"]` says."""
    started = time.time()
    group = distributed.join()
    run_dir = _run_dir(checkpoint_root, inputs, settings, clean=group.is_main)
    finished = run_dir / FINISHED
    restore = (finished / "summary.json").exists() and (reuse_finished or (finished / UNPUBLISHED).exists())
    if group.size > 1:
        restore = distributed.gathered(restore)[0]  # as the main process saw it, before it changes anything
    if restore:
        restored = _restore_finished(finished, adapter_out, log_out, summary_out) if group.is_main else None
        if group.size > 1:
            restored = distributed.gathered(restored)[0]
        if restored is not None:
            return restored
    if group.is_main:
        remove_inside(finished, run_dir)
    device, device_dtype = pick_device()
    dtype = dtype or device_dtype
    torch.manual_seed(settings["seed"])

    # Data: tokenized once; pixels are read from the cache per batch.
    tokenizer = load_tokenizer(inputs.model_dir, inputs.trust_remote_code)
    # quantization_bit is absent while off (vlft.plan.LEFT_OUT_WHEN_OFF).
    quantization_bit = settings.get("quantization_bit")
    model = load_base_model(inputs.model_dir, device, dtype, inputs.trust_remote_code, quantization_bit)
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    data = load_stage_data(
        inputs.prepared,
        inputs.caches,
        builder,
        filters=settings["filter"],
        answer_format=settings["answer_format"],
        max_seq_len=settings["max_seq_len"],
        convention=clicks.Convention.of(model.config) if settings["answer_format"] == "click" else None,
    )
    image_groups = settings.get("image_groups", False)  # absent while off (vlft.plan.LEFT_OUT_WHEN_OFF)
    steps = grouped_steps(data.records, data.images, settings) if image_groups else plan_steps(data.records, settings)

    evaluator = None
    if settings.get("eval_every"):  # absent while off (vlft.plan.LEFT_OUT_WHEN_OFF)
        evaluator = step_evals.StepEvaluator(
            inputs.eval_prepared,
            inputs.eval_cache,
            settings["evaluation"],
            settings,
            builder,
            tokenizer,
            model,
            run_dir,
        )

    # Model: the adapter to train, on the base model as the stage's data and settings want it.
    model = _setup_model(
        model, inputs.init_adapter, settings, uses_vision_cache(data), device, activation_checkpointing
    )
    forward_context = adapter_autocast(model, device, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if group.size > 1:
        distributed.broadcast_from_main(trainable)
    if problem := schedule_problem(settings, len(steps)):  # epochs of few records: only now is the count known
        raise ConfigError(f"this stage's {len(data.records)} records make {len(steps)} step(s): {problem}")
    optimizer, scheduler = _setup_optimizer(trainable, settings, len(steps), device)

    # Resume from the newest complete checkpoint of this exact stage, if any.
    running_log = run_dir / "log.jsonl"
    first_step = _resume(run_dir, running_log, model, optimizer, scheduler, truncate_log=group.is_main)
    evals = []  # the evaluations during training so far (main process)
    if evaluator and group.is_main:
        _truncate_log(run_dir / step_evals.EVALS_LOG, first_step)
        step_evals.forget_after(run_dir, first_step)
        evals = step_evals.read(run_dir)
    saved_step = first_step  # of the newest checkpoint

    # Loop. Each step's micro-batches are read and laid out on the host one step ahead, in a
    # background thread, while the GPU trains on the step before.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else builder.end_of_turn
    positions, pin = rope_index(model), device.type == "cuda"
    budget, chosen = settings["max_batch_tokens"], None
    if budget == "auto":
        chosen = _auto_budget(
            model, data, builder, positions, pad_id, settings, optimizer, forward_context, device, dtype
        )
        budget = chosen["max_batch_tokens"]
        if group.size > 1:  # the tightest GPU's
            budget = min((b for b in distributed.gathered(budget) if b), default=None)
        if group.is_main:
            print(_auto_budget_line(chosen), flush=True)

    def host_batches(step: int) -> list[dict]:
        if image_groups:
            return grouped_host_batches(step)
        micro_batches = [[data.samples[key] for key in keys] for keys in steps[step]]
        if group.size > 1:  # this process's share of the step, cut as the step's own micro-batches are
            share = distributed.share_by_tokens([s for b in micro_batches for s in b], group.size)[group.rank]
            micro_batches = [
                share[i : i + settings["micro_batch"]] for i in range(0, len(share), settings["micro_batch"])
            ]
        if budget:
            split = packed_batches if settings["packing"] else token_budget_batches
            micro_batches = split([s for b in micro_batches for s in b], budget)
        if settings["packing"]:
            return [pack(b, data.images, builder, positions, pin=pin) for b in micro_batches]
        return [collate(b, data.images, builder, pad_id, rope_index=positions, pin=pin) for b in micro_batches]

    def grouped_host_batches(step: int) -> list[dict]:
        groups = [ImageGroup.of([data.samples[key] for key in keys]) for keys in steps[step]]
        if group.size > 1:  # this process's share of the step: whole groups, balanced by tokens
            groups = distributed.share_by_tokens(groups, group.size, length=lambda g: g.tokens)[group.rank]
        # Rows under the token budget, or of at most micro_batch samples without one.
        rows = group_rows(groups, budget, None if budget else settings["micro_batch"])
        return [pack_groups(row, data.images, builder, positions, pin=pin) for row in rows]

    progress = tqdm(
        total=len(steps),
        initial=first_step,
        desc=Path(adapter_out).parent.name,
        mininterval=5,
        disable=not group.is_main,
    )
    todo = range(first_step, len(steps))
    step_start = time.time()  # a step's time runs from the end of the one before: waits included
    # A curriculum's curves go on from the steps of the stages it starts from.
    steps_before = _steps_before(inputs.init_adapter)
    curves = Curves(curves_dir, first_step, steps_before) if curves_dir and group.is_main else nullcontext()

    def evaluate_after(step: int) -> None:
        record = evaluator(model, step, device, dtype)
        if group.is_main:
            evaluator.keep_if_best(record, evals, model, saved_step)
            evals.append(record)
            step_evals.append(run_dir, record)
            # Above the progress bar (stderr): in a job's log, a line of its own.
            progress.write(step_evals.describe(record), file=sys.stderr)
            if isinstance(curves, Curves):
                curves.add_evaluation(record)

    # The bar is closed (its line ended) however the loop ends: an error's line then starts a line of its own.
    with progress, curves, open(running_log, "a") if group.is_main else open(os.devnull, "w") as log:
        # Before the first step, or where a stopped attempt saved its checkpoint before it could evaluate.
        if evaluator and evaluator.due(first_step, len(steps)) and _unevaluated(evals, first_step, group):
            evaluate_after(first_step)
            step_start = time.time()
        for step, micro_batches in zip(todo, prefetched(host_batches(step) for step in todo)):
            samples = [data.samples[key] for keys in steps[step] for key in keys]
            # Every answer token of the whole step, whichever process computes it.
            n_targets = sum(len(s.input_ids) - s.prompt_length for s in samples)
            # The loss stays on the device until the step ends: no sync between micro-batches, so
            # the host queues the next one while the GPU still works on this one.
            loss_total = torch.zeros((), device=device, dtype=torch.promote_types(dtype, torch.float32))
            for host_batch in micro_batches:
                with forward_context:
                    loss_sum, _ = answer_loss_sum(model, to_device(host_batch, device, dtype))
                (loss_sum / n_targets).backward()
                loss_total += loss_sum.detach()
            if group.size > 1:
                distributed.sum_across(trainable, loss_total)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, settings["max_grad_norm"])
            loss_total = loss_total.item()
            lr = optimizer.param_groups[0]["lr"]  # the rate this step uses; the scheduler then sets the next
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            elapsed, step_start = time.time() - step_start, time.time()
            record = _log_record(step + 1, loss_total / n_targets, lr, float(grad_norm), samples, elapsed, device)
            try:
                log.write(json.dumps(record) + "\n")
                log.flush()
            except OSError as err:
                raise storage_error(err, running_log) or err
            if isinstance(curves, Curves):
                curves.add(record)
            # Redrawn by update() at most every `mininterval` seconds, so SLURM logs stay small.
            progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
            progress.update(1)
            done = step + 1
            reason = stop.reason() if stop is not None and done < len(steps) else None
            if group.size > 1 and distributed.any_of(reason is not None, device):
                # All stop at this step, for the first reason by rank: a signal sent to every
                # process may not yet have reached the one that saves, which then says what came.
                reason = next(r for r in distributed.gathered(reason) if r)
            if evaluator and evaluator.due(done, len(steps)) and not reason:
                evaluate_after(done)
                step_start = time.time()  # a step's time leaves the evaluation out
            if reason:
                if group.is_main:
                    # Said before saving: SLURM may kill the job while it saves, and this line must reach the log.
                    print(f"{reason} after step {done} of {len(steps)}: saving a checkpoint", flush=True)
                    checkpoints.save(run_dir, done, model, optimizer, scheduler)
                distributed.barrier()  # no process leaves before the checkpoint is complete
                raise Preempted(
                    f"{reason}: stopped after step {done} of {len(steps)} with a checkpoint saved; "
                    f"the retry (or a rerun) resumes from step {done}"
                )
            if done % checkpoint_every == 0 and done < len(steps) and group.is_main:
                checkpoints.save(run_dir, done, model, optimizer, scheduler)
                saved_step = done
                step_evals.prune_bests(run_dir, saved_step)
    if not group.is_main:
        distributed.barrier()  # until the main process has written the outputs
        return json.loads((finished / "summary.json").read_text())

    # Save: the finished outputs, kept in the run directory until this stage runs with other
    # settings (the checkpoints have served), then published where the workflow wants them.
    rows = [json.loads(line) for line in running_log.read_text().splitlines()]
    summary = {
        "steps": len(steps),
        "resumed_from_step": first_step,
        "samples": len(data.records),
        "wall_time_s": time.time() - started,
        **_throughput(rows),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "data_and_settings": training_fingerprint(inputs, settings, steps),
        # How the adapter is used, for predict.py: the base model, and how images and answers were made.
        "model": {
            "path": inputs.model_dir,  # as the config gave it: relative to the workflow's directory, maybe
            "resolved": str(Path(inputs.model_dir).resolve()),
            "trust_remote_code": inputs.trust_remote_code,
        },
        "answering": {k: settings[k] for k in ANSWERING_KEYS},
        "steps_before": steps_before,
    }
    if chosen:
        summary["max_batch_tokens_auto"] = chosen
    kept = None
    if evaluator:
        summary |= _evaluation_summary(evals, rows)
        if kept := step_evals.best_of(evals, settings["best_metric"]) if settings["keep"] == "best" else None:
            summary["kept"] = {"step": kept["step"], "best_metric": settings["best_metric"]} | {
                k: kept[k] for k in ("accuracy", "loss")
            }
    with atomic_path(finished) as tmp:
        tmp.mkdir()
        if kept:
            shutil.copytree(run_dir / f"{step_evals.BEST_PREFIX}{kept['step']:08d}", tmp / "adapter")
        else:
            model.save_pretrained(tmp / "adapter")
        summary["adapter_crc32"] = adapter_checksums(tmp / "adapter")  # checked wherever it is loaded
        shutil.copyfile(running_log, tmp / "log.jsonl")
        write_json(tmp / "summary.json", summary)
        (tmp / UNPUBLISHED).touch()
    for checkpoint in [*run_dir.glob("step-*"), *step_evals.best_dirs(run_dir).values()]:
        remove_inside(checkpoint, run_dir)
    running_log.unlink()
    (run_dir / step_evals.EVALS_LOG).unlink(missing_ok=True)
    result = _publish(finished, adapter_out, log_out, summary_out)
    distributed.barrier()
    return result


def _publish(finished: Path, adapter_out, log_out, summary_out) -> dict:
    """Copy a finished run's outputs to the workflow's paths, each complete or not at all, then remove
    the run's mark that they are not: until then, any rerun restores it."""
    with atomic_path(adapter_out) as tmp:
        shutil.copytree(finished / "adapter", tmp)
    for name, target in (("log.jsonl", log_out), ("summary.json", summary_out)):
        with atomic_path(target) as tmp:
            shutil.copyfile(finished / name, tmp)
    (finished / UNPUBLISHED).unlink(missing_ok=True)
    return json.loads((finished / "summary.json").read_text())


def _restore_finished(finished: Path, adapter_out, log_out, summary_out) -> dict | None:
    """Publish the outputs of an earlier run that finished its steps; None where its adapter was
    damaged since (it is removed, and the stage trains)."""
    try:
        verify_adapter(finished / "adapter")
    except InputError as err:
        print(f"cannot restore the finished run ({err}): training the stage", flush=True)
        remove_inside(finished, finished.parent)
        return None
    print(f"this stage finished its steps in an earlier run: restoring its outputs from {finished}", flush=True)
    return _publish(finished, adapter_out, log_out, summary_out)


def _setup_model(
    model,
    init_adapter: str | None,
    settings: dict,
    vision_cache: bool,
    device: torch.device,
    activation_checkpointing: bool = False,
):
    """A fresh adapter, or the adapter of the stage this one starts from; the frozen tower replaced
    by the vision cache's outputs, packed attention, compiled layers, as the settings ask."""
    model = with_adapter(model, init_adapter, trainable=True) if init_adapter else with_new_adapter(model, settings)
    if vision_cache:
        use_vision_cache(model)
    if settings["packing"]:
        use_packed_attention(model)
    if activation_checkpointing:
        use_activation_checkpointing(model)
    if settings["compile"] and device.type == "cuda":
        compile_decoder_layers(model)
    model.train()
    return model


def _setup_optimizer(trainable: list, settings: dict, n_steps: int, device: torch.device):
    optimizer = torch.optim.AdamW(
        trainable, lr=settings["learning_rate"], weight_decay=settings["weight_decay"], fused=device.type == "cuda"
    )
    scheduler = get_scheduler(
        settings["lr_schedule"],
        optimizer,
        num_warmup_steps=warmup_steps(settings, n_steps),
        num_training_steps=n_steps,
    )
    return optimizer, scheduler


def _auto_budget(model, data, builder, positions, pad_id, settings, optimizer, forward_context, device, dtype) -> dict:
    """`max_batch_tokens: auto` (vlft.token_budget): the budget chosen for this GPU and the
    measurement it was chosen from, for the summary."""
    if device.type != "cuda":
        return {"max_batch_tokens": None, "why": "no GPU: micro_batch samples a micro-batch"}
    ordered = [data.samples[record["key"]] for record in data.records]
    longest = max(len(s.input_ids) for s in ordered)

    def run_micro_batch(length: int) -> int:
        """A forward and backward of the stage's first samples, packed (or padded) to `length` tokens."""
        candidates, total = [], 0
        for sample in ordered:
            if total >= 2 * length:
                break
            candidates.append(sample)
            total += len(sample.input_ids)
        if settings["packing"]:
            batch = max(packed_batches(candidates, length), key=lambda b: sum(len(s.input_ids) for s in b))
            host = pack(batch, data.images, builder, positions)
        else:
            batch = max(token_budget_batches(candidates, length), key=len)
            host = collate(batch, data.images, builder, pad_id, rope_index=positions)
        with forward_context:
            loss_sum, _ = answer_loss_sum(model, to_device(host, device, dtype))
        loss_sum.backward()
        return sum(len(s.input_ids) for s in batch)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    moments = 0 if optimizer.state else 2 * 4 * trainable  # AdamW's, made at the first step
    limit = token_budget.memory_limit(device)
    try:
        fixed, per_token = token_budget.without_side_effects(
            model, lambda: token_budget.measure(run_micro_batch, (longest, 2 * longest), device)
        )
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        raise ConfigError(
            f"max_batch_tokens: auto: this GPU's {limit / 2**30:.1f} GiB cannot train micro-batches of twice the longest "
            f"sample ({2 * longest} tokens); give activation_checkpointing: true or quantization_bit: 4"
        ) from None
    torch.cuda.empty_cache()
    budget = token_budget.choose(limit, fixed + moments, per_token, longest)
    if budget is None:
        raise ConfigError(
            f"max_batch_tokens: auto: this GPU's {limit / 2**30:.1f} GiB cannot hold the longest sample ({longest} tokens) "
            "besides the model; give activation_checkpointing: true or quantization_bit: 4"
        )
    return {
        "max_batch_tokens": budget,
        "memory_limit_gib": limit / 2**30,
        "held_gib": (fixed + moments) / 2**30,
        "per_token_kib": per_token / 2**10,
        "longest_sample": longest,
    }


def _auto_budget_line(chosen: dict) -> str:
    if chosen["max_batch_tokens"] is None:
        return f"max_batch_tokens: auto: {chosen['why']}"
    return (
        f"max_batch_tokens: auto: {chosen['max_batch_tokens']} tokens, to fill {token_budget.SAFETY:.0%} of "
        f"{chosen['memory_limit_gib']:.1f} GiB at {chosen['per_token_kib']:.0f} KiB a token "
        f"beside {chosen['held_gib']:.1f} GiB held (measured on this stage's samples)"
    )


def _unevaluated(evals: list[dict], step: int, group) -> bool:
    """Whether the adapter after `step` has no evaluation yet, as the main process knows it."""
    missing = not any(r["step"] == step for r in evals)
    return distributed.gathered(missing)[0] if group.size > 1 else missing


def _evaluation_summary(evals: list[dict], rows: list[dict]) -> dict:
    """The evaluations during training, and their share of the stage's time (its steps' and theirs)."""
    eval_s = sum(r["seconds"] for r in evals)
    train_s = sum(r["samples"] / r["samples_per_s"] for r in rows)
    return {"evaluations_during_training": evals, "eval_s": eval_s, "eval_share": eval_s / (eval_s + train_s)}


def _steps_before(init_adapter: str | None) -> int:
    """The optimizer steps of the stages this one starts from, from its starting stage's summary
    (beside its adapter); 0 for none, or where that summary is of a version that did not count them."""
    if not init_adapter:
        return 0
    summary = json.loads((Path(init_adapter).parent / "summary.json").read_text())
    return summary.get("steps_before", 0) + summary["steps"]


def _throughput(rows: list[dict]) -> dict:
    """The stage's speed and memory, from its per-step log."""
    return {
        "samples_per_s": sum(r["samples_per_s"] for r in rows) / len(rows),
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / len(rows),
        "peak_memory_gb": max(r["memory_gb"] for r in rows),
        "final_loss": rows[-1]["loss"],
    }


def _run_dir(checkpoint_root: str | Path, inputs: StageInputs, settings: dict, clean: bool) -> Path:
    """This exact stage's checkpoint directory: its settings and the content of its inputs. Those of
    the stage's earlier settings go: no run of this stage will resume them."""
    run_dir = Path(checkpoint_root) / checkpoints.fingerprint(settings, _input_files(inputs) + _eval_files(inputs))
    for earlier in Path(checkpoint_root).glob("*") if clean else ():
        if earlier != run_dir:
            remove_inside(earlier, checkpoint_root)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _input_files(inputs: StageInputs) -> list[Path]:
    """The files whose content a stage computes from: its records, its caches' indexes (each image's
    checksum), the adapter it starts from."""
    files = [Path(p) for p in inputs.prepared] + [Path(c) / INDEX for c in inputs.caches]
    if inputs.init_adapter:
        files.append(Path(inputs.init_adapter) / "adapter_model.safetensors")
    return files


def _eval_files(inputs: StageInputs) -> list[Path]:
    """The files its evaluations during training read, where it has them."""
    return [Path(inputs.eval_prepared), Path(inputs.eval_cache) / INDEX] if inputs.eval_prepared else []


def training_fingerprint(inputs: StageInputs, settings: dict, steps: list) -> str:
    """What a stage trained on, however its config said it: its inputs' content, its settings with
    the filter replaced by the records it selected (and without the splits it is evaluated on), and
    every step's records in order. Two stages with one fingerprint compute the same adapter (the
    report says so: a repeat is no second finding)."""
    left_out, files = ["filter", "eval_splits"], _input_files(inputs)
    if settings.get("keep", "last") == "last":  # evaluating as it trains changes nothing it trains
        left_out += ["eval_every", *LEFT_OUT_WITH, "evaluation"]
    else:
        files += _eval_files(inputs)
    computed = {k: v for k, v in settings.items() if k not in left_out} | {"steps": steps}
    return checkpoints.fingerprint(computed, files)


def _resume(run_dir: Path, running_log: Path, model, optimizer, scheduler, truncate_log: bool) -> int:
    """Restore the newest complete checkpoint, if any; the step it was saved after (0 for none)."""
    first_step = 0
    if (checkpoint := checkpoints.latest(run_dir)) is not None:
        first_step = checkpoints.restore(checkpoint, model, optimizer, scheduler)
        if truncate_log:  # the main process's; the others' go unsaid
            print(f"resuming from step {first_step} ({checkpoint})", flush=True)
    if truncate_log:
        _truncate_log(running_log, first_step)
    return first_step


def _log_record(step: int, loss: float, lr: float, grad_norm: float, samples: list, elapsed: float, device) -> dict:
    """One line of the per-step log; `lr` is the scheduled learning rate of the step."""
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "samples": len(samples),
        "samples_per_s": len(samples) / elapsed,
        "tokens_per_s": sum(len(s.input_ids) for s in samples) / elapsed,
        "memory_gb": memory_gb(device),
        "time": time.time(),
    }


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop log lines past the resumed step: they belong to work that is being redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))
