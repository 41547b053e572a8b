"""Evaluation speed, ours against transformers' `generate`, on one GPU, same workload, same model.

    python benchmarks/eval_speed.py --arch qwen3-vl-8b qwen3-vl-2b --work /tmp/bench --out benchmarks/results

The workload is the training benchmark's (benchmarks/train_speed.py): JPEGs of 720x576 to 1920x1080
(about 1,300 image tokens at the largest) and answers of 20 to 400 tokens; each sample's answer
stops after its own length on both sides (as if the model had ended it there), so that a batching
strategy is judged on the lengths of a chain-of-thought study. Random-weight Qwen3-VL models, bf16.

(a) reference: `model.generate`, the image processor applied per batch to the JPEG files,
    left-padded batches of 32, greedy, as a researcher's evaluation script does;
(b) ours: vlft.generation.evaluate.evaluate_split, the code the `evaluate` rule runs, from the pixel cache.

Reports generated tokens/s, samples/s, seconds per decode step beside the bandwidth bound (the
language model's weights and the batch's KV cache read once a step, over a copy bandwidth measured
in the same run), prefill time, peak memory, ours/reference and the share of identical answers.
Writes benchmarks/results/eval-<archs>-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

from train_speed import MAX_PIXELS, MIN_PIXELS, build_model, commit_of, image_processor_for, make_workload
import vlft
from vlft.demo.tiny_model import make_tokenizer
from vlft.files import read_jsonl
from vlft.generation.kv_cache import SlotCache
from vlft.modeling import language_model
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.data.prompts import PromptBuilder
from vlft.data.records import prepare_split

REFERENCE_BATCH = 32


def copy_bandwidth() -> float:
    """Bytes a second the GPU reads plus writes in a large device-to-device copy."""
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(20):
        target.copy_(source)
    torch.cuda.synchronize()
    return 2 * source.numel() * 20 / (time.perf_counter() - began)


class StopEach:
    """A stopping criterion for `generate`: row i is done after its own number of new tokens."""

    def __init__(self, prompt_width: int, lengths: list[int]):
        self.prompt_width, self.lengths = prompt_width, torch.tensor(lengths, device="cuda")

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_width) >= self.lengths


class StepClock:
    """A logits processor that only reads the clock: its first call ends the prefill, each later
    call ends a decode step (generate synchronizes every step for its stopping checks anyway)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def run_reference(model, records, image_processor, builder, pad_id, lengths) -> dict:
    from transformers import LogitsProcessorList, StoppingCriteriaList

    answers, prefill_s, decode_s, steps, busy_rows, prompt_tokens = {}, 0.0, 0.0, 0, 0, {}
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for start in range(0, len(records), REFERENCE_BATCH):
        batch = records[start : start + REFERENCE_BATCH]
        images = [Image.open(r["image_file"]).convert("RGB") for r in batch]
        vision = image_processor(
            images=images, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, return_tensors="pt"
        )
        merge = image_processor.merge_size**2
        prompts = [builder.prompt_ids(r, int(g.prod()) // merge) for r, g in zip(batch, vision["image_grid_thw"])]
        prompt_tokens.update({r["id"]: len(ids) for r, ids in zip(batch, prompts)})
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(batch), width), pad_id)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        limits = [lengths[r["id"]] for r in batch]
        clock = StepClock()
        batch_began = time.perf_counter()
        generated = model.generate(
            input_ids=input_ids.cuda(),
            attention_mask=attention.cuda(),
            mm_token_type_ids=builder.mm_token_type_ids(input_ids).cuda(),
            pixel_values=vision["pixel_values"].cuda().to(torch.bfloat16),
            image_grid_thw=vision["image_grid_thw"].cuda(),
            max_new_tokens=max(limits),
            do_sample=False,
            eos_token_id=builder.end_of_turn,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
            stopping_criteria=StoppingCriteriaList([StopEach(width, limits)]),
        )
        prefill_s += clock.times[0] - batch_began
        decode_s += clock.times[-1] - clock.times[0]
        steps += len(clock.times) - 1
        for step in range(1, len(clock.times)):
            busy_rows += sum(limit > step for limit in limits)
        for row, r in enumerate(batch):
            ids = generated[row, width : width + limits[row]].tolist()
            if builder.end_of_turn in ids:
                ids = ids[: ids.index(builder.end_of_turn) + 1]
            answers[r["id"]] = ids
    torch.cuda.synchronize()
    return {
        "wall_s": time.perf_counter() - began,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_steps": steps,
        "busy_rows": busy_rows,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "answers": answers,
        "prompt_tokens": prompt_tokens,
    }


