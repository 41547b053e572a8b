"""Evaluate a base model or a trained adapter on one split: greedy answers, accuracy, loss.

In a job of several GPUs each process takes every N-th batch of the split, so that every batch is
the one a single process forms and answers the same; the main process gathers and writes them."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from pathlib import Path

import torch

from vlft.data import clicks

from vlft.jobs import distributed
from vlft.jobs.progress import progress_line
from vlft.data.answers import AnswerFormat, final_answer, is_correct
from vlft.forward.batching import NOT_MODEL_INPUTS, collate, to_device
from vlft.files import write_json, write_jsonl
from vlft.generation.engine import answer_requests
from vlft.generation.shared_prefixes import Cascade, cascade_for, prefixes_shareable
from vlft.generation.text_metrics import text_metrics
from vlft.generation.requests import Request
from vlft.modeling import load_base_model, load_tokenizer, pick_device, rope_index, with_adapter
from vlft.data.prompts import PromptBuilder
from vlft.data.stage_data import StageData, load_stage_data


@torch.no_grad()
def evaluate_split(
    model_dir: str,
    adapter: str | None,
    prepared: str,
    cache: str,
    settings: dict,
    predictions_out: str | Path,
    metrics_out: str | Path,
    trust_remote_code: bool = False,
    answer_lengths: dict[str, int] | None = None,
    stats: dict | None = None,
    share_images: bool = True,
    loaded: tuple | None = None,
) -> dict:
    """`answer_lengths` (for benchmarks) stops each answer after this many tokens, by record id, as if
    the model had ended it there; `stats`, where given, gets the generation's timings and each
    answer's token ids; `share_images` false (for benchmarks) computes every question's image anew;
    `loaded`: (tokenizer, model) as load_answering_model gives them, for a caller that asks again
    (a chat), instead of loading them here."""
    started = time.time()
    group = distributed.join()
    device, dtype = pick_device()
    tokenizer, model = loaded or load_answering_model(model_dir, adapter, trust_remote_code, device, dtype)
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    data = load_stage_data(
        [prepared],
        [cache],
        builder,
        filters={},
        answer_format=settings["answer_format"],
        max_seq_len=settings["max_seq_len"],
        convention=clicks.convention_for(settings["answer_format"], model.config),
    )

    batch_size = settings["batch_size"]
    # This process's batches: every N-th of the split, as one process forms them.
    starts = list(range(group.rank * batch_size, len(data.records), group.size * batch_size))
    mine = [i for start in starts for i in range(start, min(start + batch_size, len(data.records)))]
    ready = _synchronized_time(device)
    # The main process's answers count for all: every process answers about as many.
    what = f"answers ({group.size} processes)" if group.size > 1 else "answers"
    with progress_line(len(mine), what, shown=group.is_main) as progress:
        texts, losses = answer_records(
            model,
            data,
            mine,
            builder,
            tokenizer,
            settings,
            answer_lengths,
            stats,
            share_images,
            device,
            dtype,
            on_answered=progress.update,
        )
    if stats is not None:
        stats["load_s"], stats["generate_s"] = ready - started, _synchronized_time(device) - ready
    answered = _answered_batches(data, starts, batch_size, texts, losses)
    if group.size > 1:
        answered = [batch for part in distributed.gathered(answered) for batch in part]
        if not group.is_main:
            return {}
    predictions, loss_sum, loss_tokens = _in_split_order(answered)
    wall = time.time() - started
    metrics = scores(predictions, loss_sum, loss_tokens, settings["answer_format"])
    metrics |= {"wall_time_s": wall, "samples_per_s": len(predictions) / wall, "dataset": settings.get("dataset")}
    metrics["device"] = str(device)  # what its time was measured on (vlft.study_costs refines predictions by it)
    write_jsonl(predictions_out, predictions)
    write_json(metrics_out, metrics)
    return metrics


def _answered_batches(data: StageData, starts: list[int], batch_size: int, texts: dict, losses: dict) -> list:
    """This process's batches as (start, predictions, loss sum, answer tokens), each batch's loss
    summed in record order: the same sums however the prefills fell."""
    answered = []
    for start in starts:
        batch = range(start, min(start + batch_size, len(data.records)))
        predictions = [prediction_of(data.records[i], texts[i], data) for i in batch]
        loss, tokens = 0.0, 0
        for i in batch:
            loss, tokens = loss + losses[i][0], tokens + losses[i][1]
        answered.append((start, predictions, loss, tokens))
    return answered


def _in_split_order(answered: list) -> tuple[list[dict], float, int]:
    """Every batch's predictions in the split's order, and the loss summed as one process sums it:
    the same figures however many processes ran."""
    answered = sorted(answered, key=lambda batch: batch[0])
    predictions = [p for _, batch, _, _ in answered for p in batch]
    loss_sum, loss_tokens = 0.0, 0
    for _, _, loss, tokens in answered:
        loss_sum, loss_tokens = loss_sum + loss, loss_tokens + tokens
    return predictions, loss_sum, loss_tokens


def load_answering_model(model_dir: str, adapter: str | None, trust_remote_code: bool, device, dtype) -> tuple:
    """The tokenizer, and the base model with the adapter merged (merged weights generate faster and
    give the same outputs), in eval mode."""
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    model = load_base_model(model_dir, device, dtype, trust_remote_code)
    if adapter:
        model = with_adapter(model, adapter, trainable=False).merge_and_unload()
    return tokenizer, model.eval()


def answer_records(
    model,
    data: StageData,
    indices: list[int],
    builder: PromptBuilder,
    tokenizer,
    settings: dict,
    answer_lengths: dict[str, int] | None = None,
    stats: dict | None = None,
    share_images: bool = True,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    on_answered=None,
) -> tuple[dict[int, str], dict[int, tuple[float, int]]]:
    """Greedy answers to the records at `indices` of `data`, `settings["batch_size"]` at a time
    (vlft.generation.engine), and the loss of their reference answers in the format the stage was trained
    on, from the same forward that prefills each prompt: the prompt is computed once for both, the
    questions on one image with its prefix once, and each record's loss is the one it gets alone.
    By record index: the answer's text; (loss sum, answer tokens). `model`: a model as it stands,
    with an adapter merged or not (the evaluation during training answers with the adapter it trains).
    `on_answered(1)` is called as each answer ends (the job's progress line)."""
    device = device or model.device
    dtype = dtype or model.dtype
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else builder.end_of_turn
    texts, losses = {}, {}
    max_new_tokens = settings["max_new_tokens"]
    stops = answer_lengths or {}

    def requests():
        for index in indices:
            record = data.records[index]
            limit = min(max_new_tokens, stops.get(record["id"], max_new_tokens))
            request = prompt_request(
                index, data.samples[record["key"]], data, builder, pad_id, model, device, dtype, limit, scored=True
            )
            yield request if share_images else dataclasses.replace(request, image=None)

    def answer(index: int, ids: list[int]) -> None:
        texts[index] = tokenizer.decode(ids, skip_special_tokens=True)
        if on_answered is not None:
            on_answered(1)
        if stats is not None:  # a benchmark compares the very tokens
            stats.setdefault("answer_ids", {})[data.records[index]["id"]] = ids

    if indices:
        longest = max(data.samples[data.records[i]["key"]].prompt_length for i in indices) + max_new_tokens
        slots = min(settings["batch_size"], len(indices))
        answer_requests(
            model,
            requests(),
            slots=slots,
            end_id=builder.end_of_turn,
            max_length=longest,
            on_answer=answer,
            stats=stats,
            on_loss=lambda index, loss, tokens: losses.__setitem__(index, (loss, tokens)),
            cascade=(
                shared_prefixes(data, indices, slots, max_new_tokens)
                if share_images and device.type == "cuda" and prefixes_shareable(model)
                else None
            ),
        )
    return texts, losses


def scores(predictions: list[dict], loss_sum: float, loss_tokens: int, answer_format: str) -> dict:
    """Accuracy (over all, and by category), loss per answer token and, for clicks, the distances;
    for free-text answers BLEU, ROUGE-L and METEOR of the final answers (vlft.generation.text_metrics)."""
    # A click record with a point and no box has no right or wrong (None): the distance judges it.
    judged = [p for p in predictions if p["correct"] is not None]
    by_category = defaultdict(list)
    for p in judged:
        by_category[p["category"] or "all"].append(p["correct"])
    metrics = {
        "n": len(predictions),
        "accuracy": sum(p["correct"] for p in judged) / max(len(judged), 1),
        "accuracy_by_category": {c: sum(v) / len(v) for c, v in sorted(by_category.items())},
        "loss": loss_sum / max(loss_tokens, 1),
        "answer_format": answer_format,
    }
    platforms = defaultdict(list)
    for p in judged:
        if p.get("platform") is not None:
            platforms[str(p["platform"])].append(p["correct"])
    if platforms:
        metrics["accuracy_by_platform"] = {c: sum(v) / len(v) for c, v in sorted(platforms.items())}
    if answer_format != AnswerFormat.CLICK:  # the free-text metrics of the field's public challenges
        metrics |= text_metrics([p["predicted_answer"] for p in predictions], [p["reference"] for p in predictions])
    else:
        distances = [p["distance"] for p in predictions if p["distance"] is not None]
        metrics |= {
            "n_with_box": len(judged),
            "unparseable": sum(not p["parsed"] for p in predictions),
            # Over the answers that give a point; over the image's diagonal, in original pixels.
            "mean_distance": sum(distances) / len(distances) if distances else None,
        }
    return metrics


def prompt_request(
    key,
    sample,
    data: StageData,
    builder,
    pad_id: int,
    model,
    device,
    dtype,
    max_new_tokens: int,
    scored: bool = False,
    inputs: dict | None = None,
    placed: dict | None = None,
) -> Request:
    """One sample's prompt as vlft.generation.engine answers it (a Request): its model inputs on the
    device and its M-RoPE positions; `scored`, the reference answer after the prompt too, with
    the targets of its loss. `inputs`: its host inputs, read already (`prompt_inputs`); `placed`:
    the images on the device already (vlft.forward.batching.to_device)."""
    inputs = inputs or prompt_inputs(sample, data, builder, pad_id, model, scored)
    inputs = to_device(inputs, device, dtype, placed)
    positions = inputs.pop("position_ids")
    cache, image = data.images[sample.record_id]
    request = Request(key, {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}, positions, max_new_tokens)
    request.image, request.image_tokens = image, cache.num_image_tokens(image)
    if scored:
        request.prompt_length = sample.prompt_length
        request.loss_positions, request.loss_targets = inputs["answer_positions"], inputs["answer_targets"]
    return request


def prompt_inputs(
    sample,
    data: StageData,
    builder,
    pad_id: int,
    model,
    scored: bool = False,
    pin: bool = False,
    read_image: bool = True,
) -> dict:
    """A sample's prompt (and reference answer, `scored`) as model inputs on the host: its image read
    and its M-RoPE positions computed (what a reward stage reads a step ahead, in a thread); `pin`:
    in pinned memory, so that its copy to a GPU does not hold up the host; `read_image` false: the
    image left out (one that another question on it brings)."""
    return collate(
        [sample],
        data.images,
        builder,
        pad_id,
        prompt_only=not scored,
        rope_index=rope_index(model),
        pin=pin,
        read_images=read_image,
    )


def shared_prefixes(data: StageData, indices: list[int], slots: int, answer_room: int) -> Cascade | None:
    """On a GPU, the questions on one image keep its prefix once in the KV cache and their decode
    steps read it once (vlft.generation.shared_prefixes; the decode step's speed-up is in
    benchmarks/README.md). On a CPU the step runs transformers' own attention, as `generate` does."""
    prompts = []
    for index in indices:
        sample = data.samples[data.records[index]["key"]]
        prompts.append((data.images[sample.record_id][1], sample.input_ids[: sample.prompt_length]))
    return cascade_for(prompts, slots, answer_room)


def _synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def prediction_of(record: dict, text: str, data: StageData) -> dict:
    prediction = {
        "id": record["id"],
        "category": record.get("category"),
        "question": record["question"],
        "reference": final_answer(record["answer"]),
        "prediction": text.strip(),
        "predicted_answer": final_answer(text),
    }
    if record["key"] not in data.frames:
        return prediction | {"correct": is_correct(text, record["answer"])}
    # A click: the reference is the target as the model is taught to say it; judged in pixels.
    frame = data.frames[record["key"]]
    where = record["source_split"]
    prediction["reference"] = clicks.target_text(record, frame, where)
    # ScreenSpot's results are reported per platform (v1/v2's data_source, Pro's platform) too.
    platform = record.get("platform", record.get("data_source"))
    return prediction | {"box": record.get("box"), "platform": platform} | clicks.score(record, text, frame, where)
