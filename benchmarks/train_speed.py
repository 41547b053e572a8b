"""Training speed, ours against the tuned Hugging Face recipe, on one GPU, same workload, same model.

    python benchmarks/train_speed.py --arch qwen3-vl-8b --work /tmp/bench --out benchmarks/results

The workload: JPEG images of realistic size variety (720x576 up to 1920x1080; max_pixels makes the
largest about 1,300 image tokens) with chain-of-thought answers of 20 to 400 tokens. The model: a
Qwen3-VL architecture from benchmarks/configs/ with random weights (nothing is downloaded), LoRA
r=16 on every linear layer of the language model, bf16.

(a) reference: transformers Trainer, the image processor applied per batch to the JPEG files in the
    collator, micro-batch 4 x gradient accumulation 4, no gradient checkpointing, SDPA, TF32, fused
    AdamW, 4 data-loader workers, pinned memory, prefetch 2.
(b) ours: vlft.training.train.train_stage, the project's own training path, from its caches (pixel cache, and
    the frozen-vision cache built by the cache_vision job's code), micro-batches cut to a token budget,
    fused linear cross-entropy on answer tokens, compiled decoder layers; 16 samples a step as (a),
    packed into rows with per-sample positions and attention (--grouped also runs padded
    micro-batches of similar length, packing off).

Prints a table and writes benchmarks/results/<arch>-<device>-<date>.json. The formula for model
FLOPs utilization is in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

from vlft.demo.tiny_model import make_tokenizer
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.forward.linear_attention import LINEAR_ATTENTION_PROJECTIONS
from vlft.modeling import lora_config
from vlft.config import stage_defaults
from vlft.errors import ConfigError
from vlft.data.prompts import PromptBuilder
from vlft.data.records import prepare_split

SIZES = [(720, 576), (1024, 768), (1280, 720), (1280, 1024), (1600, 900), (1920, 1080)]
MAX_PIXELS = 1036 * 1288  # the largest image ends near 1,300 image tokens
MIN_PIXELS = 3136
SAMPLES_PER_STEP = 16  # micro-batch 4 x accumulation 4 in the reference
# LoRA r=16 on every linear layer of the language model: attention's, the MLP's and, on a hybrid
# model, its Gated DeltaNet layers' (names a model lacks match nothing).
LORA_EVERY_LINEAR = dict(
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    lora_target_modules=[*stage_defaults()["lora_target_modules"], *LINEAR_ATTENTION_PROJECTIONS],
)
WORDS = "the red blue green circle square triangle left right top bottom count one two three is of and".split()


# ---------------------------------------------------------------- workload


def make_workload(
    root: Path, n: int, tokenizer, seed: int = 0, questions_per_image: int = 1, short_answers: bool = False
) -> Path:
    """n raw records on JPEGs of mixed sizes and textured content, `questions_per_image` records
    (different questions) on each image, as Kvasir-VQA asks about 9; answers of 20-400 tokens (a
    chain of thought) or, with `short_answers`, of 1-16 tokens (Kvasir's own answers)."""
    rng = np.random.default_rng(seed)
    words = random.Random(seed)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image = i // questions_per_image
        width, height = SIZES[image % len(SIZES)]
        if i % questions_per_image == 0:
            # Smooth noise, so the JPEGs are of realistic size rather than flat or incompressible.
            small = rng.integers(0, 255, (height // 16, width // 16, 3), dtype=np.uint8)
            Image.fromarray(small).resize((width, height), Image.BILINEAR).save(images / f"{image}.jpg", quality=90)
        target = int(rng.integers(1, 17) if short_answers else rng.integers(20, 401))
        text = []
        while len(tokenizer(" ".join(text), add_special_tokens=False)["input_ids"]) < target - 6:
            text.append(words.choice(WORDS))
        question = "Describe the image step by step."
        if questions_per_image > 1:
            question = f"Question {i % questions_per_image}: is there a " + " ".join(words.choices(WORDS, k=8)) + "?"
        rows.append(
            {
                "id": str(i),
                "image": f"{image}.jpg",
                "question": question,
                "answer": " ".join(text) + ". Final answer: three",
            }
        )
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return raw


def build_model(arch: str, tokenizer, device):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**json.loads((REPO / f"benchmarks/configs/{arch}.json").read_text()))
    ids = tokenizer.convert_tokens_to_ids
    config.image_token_id, config.video_token_id = ids("<|image_pad|>"), ids("<|video_pad|>")
    config.vision_start_token_id, config.vision_end_token_id = ids("<|vision_start|>"), ids("<|vision_end|>")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model


def commit_of(given: str | None) -> str:
    """The commit the code is at: `given` where the checkout has no git history, else git's."""
    return (
        given
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )


def image_processor_for(model):
    """The image processor a checkpoint of `model` ships with, at the workload's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = model.config.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )


def parameter_counts(model) -> tuple[int, int]:
    language = sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}" and "lora_" not in n)
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    return language, vision


def matmul_peak_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


# ---------------------------------------------------------------- (a) reference


class ReferenceDataset(torch.utils.data.Dataset):
    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


class ReferenceCollator:
    """What the researchers' script did: decode the JPEGs and run the processor per batch."""

    def __init__(self, image_processor, builder: PromptBuilder, pad_id: int):
        self.image_processor, self.builder, self.pad_id = image_processor, builder, pad_id

    def __call__(self, records):
        images = [Image.open(r["image_file"]).convert("RGB") for r in records]
        vision = self.image_processor(
            images=images, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, return_tensors="pt"
        )
        merge = self.image_processor.merge_size**2
        samples = [
            self.builder.sample(r["id"], r, r["answer"], int(g.prod()) // merge, 8192)
            for r, g in zip(records, vision["image_grid_thw"])
        ]
        width = max(len(s.input_ids) for s in samples)
        input_ids = torch.full((len(samples), width), self.pad_id)
        labels = torch.full((len(samples), width), -100)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            input_ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
            labels[row, : len(s.labels)] = torch.tensor(s.labels)
            attention[row, : len(s.input_ids)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention,
            "labels": labels,
            "mm_token_type_ids": self.builder.mm_token_type_ids(input_ids),
            "pixel_values": vision["pixel_values"],
            "image_grid_thw": vision["image_grid_thw"],
            "n_tokens": attention.sum(),
        }


def run_reference(model, records, image_processor, builder, pad_id, steps, warmup, work: Path) -> dict:
    from peft import get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = get_peft_model(model, lora_config(dict(stage_defaults(), **LORA_EVERY_LINEAR)))
    timings = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            timings.append(time.perf_counter() - self.start)

    class CountingTrainer(Trainer):
        tokens = []

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            self.tokens.append(int(inputs.pop("n_tokens")))
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)

    args = TrainingArguments(
        output_dir=str(work / "reference"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        max_steps=steps,
        learning_rate=1e-4,
        bf16=True,
        tf32=True,
        optim="adamw_torch_fused",
        gradient_checkpointing=False,
        dataloader_num_workers=4,
        dataloader_pin_memory=True,
        dataloader_prefetch_factor=2,
        remove_unused_columns=False,
        save_strategy="no",
        report_to=[],
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
    )
    trainer = CountingTrainer(
        model=model,
        args=args,
        train_dataset=ReferenceDataset(records),
        data_collator=ReferenceCollator(image_processor, builder, pad_id),
        callbacks=[StepTimer()],
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    measured = timings[warmup:]
    tokens_per_step = [sum(trainer.tokens[i * 4 : i * 4 + 4]) for i in range(len(timings))][warmup:]
    stats = {"step_s": measured, "tokens": tokens_per_step, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    return stats, model.unload()  # the base model again, without LoRA layers


# ---------------------------------------------------------------- (b) ours


def run_ours(
    model_dir: Path,
    prepared: Path,
    cache: Path,
    steps: int,
    warmup: int,
    settings: dict,
    work: Path,
    profile: bool = False,
) -> dict:
    from vlft.training.train import StageInputs, train_stage

    torch.cuda.reset_peak_memory_stats()
    out = work / "ours"
    inputs = StageInputs(str(model_dir), [str(prepared)], [str(cache)], None)
    settings = dict(settings)
    checkpointing = settings.pop("activation_checkpointing", False)  # how the job runs, not a setting
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else nullcontext()
    ) as prof:
        train_stage(
            inputs,
            settings,
            out / "adapter",
            out / "log.jsonl",
            out / "summary.json",
            out / "ckpt",
            10**6,
            activation_checkpointing=checkpointing,
        )
    if profile:
        print_kernel_time(prof, work)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()][warmup:]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "step_s": [row["samples"] / row["samples_per_s"] for row in log],
        "samples": [row["samples"] for row in log],
        "tokens": [row["tokens_per_s"] * row["samples"] / row["samples_per_s"] for row in log],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": [row["loss"] for row in log],
        "auto": summary.get("max_batch_tokens_auto"),
        "summary": summary,
        "log": log,
    }


def our_settings(steps: int) -> dict:
    """The stage settings of our runs: LoRA r=16, 16 samples a step in the given order, the fast
    path on (vision cache, compiled layers); the token budget and packing are set per run."""
    settings = {k: v for k, v in stage_defaults().items() if k not in ("resources", "checkpoint_every")}
    settings.update(
        answer_format="cot",
        **LORA_EVERY_LINEAR,
        learning_rate=1e-4,
        micro_batch=SAMPLES_PER_STEP,
        grad_accum=1,
        max_steps=steps,
        max_seq_len=8192,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        vision_cache=True,
        compile=True,
        order="given",
    )
    return settings


KERNEL_KINDS = [
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("attention", ("flash", "fmha", "attention")),
    ("fused by torch.compile", ("triton_",)),
    ("liger / loss", ("liger", "_kernel")),
]


def print_kernel_time(prof, work: Path) -> None:
    """GPU time per kind of kernel over the whole run (warm-up included), and the 25 costliest kernels."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    by_kind = {}
    for e in events:
        kind = next((k for k, marks in KERNEL_KINDS if any(m in e.key.lower() for m in marks)), "other")
        by_kind[kind] = by_kind.get(kind, 0) + e.self_device_time_total
    print(
        f"GPU kernel time {total / 1e6:.1f} s: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / total:6.1%} {e.count:7d}x  {e.key[:110]}")
    (work / "kernels.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=80))


def build_caches(work: Path, image_processor, model, device: str = "cuda") -> tuple[float, float]:
    """The pixel cache of work/prepared.jsonl (work/pixels) and its vision cache (work/vision), as
    the cache_images and cache_vision jobs make them; the seconds each took."""
    from vlft.caches.vision_cache import build_vision_cache

    started = time.time()
    build_image_cache(
        work / "prepared.jsonl",
        work / "images",
        work / "pixels",
        PixelSettings.from_processor(image_processor, MIN_PIXELS, MAX_PIXELS),
        threads=16,
    )
    pixel_cache_s = time.time() - started
    started = time.time()
    build_vision_cache(work / "pixels", model, work / "vision", max_gb=1000, device=torch.device(device))
    return pixel_cache_s, time.time() - started


# ---------------------------------------------------------------- main


def summarize(run: dict, flops_per_token: float, peak_tflops: float) -> dict:
    seconds, tokens = sum(run["step_s"]), sum(run["tokens"])
    samples = sum(run["samples"]) if "samples" in run else SAMPLES_PER_STEP * len(run["step_s"])
    return {
        "samples_per_s": samples / seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops_per_token * tokens / seconds / (peak_tflops * 1e12),
        "peak_gib": run["peak_gib"],
        "steps_measured": len(run["step_s"]),
        **({"losses": run["losses"]} if "losses" in run else {}),
        **({"auto": run["auto"]} if run.get("auto") else {}),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, help="a config in benchmarks/configs/, e.g. qwen3-vl-8b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-bench"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--max-batch-tokens",
        type=lambda v: v if v == "auto" else int(v),
        nargs="+",
        default=[8192],
        help="token budgets of our micro-batches (a number, or auto): one run of ours for each",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction), as a smaller card has",
    )
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="also run ours on a 4-bit base (quantization_bit: 4) with activation_checkpointing",
    )
    parser.add_argument(
        "--qlora-memory-gib",
        type=float,
        help="cap this process's GPU memory at this before the 4-bit runs (after the bf16 ones, uncapped)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="where the model is saved as a checkpoint (default: under --work); e.g. /dev/shm for a model "
        "larger than the disk",
    )
    parser.add_argument(
        "--reuse-checkpoint",
        action="store_true",
        help="train from the checkpoint and caches an earlier run saved (with --skip reference), not a new model",
    )
    parser.add_argument("--no-plain", action="store_true", help="leave out the runs of ours with neither option")
    parser.add_argument(
        "--grouped",
        action="store_true",
        help="also run ours with packing off (padded micro-batches of similar length), for comparison",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record our runs' GPU kernels and print where the time goes (slows them down)",
    )
    parser.add_argument("--commit", help="the commit the code is at, where the checkout has no git history")
    parser.add_argument("--skip", choices=["reference", "ours"], help="run one side only")
    parser.add_argument(
        "--questions-per-image", type=int, default=1, help="records on each image (Kvasir-VQA: about 9)"
    )
    parser.add_argument("--short-answers", action="store_true", help="answers of 1-16 tokens instead of 20-400")
    parser.add_argument(
        "--image-groups",
        action="store_true",
        help="also run ours with image_groups (each image's questions in one step, the image computed once)",
    )
    parser.add_argument(
        "--trained-tower",
        action="store_true",
        help="also run ours from pixels, the tower frozen and then trained (vision_lora and train_merger)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="also run ours with activation_checkpointing (each layer recomputed in the backward pass)",
    )
    return parser.parse_args()


def workload_records(args, work: Path, tokenizer) -> list[dict]:
    """The benchmark's records, prepared as a stage reads them, each naming its image file too (the
    reference decodes the image files themselves)."""
    from vlft.files import read_jsonl

    raw = make_workload(
        work, args.images * args.questions_per_image, tokenizer, 0, args.questions_per_image, args.short_answers
    )
    prepare_split(raw, work / "images", work / "prepared.jsonl")
    return [dict(r, image_file=str(work / "images" / r["image"])) for r in read_jsonl(work / "prepared.jsonl")]


def our_runs(args) -> list[tuple[str, int | str, dict]]:
    """Each of our runs: its name, token budget and the stage options it sets."""
    budgets = args.max_batch_tokens
    runs = [] if args.no_plain else [(f"ours@{b}", b, dict(packing=True)) for b in budgets]
    if args.grouped:
        runs += [(f"ours grouped@{b}", b, dict(packing=False)) for b in budgets]
    if args.image_groups:
        runs += [(f"ours images@{b}", b, dict(image_groups=True)) for b in budgets]
    if args.activation_checkpointing:
        runs += [(f"ours recompute@{b}", b, dict(packing=True, activation_checkpointing=True)) for b in budgets]
    if args.trained_tower:  # from pixels, frozen and trained: the tower's backward is the difference
        runs += [(f"ours pixels@{b}", b, dict(vision_cache=False)) for b in budgets]
        tower = dict(vision_cache=False, vision_lora=True, train_merger=True)
        runs += [(f"ours trained tower@{b}", b, tower) for b in budgets]
    if args.qlora:
        runs += [
            (f"ours 4-bit recompute@{b}", b, dict(quantization_bit=4, activation_checkpointing=True)) for b in budgets
        ]
    return runs


def save_as_checkpoint(work: Path, model, tokenizer, image_processor, model_dir: Path) -> tuple[Path, dict]:
    """The model saved where a job reads a checkpoint, and its caches built: the cache seconds."""
    import shutil

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(model_dir.parent if model_dir.parent.exists() else work).free
    if weights > free:
        sys.exit(f"{model_dir.parent} has {free / 1e9:.1f} GB free, less than the weights' {weights / 1e9:.1f} GB")
    model.save_pretrained(model_dir, max_shard_size="4GB")
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    pixel_cache_s, vision_cache_s = build_caches(work, image_processor, model)
    return model_dir, {"pixel_cache_s": pixel_cache_s, "vision_cache_s": vision_cache_s}


def measure_ours(args, work: Path, model_dir: Path, cache_seconds: dict, flops_per_token: float, peak: float) -> dict:
    """Our runs on the saved checkpoint and its caches, as a job reads them."""
    import gc

    settings, results = our_settings(args.steps), {}
    for name, budget, options in our_runs(args):
        if options.get("quantization_bit") and args.qlora_memory_gib:  # a smaller card's budget from here on
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(args.qlora_memory_gib * 2**30 / total)
        try:
            ours = run_ours(
                model_dir,
                work / "prepared.jsonl",
                work / ("vision" if options.get("vision_cache", True) else "pixels"),
                args.steps,
                args.warmup,
                dict(settings, max_batch_tokens=budget, **options),
                work / name.replace(" ", "-"),
                args.profile,
            )
            results[name] = summarize(ours, flops_per_token, peak) | cache_seconds
            if options.get("image_groups"):
                # Its tokens/s counts each question's whole prompt, the shared image in it too,
                # though the image is computed once: no utilization can be read from it.
                results[name]["mfu"] = float("nan")
        except torch.OutOfMemoryError as error:
            results[name] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
        except Exception as error:  # one run's failure is a result; the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        except ConfigError as error:  # auto found no budget that fits
            results[name] = {"error": str(error)}
        torch._dynamo.reset()  # drop this run's compiled graphs with its model
        gc.collect()
        torch.cuda.empty_cache()
    return results


def report_of(args, results: dict, peak: float, language_params: int, vision_params: int) -> dict:
    """The result file: the runs, what they ran on, and ours against the reference."""
    report = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": commit_of(args.commit) or "unknown",
        "command": " ".join(sys.argv),
        "images": args.images,
        "questions_per_image": args.questions_per_image,
        "answers": "1-16 tokens" if args.short_answers else "20-400 tokens",
        "matmul_peak_tflops": peak,
        "language_params": language_params,
        "vision_params": vision_params,
        "liger_kernel": _installed("liger_kernel"),
        "flash_attn": _installed("flash_attn"),
        "torch": torch.__version__,
        "memory_cap_gib": args.memory_gib,
        "qlora_memory_cap_gib": args.qlora_memory_gib,
        **results,
    }
    if "reference" in results:
        report["ratio"] = {
            name: {k: r[k] / results["reference"][k] for k in ("samples_per_s", "tokens_per_s", "mfu", "peak_gib")}
            for name, r in results.items()
            if name != "reference" and "error" not in r
        }
    if args.image_groups:
        report["image_groups_speedup"] = {
            budget: results[f"ours images@{budget}"]["samples_per_s"] / results[f"ours@{budget}"]["samples_per_s"]
            for budget in args.max_batch_tokens
            if "error" not in results.get(f"ours images@{budget}", {"error": 1})
            and "error" not in results.get(f"ours@{budget}", {"error": 1})
        }
    return report


def print_table(report: dict, results: dict, peak: float) -> None:
    print(f"\n{report['arch']} on {report['device']}: bf16 matmul peak {peak:.0f} TFLOP/s")
    print(f"{'':22} {'samples/s':>10} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'ratio':>6}")
    for side, r in results.items():
        if "error" in r:
            print(f"{side:22} {r['error'][:60]}")
            continue
        ratio = report.get("ratio", {}).get(side, {}).get("samples_per_s", float("nan"))
        print(
            f"{side:22} {r['samples_per_s']:10.2f} {r['tokens_per_s']:10.0f} {r['mfu']:6.3f} {r['peak_gib']:9.1f} {ratio:6.2f}"
        )
    for budget, speedup in report.get("image_groups_speedup", {}).items():
        print(f"image groups at {budget} tokens: {speedup:.2f}x the samples/s without them")


def main():
    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.memory_gib:
        torch.cuda.set_per_process_memory_fraction(
            args.memory_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory
        )
    work = args.work / args.arch
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    records = workload_records(args, work, tokenizer)
    peak = matmul_peak_tflops()
    model_dir = args.checkpoint_dir or work / "model"
    reused = args.reuse_checkpoint and (model_dir / "config.json").exists()
    # A checkpoint saved before: its shapes alone, on no device, for the counts and the processor.
    model = build_model(args.arch, tokenizer, "meta" if reused else "cuda")
    language_params, vision_params = parameter_counts(model)
    flops_per_token = 4 * language_params  # LoRA on a frozen base: forward + input gradients; see README
    image_processor = image_processor_for(model)
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    results = {}
    if args.skip != "reference":
        ref, model = run_reference(
            model, records, image_processor, builder, tokenizer.pad_token_id, args.steps, args.warmup, work
        )
        results["reference"] = summarize(ref, flops_per_token, peak)
        torch.cuda.empty_cache()
    if args.skip != "ours" and reused:
        del model
        results |= measure_ours(args, work, model_dir, {}, flops_per_token, peak)
    elif args.skip != "ours":
        model_dir, cache_seconds = save_as_checkpoint(work, model, tokenizer, image_processor, model_dir)
        del model  # our runs load the checkpoint, as a job does: none of the benchmark's own on the GPU
        torch.cuda.empty_cache()
        results |= measure_ours(args, work, model_dir, cache_seconds, flops_per_token, peak)
    report = report_of(args, results, peak, language_params, vision_params)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.arch}-{report['device'].replace(' ', '_')}-{datetime.datetime.now():%Y-%m-%d-%H%M}.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    print_table(report, results, peak)
    print(json.dumps(report))


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
