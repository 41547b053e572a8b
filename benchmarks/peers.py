"""Peers side by side: ms-swift's `swift sft` and LLaMA-Factory's `llamafactory-cli train` on the
training benchmark's workload, and ours, in one run on one GPU.

    bash benchmarks/peer_wheels.sh .whl-peers          # here: download the peers' wheels
    # on the GPU machine: install each peer into a folder of its own, then
    python benchmarks/peers.py --arch qwen3-vl-8b --swift-site /tmp/peer-swift \
        --llamafactory-site /tmp/peer-llamafactory --out benchmarks/results

The workload is train_speed.py's: the same random-weight Qwen3-VL checkpoint (saved with a full
Qwen3-VL processor, as a published one is), the same JPEGs and answers, 16 samples a step
(micro-batch 4 x accumulation 4 where a peer packs no rows), LoRA r=16 (alpha 32, no dropout) on
the language model's linear layers, vision tower and merger frozen, bf16, a constant learning rate
of 1e-4 with no warm-up and no weight decay, the records in the file's order (no shuffling), sequences
up to 8,192 tokens. Each peer runs in a process of its own, with its own pinned
transformers/peft/trl/datasets first on PYTHONPATH, through benchmarks/peer_timer.py, which times
its Trainer's optimizer steps as the training benchmark times its reference and counts the samples
and tokens each step computed from the batches themselves. A setting a peer refuses, or that fails,
is reported with the error's last line; nothing is reported that did not run.

Each run's samples/s is over the same measured steps (the first --warmup steps left out). Packed
rows carry a varying number of samples a step: samples/s counts those the batches held.

`--method dpo` runs each peer's DPO instead (ms-swift's `swift rlhf --rlhf_type dpo`, LLaMA-Factory's
`stage: dpo`) and ours with `method: dpo`, on pairs made from the same workload (benchmarks/dpo_speed.py's
`paired`: two records on each image, the first's answer chosen, the second's rejected; with
--questions-per-image, that many pairs on each image), β 0.1, the
sigmoid loss, no SFT term, 16 pairs a step. A peer lays out a pair as two sequences, so its pairs are
half the `<|vision_start|>` tokens its batches held; its reference (the model with the adapter off)
runs inside its steps. Ours computes its reference once before the first step: its pairs/s is given
over the steps alone and over the steps plus that pass's share (the pass over all pairs, charged
per pair), and the ratio uses the latter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

from dpo_speed import paired
from train_speed import (
    MAX_PIXELS,
    MIN_PIXELS,
    SAMPLES_PER_STEP,
    build_caches,
    build_model,
    commit_of,
    image_processor_for,
    make_workload,
    our_settings,
    run_ours,
)

MAX_LENGTH = 8192
MICRO_BATCH, ACCUMULATION = 4, SAMPLES_PER_STEP // 4
LORA = dict(rank=16, alpha=32)

# Each peer's settings, fastest first, as its documentation gives them for Qwen3-VL LoRA on one GPU:
# ms-swift: docs/source_en/BestPractices/Qwen3-VL-Best-Practice.md ("Dense Models": flash_attn,
#   padding_free, packing, freeze_vit, freeze_aligner) and Command-line-parameters.md (use_liger_kernel);
# LLaMA-Factory: README ("flash_attn: fa2", "neat_packing: true" for contamination-free packing,
#   "enable_liger_kernel: true") and examples/train_lora/qwen3vl_lora_sft.yaml.
# Packed runs put one row of up to MAX_LENGTH tokens in a micro-batch (a row holds several samples).
SWIFT_SETTINGS = {
    "flash_attn, packing": dict(attn_impl="flash_attn", packing="true", padding_free="true", batch=1),
    "sdpa, packing": dict(attn_impl="sdpa", packing="true", padding_free="true", batch=1),
    "sdpa, padding_free": dict(attn_impl="sdpa", packing="false", padding_free="true", batch=MICRO_BATCH),
    "sdpa, padded": dict(attn_impl="sdpa", packing="false", padding_free="false", batch=MICRO_BATCH),
    # Beyond its documentation: twice the micro-batch (half the accumulation), the same 16 samples a step.
    "sdpa, padded, micro-batch 8": dict(attn_impl="sdpa", packing="false", padding_free="false", batch=8, accum=2),
}
# DPO: neither peer packs pairs here (ms-swift's padding_free/packing for dpo needs flash-attn, which
# cannot be installed on the GPU machine; LLaMA-Factory packs for sft only). Pairs a micro-batch:
# LLaMA-Factory's DPO examples give 1 (x accumulation 8); 2 pairs are 4 sequences, as their SFT's 4.
SWIFT_DPO_SETTINGS = {
    "dpo, sdpa, padded, 2 pairs": dict(attn_impl="sdpa", packing="false", padding_free="false", batch=2, accum=8),
    "dpo, sdpa, padded, 1 pair": dict(attn_impl="sdpa", packing="false", padding_free="false", batch=1, accum=16),
}
LLAMAFACTORY_DPO_SETTINGS = {
    "dpo, sdpa, padded, 2 pairs": dict(flash_attn="sdpa", neat_packing=False, batch=2, accum=8),
    "dpo, sdpa, padded, 1 pair": dict(flash_attn="sdpa", neat_packing=False, batch=1, accum=16),
}
DPO_BETA = 0.1
LLAMAFACTORY_SETTINGS = {
    "fa2, neat_packing": dict(flash_attn="fa2", neat_packing=True, batch=1),
    "sdpa, neat_packing": dict(flash_attn="sdpa", neat_packing=True, batch=1),
    "sdpa, padded": dict(flash_attn="sdpa", neat_packing=False, batch=MICRO_BATCH),
    # Beyond its documentation: two packed rows a micro-batch, half the accumulation (4 rows a step as above).
    "sdpa, neat_packing, 2 rows": dict(flash_attn="sdpa", neat_packing=True, batch=2, accum=2),
}


# The ids Qwen's own tokenizer gives its special tokens. ms-swift's Qwen-VL templates write the image
# token by this number (151655) rather than reading it from the checkpoint, so the benchmark's small
# tokenizer takes these numbers for its special tokens; its other tokens, and so the workload, are unchanged.
QWEN_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}


def qwen_numbered_tokenizer():
    """The benchmark's tokenizer with its special tokens at the ids Qwen's tokenizer gives them."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from vlft.demo.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, make_tokenizer

    data = json.loads(make_tokenizer().backend_tokenizer.to_str())
    for added in data["added_tokens"]:
        added["id"] = QWEN_SPECIAL_IDS[added["content"]]
    data["model"]["vocab"].update(QWEN_SPECIAL_IDS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def save_full_processor(model, tokenizer, image_processor, model_dir: Path) -> None:
    """The processor files a published Qwen3-VL has (image and video processors, chat template),
    which the peers (and TRL) load with AutoProcessor."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    vision = model.config.vision_config
    video_processor = Qwen3VLVideoProcessor(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(model_dir)


def save_checkpoint(arch: str, tokenizer, model_dir: Path):
    """The random-weight model as a checkpoint directory with the processor files a published
    Qwen3-VL has, which the peers load."""
    import torch

    model = build_model(arch, tokenizer, "cuda")
    model.save_pretrained(model_dir)
    image_processor = image_processor_for(model)
    save_full_processor(model, tokenizer, image_processor, model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    return image_processor


def write_peer_data(records: list[dict], images: Path, work: Path) -> tuple[Path, Path]:
    """The workload's records in each peer's documented multimodal format: ms-swift's `messages` +
    `images` JSONL (a pair's rejected answer as `rejected_response`), and LLaMA-Factory's
    sharegpt-style file with its dataset_info.json entry (pairs as `chosen`/`rejected`, `ranking: true`)."""
    pairs = "rejected" in records[0]
    swift_rows, lf_rows = [], []
    for record in records:
        user = {"role": "user", "content": "<image>" + record["question"]}
        answer = {"role": "assistant", "content": record["answer"]}
        image = {"images": [str(images / record["image"])]}
        if pairs:
            swift_rows.append({"messages": [user, answer], "rejected_response": record["rejected"], **image})
            rejected = {"role": "assistant", "content": record["rejected"]}
            lf_rows.append({"messages": [user], "chosen": answer, "rejected": rejected, **image})
        else:
            swift_rows.append({"messages": [user, answer], **image})
            lf_rows.append(swift_rows[-1])
    swift = work / "swift.jsonl"
    swift.write_text("".join(json.dumps(r) + "\n" for r in swift_rows))
    lf_dir = work / "llamafactory-data"
    lf_dir.mkdir(exist_ok=True)
    (lf_dir / "bench.json").write_text(json.dumps(lf_rows))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    columns = {"messages": "messages", "images": "images"}
    if pairs:
        columns.update(chosen="chosen", rejected="rejected")
    entry = {"file_name": "bench.json", "formatting": "sharegpt", "columns": columns, "tags": tags}
    (lf_dir / "dataset_info.json").write_text(json.dumps({"bench": dict(entry, ranking=True) if pairs else entry}))
    return swift, lf_dir


def swift_model_and_lora(model_dir: Path, data: Path) -> dict:
    """ms-swift's arguments for the benchmark's checkpoint, data and LoRA (the vision tower and
    aligner frozen), shared by its SFT, DPO (here) and GRPO (grpo_speed.py) runs."""
    return {
        "model": model_dir,
        "model_type": (model_type := json.loads((Path(model_dir) / "config.json").read_text())["model_type"]),
        # ms-swift 4.6 finds two templates for a Qwen3.5 checkpoint it does not know by name; its own
        # model list pairs Qwen3.5 with `qwen3_5`.
        **({"template": "qwen3_5"} if model_type == "qwen3_5" else {}),
        "check_model": "false",
        "dataset": data,
        "split_dataset_ratio": 0,
        "tuner_type": "lora",
        "lora_rank": LORA["rank"],
        "lora_alpha": LORA["alpha"],
        "lora_dropout": 0,
        "target_modules": "all-linear",
        "freeze_vit": "true",
        "freeze_aligner": "true",
        "torch_dtype": "bfloat16",
    }


def swift_command(setting: dict, model_dir: Path, data: Path, out: Path, steps: int, method: str) -> list[str]:
    args = {
        **({"rlhf_type": "dpo", "beta": DPO_BETA, "loss_type": "sigmoid"} if method == "dpo" else {}),
        **swift_model_and_lora(model_dir, data),
        "attn_impl": setting["attn_impl"],
        "packing": setting["packing"],
        "padding_free": setting["padding_free"],
        "use_liger_kernel": "true",
        "gradient_checkpointing": "false",
        "per_device_train_batch_size": setting["batch"],
        "gradient_accumulation_steps": setting.get("accum", ACCUMULATION),
        "max_length": MAX_LENGTH,
        "learning_rate": 1e-4,
        "lr_scheduler_type": "constant",
        "warmup_ratio": 0,
        "weight_decay": 0,  # ms-swift's default is 0.1; the others' is 0
        "dataset_shuffle": "false",
        "train_dataloader_shuffle": "false",
        "max_steps": steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "dataloader_num_workers": 4,
        "dataset_num_proc": 4,
        "seed": 0,
        "output_dir": out,
    }
    return [word for key, value in args.items() for word in (f"--{key}", str(value))]


def llamafactory_config(setting: dict, model_dir: Path, data_dir: Path, out: Path, steps: int, method: str) -> Path:
    config = {
        "model_name_or_path": str(model_dir),
        "image_max_pixels": MAX_PIXELS,
        "image_min_pixels": MIN_PIXELS,
        "stage": method,
        **({"pref_beta": DPO_BETA, "pref_loss": "sigmoid", "pref_ftx": 0.0} if method == "dpo" else {}),
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": LORA["rank"],
        "lora_alpha": LORA["alpha"],
        "lora_dropout": 0.0,
        "lora_target": "all",
        "freeze_vision_tower": True,
        "freeze_multi_modal_projector": True,
        "dataset": "bench",
        "dataset_dir": str(data_dir),
        "template": "qwen3_vl_nothink",
        "cutoff_len": MAX_LENGTH,
        "neat_packing": setting["neat_packing"],
        "flash_attn": setting["flash_attn"],
        "enable_liger_kernel": True,
        "preprocessing_num_workers": 4,
        "dataloader_num_workers": 4,
        "overwrite_cache": True,
        "output_dir": str(out),
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "per_device_train_batch_size": setting["batch"],
        "gradient_accumulation_steps": setting.get("accum", ACCUMULATION),
        "learning_rate": 1.0e-4,
        "lr_scheduler_type": "constant",
        "warmup_ratio": 0.0,
        "weight_decay": 0.0,
        "disable_shuffling": True,
        "max_steps": steps,
        "bf16": True,
        "seed": 0,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train.yaml"  # as its examples are written (0.9.5 fails to read a .json config)
    path.write_text(yaml.safe_dump(config))
    return path


# What the peers' logs say where they leave out a setting they were given (LLaMA-Factory: flash_attn: fa2
# without flash-attn installed; enable_liger_kernel for a model it has no liger patch for).
FALLBACKS = ("is not installed", "does not support liger")


def run_peer(peer: str, site: str, argv: list[str], out: Path, tokenizer, warmup: int, env: dict) -> dict:
    """One peer's training in a process of its own; its measured steps, or the reason it did not run."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "timer.json"
    result.unlink(missing_ok=True)
    log = out / "log.txt"
    environment = dict(
        os.environ,
        PYTHONPATH=site,  # the peer's own pinned libraries first, then the machine's
        PEER_VISION_START_ID=str(tokenizer.convert_tokens_to_ids("<|vision_start|>")),
        PEER_PAD_ID=str(tokenizer.pad_token_id),
        HF_HUB_OFFLINE="1",
        MODELSCOPE_OFFLINE="1",
        **env,
    )
    started = time.time()
    with open(log, "w") as f:
        code = subprocess.run(
            [sys.executable, str(REPO / "benchmarks/peer_timer.py"), str(result), peer, *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=out,
        ).returncode
    wall = time.time() - started
    if code != 0 or not result.exists():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        return {"error": (errors or lines or ["no output"])[-1][:300], "exit": code, "wall_s": wall}
    timer = json.loads(result.read_text())
    # A peer that leaves out something it was asked for (an attention kernel, liger) says so in its log.
    fallbacks = [line for line in log.read_text(errors="replace").splitlines() if any(s in line for s in FALLBACKS)]
    measured = timer["steps"][warmup:]
    seconds = sum(s["s"] for s in measured)
    samples = sum(s["samples"] for s in measured)
    if not measured or samples == 0:
        return {"error": f"no samples counted in {len(timer['steps'])} steps", "wall_s": wall}
    return {
        "samples_per_s": samples / seconds,
        "tokens_per_s": sum(s["tokens"] for s in measured) / seconds,
        "tokens_per_sample": sum(s["tokens"] for s in measured) / samples,
        "padding": 1 - sum(s["tokens"] for s in measured) / sum(s["computed"] for s in measured),
        "samples_per_step": samples / len(measured),
        "peak_gib": timer["peak_gib"],
        "steps_measured": len(measured),
        "losses": timer["losses"],
        "wall_s": wall,
        **({"fell_back": [line[-200:] for line in fallbacks]} if fallbacks else {}),
    }


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, help="a config in benchmarks/configs/, e.g. qwen3-vl-8b")
    parser.add_argument("--method", choices=("sft", "dpo"), default="sft", help="dpo: each side's DPO on pairs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-peers"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("--swift-site", help="folder ms-swift and its pinned libraries are installed in")
    parser.add_argument("--llamafactory-site", help="folder LLaMA-Factory and its pinned libraries are installed in")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--questions-per-image", type=int, default=1)
    parser.add_argument("--short-answers", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=12288, help="our micro-batches' token budget")
    parser.add_argument(
        "--settings",
        default="all",
        help="'all': every setting of each peer in the lists above; 'best': each peer's in order until one runs",
    )
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only the peers' settings whose name contains one of these"
    )
    parser.add_argument("--no-ours", action="store_true")
    parser.add_argument("--no-pixels", action="store_true", help="leave out our run from the pixel cache")
    parser.add_argument("--commit")
    return parser.parse_args()


def workload(args, work: Path, tokenizer) -> Path:
    """The benchmark's raw records: --questions-per-image questions (with dpo, pairs) on each of
    --images images."""
    if args.method == "dpo":
        pairs_in_split = args.images * args.questions_per_image
        raw = make_workload(work, 2 * pairs_in_split, tokenizer, 0, 2 * args.questions_per_image, args.short_answers)
        raw.write_text("".join(json.dumps(r) + "\n" for r in paired(read_rows(raw))[0]))
        return raw
    return make_workload(
        work, args.images * args.questions_per_image, tokenizer, 0, args.questions_per_image, args.short_answers
    )


def run_peers(args, work: Path, model_dir: Path, raw: Path, tokenizer) -> dict:
    """Each peer's settings in turn, each on its own copy of the records in its own format."""
    dpo = args.method == "dpo"
    swift_data, lf_data = write_peer_data(read_rows(raw), work / "images", work)
    results = {}
    peers = [
        ("ms-swift", "swift", args.swift_site, SWIFT_DPO_SETTINGS if dpo else SWIFT_SETTINGS),
        (
            "LLaMA-Factory",
            "llamafactory",
            args.llamafactory_site,
            LLAMAFACTORY_DPO_SETTINGS if dpo else LLAMAFACTORY_SETTINGS,
        ),
    ]
    for name, peer, site, settings in peers:
        if not site:
            continue
        for label, setting in settings.items():
            if args.only and not any(part in f"{name} ({label})" for part in args.only):
                continue
            out = work / f"{peer}-{label.replace(', ', '-')}"
            if peer == "swift":
                argv = swift_command(setting, model_dir, swift_data, out, args.steps, args.method)
                env = {"MAX_PIXELS": str(MAX_PIXELS), "MIN_PIXELS": str(MIN_PIXELS)}
            else:
                argv = ["train", str(llamafactory_config(setting, model_dir, lf_data, out, args.steps, args.method))]
                env = {}
            runner = "swift-rlhf" if peer == "swift" and dpo else peer
            result = run_peer(runner, site, argv, out, tokenizer, args.warmup, env)
            if dpo and "error" not in result:  # a pair: two sequences, each with its image
                result["pairs_per_s"] = result["samples_per_s"] / 2
            results[f"{name} ({label})"] = result
            print(f"{name} ({label}): {json.dumps(result)[:400]}", flush=True)
            if args.settings == "best" and "error" not in result:
                break

    return results


def run_our_sides(args, work: Path, raw: Path, model_dir: Path, image_processor) -> dict:
    """Ours from the vision cache, from pixels, with image groups (and with dpo, DPO's loss)."""
    import torch

    from vlft.data.records import prepare_split

    dpo = args.method == "dpo"
    pairs_in_split = args.images * args.questions_per_image
    results = {}
    prepare_split(raw, work / "images", work / "prepared.jsonl")
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    pixel_cache_s, vision_cache_s = build_caches(work, image_processor, model)
    del model
    torch.cuda.empty_cache()
    ours = [("ours (vision cache)", work / "vision", {})]
    if not args.no_pixels:
        ours.append(("ours (from pixels)", work / "pixels", {}))
    if args.questions_per_image > 1:
        ours.append(("ours (vision cache, image groups)", work / "vision", {"image_groups": True}))
    if dpo:  # β and the loss as the peers'; each pair is one step's record
        ours = [(label, cache, dict(o, method="dpo", beta=DPO_BETA, rpo_alpha=None)) for label, cache, o in ours]
    for label, cache, options in ours:
        settings = dict(
            our_settings(args.steps),
            max_batch_tokens=args.max_batch_tokens,
            packing=True,
            lr_schedule="constant",
            warmup_ratio=0.0,
            vision_cache=cache.name == "vision",
            **options,
        )
        try:
            run = run_ours(model_dir, work / "prepared.jsonl", cache, args.steps, args.warmup, settings, work / label)
            seconds = sum(run["step_s"])
            results[label] = {
                "samples_per_s": sum(run["samples"]) / seconds,
                "tokens_per_s": sum(run["tokens"]) / seconds,
                "tokens_per_sample": sum(run["tokens"]) / sum(run["samples"]),
                "samples_per_step": sum(run["samples"]) / len(run["samples"]),
                "peak_gib": run["peak_gib"],
                "steps_measured": len(run["step_s"]),
                "losses": run["losses"],
                "pixel_cache_s": pixel_cache_s,
                "vision_cache_s": vision_cache_s,
            }
            if dpo:  # the reference pass over all pairs, charged per pair
                pairs, reference_s = sum(run["samples"]) / 2, run["summary"]["reference_s"]
                results[label].update(
                    pairs_per_s=pairs / seconds,
                    reference_s=reference_s,
                    pairs_per_s_with_reference=pairs / (seconds + reference_s * pairs / pairs_in_split),
                )
        except Exception as error:  # a run that fails is reported as such, as a peer's is
            results[label] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        print(f"{label}: {json.dumps(results[label])[:400]}", flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    return results


def report_of(args, results: dict) -> tuple[dict, callable, str, float | None]:
    """The result file, with each peer's rate against each of ours; how to read a side's rate, and
    our best one."""
    import torch

    dpo = args.method == "dpo"
    report = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": commit_of(args.commit) or "unknown",
        "command": " ".join(sys.argv),
        "method": args.method,
        "images": args.images,
        "questions_per_image": args.questions_per_image,
        "answers": "1-16 tokens" if args.short_answers else "20-400 tokens",
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        **results,
    }
    # What a side trains a second: samples, or with dpo pairs (ours charged its reference pass).
    rate = "pairs_per_s" if dpo else "samples_per_s"

    def rate_of(label: str, r: dict) -> float:
        return r["pairs_per_s_with_reference"] if dpo and label.startswith("ours") else r[rate]

    best_ours = max(
        (rate_of(k, r) for k, r in results.items() if k.startswith("ours") and "error" not in r), default=None
    )
    report["ratios"] = {
        k: {o: rate_of(o, results[o]) / r[rate] for o in results if o.startswith("ours") and "error" not in results[o]}
        for k, r in results.items()
        if not k.startswith("ours") and "error" not in r
    }
    return report, rate_of, rate, best_ours


def print_table(args, report: dict, results: dict, rate_of, rate: str, best_ours: float | None) -> None:
    dpo = args.method == "dpo"
    print(
        f"\n{args.arch} on {report['device']}, {report['answers']} answers, {args.questions_per_image} question(s) an image"
    )
    print(
        f"{'':44} {'samples/s':>9} {'tok/sample':>10} {'samples/step':>12} {'padding':>7} {'peak GiB':>8} {'last loss':>9} {'ours/it':>7}"
    )
    for label, r in results.items():
        if "error" in r:
            print(f"{label:44} did not run: {r['error'][:120]}")
            continue
        for line in r.get("fell_back", []):
            print(f"{label:44} ran otherwise than set: {line[-120:]}")
        ratio = best_ours / r[rate] if best_ours and not label.startswith("ours") else float("nan")
        loss = r["losses"][-1] if r["losses"] else float("nan")
        print(
            f"{label:44} {r['samples_per_s']:9.2f} {r['tokens_per_sample']:10.0f} {r['samples_per_step']:12.1f}"
            f" {r.get('padding', 0):7.1%} {r['peak_gib']:8.1f} {loss:9.3f} {ratio:7.2f}"
            + (f"  pairs/s {rate_of(label, r):.2f}" if dpo else "")
        )


def main() -> None:
    import torch

    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    work = args.work / args.arch
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_numbered_tokenizer()
    raw = workload(args, work, tokenizer)
    model_dir = work / "model"
    image_processor = save_checkpoint(args.arch, tokenizer, model_dir)
    results = run_peers(args, work, model_dir, raw, tokenizer)
    if not args.no_ours:
        results |= run_our_sides(args, work, raw, model_dir, image_processor)
    report, rate_of, rate, best_ours = report_of(args, results)
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "kvasir" if args.questions_per_image > 1 else "benchmark"
    kind = f"dpo-{kind}" if args.method == "dpo" else kind
    answers = "short" if args.short_answers else "long"
    gpu = re.search(r"[A-Z]\d{3}", report["device"])  # H200, H100, A100
    name = f"peers-{kind}-{answers}-{args.arch}-{gpu.group() if gpu else 'gpu'}-{report['date']}.json"
    (args.out / name).write_text(json.dumps(report, indent=2))
    print_table(args, report, results, rate_of, rate, best_ours)
    print(f"results: {args.out / name}")


if __name__ == "__main__":
    main()
