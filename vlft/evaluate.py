"""Evaluate a base model or a trained adapter on one split: greedy answers, accuracy, loss.

In a job of several GPUs each process takes every N-th batch of the split, so that every batch is
the one a single process forms and answers the same; the main process gathers and writes them."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

from vlft import clicks, distributed
from vlft.answers import final_answer, is_correct
from vlft.batching import NOT_MODEL_INPUTS, collate, to_device
from vlft.loss import answer_loss_sum
from vlft.files import write_json, write_jsonl
from vlft.modeling import load_base_model, load_tokenizer, pick_device, rope_index, with_adapter
from vlft.prompts import PromptBuilder
from vlft.stage_data import StageData, load_stage_data


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
) -> dict:
    started = time.time()
    group = distributed.join()
    device, dtype = pick_device()
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    model = load_base_model(model_dir, device, dtype, trust_remote_code)
    if adapter:
        # Merged weights generate faster and give the same outputs.
        model = with_adapter(model, adapter, trainable=False).merge_and_unload()
    model.eval()
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    data = load_stage_data(
        [prepared],
        [cache],
        builder,
        filters={},
        answer_format=settings["answer_format"],
        max_seq_len=settings["max_seq_len"],
        convention=clicks.Convention.of(model.config) if settings["answer_format"] == "click" else None,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else builder.end_of_turn

    batch_size = settings["batch_size"]
    answered = []  # (first record's index, its batch's predictions, loss sum, answer tokens)
    for start in range(group.rank * batch_size, len(data.records), group.size * batch_size):
        records = data.records[start : start + batch_size]
        samples = [data.samples[r["key"]] for r in records]

        # Loss of the reference answer, in the format the stage was trained on.
        batch = collate(samples, data.images, builder, pad_id, rope_index=rope_index(model))
        loss, tokens = answer_loss_sum(model, to_device(batch, device, dtype))

        prompts = collate(samples, data.images, builder, pad_id, left_pad=True, prompt_only=True)
        prompts = {k: v for k, v in to_device(prompts, device, dtype).items() if k not in NOT_MODEL_INPUTS}
        generated = model.generate(
            **prompts,
            max_new_tokens=settings["max_new_tokens"],
            do_sample=False,
            eos_token_id=builder.end_of_turn,
            pad_token_id=pad_id,
        )
        texts = tokenizer.batch_decode(generated[:, prompts["input_ids"].shape[1] :], skip_special_tokens=True)
        answered.append(
            (start, [_prediction(record, text, data) for record, text in zip(records, texts)], loss.item(), tokens)
        )

    if group.size > 1:
        answered = [batch for part in distributed.gathered(answered) for batch in part]
        if not group.is_main:
            return {}
    # In the split's order, the loss summed as one process sums it: the same figures however many ran.
    answered.sort(key=lambda batch: batch[0])
    predictions = [p for _, batch, _, _ in answered for p in batch]
    loss_sum, loss_tokens = 0.0, 0
    for _, _, loss, tokens in answered:
        loss_sum, loss_tokens = loss_sum + loss, loss_tokens + tokens

    # A click record with a point and no box has no right or wrong (None): the distance judges it.
    judged = [p for p in predictions if p["correct"] is not None]
    by_category = defaultdict(list)
    for p in judged:
        by_category[p["category"] or "all"].append(p["correct"])
    wall = time.time() - started
    metrics = {
        "n": len(predictions),
        "accuracy": sum(p["correct"] for p in judged) / max(len(judged), 1),
        "accuracy_by_category": {c: sum(v) / len(v) for c, v in sorted(by_category.items())},
        "loss": loss_sum / max(loss_tokens, 1),
        "wall_time_s": wall,
        "samples_per_s": len(predictions) / wall,
        "answer_format": settings["answer_format"],
        "dataset": settings.get("dataset"),  # the base model's results are set beside a stage's by it
    }
    if settings["answer_format"] == "click":
        distances = [p["distance"] for p in predictions if p["distance"] is not None]
        metrics |= {
            "n_with_box": len(judged),
            "unparseable": sum(not p["parsed"] for p in predictions),
            # Over the answers that give a point; over the image's diagonal, in original pixels.
            "mean_distance": sum(distances) / len(distances) if distances else None,
        }
    write_jsonl(predictions_out, predictions)
    write_json(metrics_out, metrics)
    return metrics


def _prediction(record: dict, text: str, data: StageData) -> dict:
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
    where = record["key"].split("#")[0]
    prediction["reference"] = clicks.target_text(record, frame, where)
    return prediction | {"box": record.get("box")} | clicks.score(record, text, frame, where)