def run_ours(
    work: Path,
    model_dir: Path,
    lengths: dict,
    batch_size: int,
    max_new_tokens: int | None,
    share_images: bool = True,
    label: str = "",
) -> dict:
    from vlft.generation.evaluate import evaluate_split

    settings = {
        "dataset": "bench",
        "answer_format": "cot",
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "max_seq_len": 8192,
        "max_new_tokens": max_new_tokens or max(lengths.values()),
        "batch_size": batch_size,
    }
    stats = {}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out = work / f"ours-{batch_size}-{share_images}{label}"
    metrics = evaluate_split(
        str(model_dir),
        None,
        str(work / "prepared.jsonl"),
        str(work / "pixels"),
        settings,
        out / "predictions.jsonl",
        out / "metrics.json",
        answer_lengths=lengths,
        stats=stats,
        # Only where asked: code from before image sharing has no such argument.
        **({} if share_images else {"share_images": False}),
    )
    # Its compiled step and CUDA graphs hold the job's model and cache: dropped before the next run.
    import gc

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    # The answers' ids again from their text would not be exact: evaluate_split records them as text.
    answers = stats.pop("answer_ids")
    stats["decode_s"] = stats["step_s"] + stats["bookkeeping_s"]
    peak = torch.cuda.max_memory_allocated() / 2**30  # the job's
    # Generation, as the reference is timed: from the first prompt read off the pixel cache to the
    # last answer (the job also loads the model). Ours' prefills also score the reference answers
    # (the validation loss, in the same forward): counted against ours, the reference computes none.
    # The decode step's compile and capture are paid once a job; a split of thousands of samples
    # (Kvasir's 8,786) hides them, this workload's 128 do not: both figures are reported.
    return {
        "wall_s": stats["generate_s"] - stats["compile_s"],
        "job_s": metrics["wall_time_s"],
        "peak_gib": peak,
        "answers": answers,
        **stats,
    }


def step_weight_bytes(model) -> int:
    """The weights a decode step reads: the language model's and its head's."""
    return sum(p.nbytes for p in language_model(model).parameters()) + model.lm_head.weight.nbytes


PHASES = ("setup_s", "read_s", "prefill_s", "schedule_s", "step_s", "bookkeeping_s", "answers_s")


def run_without_shared_prefixes(work: Path, model_dir: Path, lengths: dict, batch_size: int, max_new_tokens) -> dict:
    """Ours with each row reading its own copy of its image's prefix (no cascade decoding)."""
    import vlft.generation.evaluate as evaluate

    kept, evaluate.shared_prefixes = evaluate.shared_prefixes, lambda *_: None
    try:
        return run_ours(work, model_dir, lengths, batch_size, max_new_tokens, True, "plain")
    finally:
        evaluate.shared_prefixes = kept


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(run: dict, lengths: dict, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float, prompts) -> dict:
    tokens = sum(len(ids) for ids in run["answers"].values())
    steps = run["decode_steps"]
    mean_rows = run["busy_rows"] / max(steps, 1)
    # The bound at the batch it runs: weights once, plus each busy row's prompt and half its answer.
    context = sum(prompts.values()) / len(prompts) + sum(lengths.values()) / len(lengths) / 2
    bound = (weight_bytes + mean_rows * context * kv_bytes_per_token) / bandwidth
    step_s = run["decode_s"] / max(steps, 1)
    return {
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / run["wall_s"],
        "samples_per_s": len(lengths) / run["wall_s"],
        "decode_step_s": step_s,
        "bound_step_s": bound,
        "step_over_bound": step_s / bound,
        "mean_busy_rows": mean_rows,
        "prefill_s": run["prefill_s"],
        "decode_s": run["decode_s"],
        # Ours: where generation's time goes (reading prompts off the cache, prefills, choosing a
        # step's rows, steps, the bookkeeping after each, handing answers over), the cache's length.
        **{k: run[k] for k in ("max_length", "prefills", "prefill_tokens", "load_s", "job_s", *PHASES) if k in run},
        "wall_s": run["wall_s"],
        "compile_s": run.get("compile_s", 0.0),
        "generated_tokens_per_s_with_compile": tokens / (run["wall_s"] + run.get("compile_s", 0.0)),
        "peak_gib": run["peak_gib"],
    }


def bench_arch(arch: str, args, tokenizer, bandwidth: float) -> dict:
    work = args.work / arch
    work.mkdir(parents=True, exist_ok=True)
    raw = make_workload(work, args.samples, tokenizer, 0, args.questions_per_image, args.short_answers)
    prepare_split(raw, work / "images", work / "prepared.jsonl")
    records = read_jsonl(work / "prepared.jsonl")
    # The reference decodes the image files themselves.
    records = [dict(r, image_file=str(work / "images" / r["image"])) for r in records]
    builder = PromptBuilder(tokenizer, tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    # Each answer's own length: its tokens and the end of the turn.
    lengths = {r["id"]: len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) + 1 for r in records}

    model = build_model(arch, tokenizer, "cuda").eval()
    weight_bytes, kv_bytes_per_token = step_weight_bytes(model), SlotCache.bytes_per_token(model)
    image_processor = image_processor_for(model)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    build_image_cache(
        work / "prepared.jsonl",
        work / "images",
        work / "pixels",
        PixelSettings.from_processor(image_processor, MIN_PIXELS, MAX_PIXELS),
        threads=16,
    )

    result = {"arch": arch, "samples": len(records), "answer_tokens": sum(lengths.values())}
    # `generate` on the first --reference-samples only, where the split is long (its rate is per token).
    checked = records[: args.reference_samples or len(records)]
    checked_lengths = {r["id"]: lengths[r["id"]] for r in checked}
    with torch.no_grad():
        reference = run_reference(model, checked, image_processor, builder, tokenizer.pad_token_id, checked_lengths)
    prompts = reference["prompt_tokens"]
    del model
    torch.cuda.empty_cache()
    ours_runs = {}
    for batch_size in args.batch_sizes:
        runs = [
            (f"ours@{batch_size}" + ("" if share else " unshared"), share)
            for share in (True, False)[: 1 + args.unshared]
        ]
        if args.without_shared_prefixes:  # the same job, each row reading its own copy of its image's prefix
            plain = (f"ours@{batch_size} without shared prefixes", True)
            # Which run meets the machine's compile caches cold: the first.
            runs = [plain] + runs if args.without_first else runs + [plain]
        for name, share in runs:
            ours_runs[name] = (
                run_without_shared_prefixes(work, model_dir, lengths, batch_size, args.max_new_tokens)
                if name.endswith("without shared prefixes")
                else run_ours(work, model_dir, lengths, batch_size, args.max_new_tokens, share)
            )
    result["reference"] = summarize(reference, checked_lengths, weight_bytes, kv_bytes_per_token, bandwidth, prompts)
    for name, run in ours_runs.items():
        summary = summarize(run, lengths, weight_bytes, kv_bytes_per_token, bandwidth, prompts)
        summary["over_reference"] = summary["generated_tokens_per_s"] / result["reference"]["generated_tokens_per_s"]
        same = sum(ids == run["answers"][i] for i, ids in reference["answers"].items())
        summary["identical_answers"] = same / len(checked)
        # Where answers part: random weights make near-ties common, and one flip changes the rest.
        parted = [first_difference(ids, run["answers"][i]) for i, ids in reference["answers"].items()]
        summary["same_first_token"] = sum(p > 0 for p in parted) / len(parted)
        summary["mean_tokens_before_parting"] = sum(parted) / len(parted)
        # The whole job's rate, its one-time compile apart (a job pays it once, whatever its size).
        summary["job_samples_per_s"] = len(records) / (run["job_s"] - run.get("compile_s", 0.0))
        result[name] = summary
    for name in [n for n in ours_runs if n.endswith(" without shared prefixes")]:
        shared_name = name.removesuffix(" without shared prefixes")
        mine, plain = ours_runs[shared_name]["answers"], ours_runs[name]["answers"]
        parted = [first_difference(plain[i], mine[i]) for i in plain]
        result[f"{shared_name} shared prefixes"] = {
            "job": result[shared_name]["job_samples_per_s"] / result[name]["job_samples_per_s"],
            "decode_step": result[name]["decode_step_s"] / result[shared_name]["decode_step_s"],
            "identical_answers": sum(plain[i] == mine[i] for i in plain) / len(plain),
            "mean_tokens_before_parting": sum(parted) / len(parted),
        }
    for name in list(ours_runs):
        if name.endswith(" unshared"):
            shared = result[name.removesuffix(" unshared")]
            result[f"{name.removesuffix(' unshared')} sharing speedup"] = {
                "job": shared["job_samples_per_s"] / result[name]["job_samples_per_s"],
                "answers_identical": ours_runs[name]["answers"] == ours_runs[name.removesuffix(" unshared")]["answers"],
            }
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["qwen3-vl-8b", "qwen3-vl-2b"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-eval-bench"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128], help="ours' concurrent sequences")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="ours' evaluation setting: the room its cache keeps for an answer (default: the longest answer;"
        " Kvasir's config has 512); each sample still stops at its own length",
    )
    parser.add_argument("--commit", help="the commit the code is at, where the checkout has no git history")
    parser.add_argument("--questions-per-image", type=int, default=1, help="records on each image (Kvasir: about 9)")
    parser.add_argument("--short-answers", action="store_true", help="answers of 1-16 tokens instead of 20-400")
    parser.add_argument(
        "--unshared", action="store_true", help="also run ours computing every question's image anew, side by side"
    )
    parser.add_argument("--reference-samples", type=int, help="run `generate` on the first N samples only")
    parser.add_argument(
        "--without-shared-prefixes",
        action="store_true",
        help="also run ours with each row reading its own copy of its image's prefix (no cascade decoding)",
    )
    parser.add_argument("--without-first", action="store_true", help="that run first (it meets the caches cold)")
    parser.add_argument("--label", default="", help="added to the result file's name")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = make_tokenizer()
    bandwidth = copy_bandwidth()
    results = {"bandwidth_gb_s": bandwidth / 1e9, "archs": []}
    for arch in args.arch:
        results["archs"].append(bench_arch(arch, args, tokenizer, bandwidth))
        torch.cuda.empty_cache()

    commit = commit_of(args.commit)
    device = torch.cuda.get_device_name()
    results |= {"device": device, "date": datetime.date.today().isoformat(), "commit": commit}
    args.out.mkdir(parents=True, exist_ok=True)
    # Which vlft ran: the installed package, or an earlier commit's tree on PYTHONPATH (before_after.sh).
    results["code"] = str(Path(vlft.__file__).parent)
    label = f"-{args.label}" if args.label else ""
    name = f"eval-{'_'.join(args.arch)}{label}-{device.replace(' ', '_')}-{results['date']}.json"
    (args.out / name).write_text(json.dumps(results, indent=2))
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {device}, commit {commit}")
    header = f"{'arch':14} {'run':10} {'tok/s':>8} {'smp/s':>7} {'step ms':>8} {'bound ms':>8} {'x bound':>7} {'rows':>6} {'prefill s':>9} {'GiB':>6} {'x ref':>6} {'same':>5}"
    print(header)
    for arch in results["archs"]:
        for run, r in arch.items():
            if run.endswith("sharing speedup"):
                print(f"{arch['arch']:14} {run}: the job {r['job']:.2f}x, answers identical: {r['answers_identical']}")
                continue
            if run.endswith(" shared prefixes") and not run.endswith("without shared prefixes"):
                print(f"{arch['arch']:14} {run}: {json.dumps(r)}")
                continue
            if not isinstance(r, dict):
                continue
            print(
                f"{arch['arch']:14} {run:10} {r['generated_tokens_per_s']:8.0f} {r['samples_per_s']:7.2f} "
                f"{r['decode_step_s'] * 1e3:8.1f} {r['bound_step_s'] * 1e3:8.1f} {r['step_over_bound']:7.1f} "
                f"{r['mean_busy_rows']:6.1f} {r['prefill_s']:9.1f} {r['peak_gib']:6.1f} "
                f"{r.get('over_reference', 1):6.2f} {r.get('identical_answers', 1):5.2f}"
            )
            if "same_first_token" in r:
                print(
                    f"{'':25} with the step's one-time compile and capture ({r['compile_s']:.0f} s): "
                    f"{r['generated_tokens_per_s_with_compile']:.0f} tok/s"
                )
                print(
                    f"{'':25} same first token {r['same_first_token']:.2f}, "
                    f"{r['mean_tokens_before_parting']:.1f} tokens alike before answers part"
                )
                print(
                    f"{'':25} the whole job {r['job_s']:.1f} s, loading {r.get('load_s', r.get('loss_s', 0)):.1f} s (earlier code: with the loss pass);"
                    f" {r['job_samples_per_s']:.2f} samples/s without the compile;"
                    f" prefill tokens {r.get('prefill_tokens', 0):.0f}"
                )
                phases = {k: r[k] for k in PHASES if k in r}
                print(
                    f"{'':25} {r['wall_s']:.2f} s: "
                    + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in phases.items())
                    + f", the rest {r['wall_s'] - sum(phases.values()):.2f}"
                )


if __name__ == "__main__":
    main()
