"""The decode step of vlft.generation.engine alone: its time against rows and cache length, beside the
bandwidth bound, and where a step's GPU time goes.

    python benchmarks/decode_step.py --arch qwen3-vl-8b
    # the same steps drawing sampled tokens (vlft.generation.sampling), against greedy ones
    python benchmarks/decode_step.py --arch qwen3-vl-8b --rows 128 --live 1408 --temperature 1.0 --top-p 0.95 --top-k 50
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


from eval_speed import copy_bandwidth, step_weight_bytes
from train_speed import build_model, print_kernel_time
from vlft.demo.tiny_model import make_tokenizer
from vlft.generation.kv_cache import SlotCache
from vlft.generation.runner import DecodeStep
from vlft.generation.sampling import Sampling, sampler_for


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3-vl-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--cache-length", type=int, default=2048, help="positions a row of the cache holds")
    parser.add_argument(
        "--live", type=int, nargs="+", default=[256, 1024, 2048], help="positions each row attends to (its length)"
    )
    parser.add_argument("--attention", default=None, help="the step's attention (default: the GPU's own)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlft-decode"))
    parser.add_argument("--no-compile", action="store_true", help="a CUDA graph of the eager step")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--waited",
        action="store_true",
        help="also each step waited for, its tokens read back (as the engine reads them)",
    )
    parser.add_argument("--temperature", type=float, help="sampled tokens (with --top-p, --top-k): also timed")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    return parser.parse_args()


def main():
    args = parse_args()
    samplings = [None] + ([Sampling(args.temperature, args.top_p, args.top_k)] if args.temperature else [])
    bandwidth = copy_bandwidth()
    model = build_model(args.arch, make_tokenizer(), "cuda").eval()
    weights, per_token = step_weight_bytes(model), SlotCache.bytes_per_token(model)
    print(f"{args.arch}: {weights / 1e9:.1f} GB of weights, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"cache of {args.cache_length} positions a row; bound: the weights and each row's live positions, read once")
    print(f"{'rows':>5} {'live':>7} {'step ms':>8} {'bound ms':>8} {'x bound':>7}")
    length = args.cache_length
    with torch.no_grad():
        for rows, sampling in ((rows, sampling) for rows in args.rows for sampling in samplings):
            cache = SlotCache(model, rows, length)
            began = time.perf_counter()
            step = DecodeStep(model, cache, compile=not args.no_compile, attention=args.attention)
            step.sampler = sampler_for(sampling, rows, step.positions)
            if sampling:
                step.sampler.seeds.copy_(torch.arange(rows))
                print(f"sampled: {sampling}")
            for live in args.live:
                cache.write_at.fill_(live - 1)  # every row attends to its first `live` positions
                for _ in range(3):
                    step(rows, length)
                torch.cuda.synchronize()
                made, began = time.perf_counter() - began, time.perf_counter()
                for _ in range(20):
                    chosen = step(rows, length)
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - began) / 20  # (before 2026-11-27, with the check's step below too)
                if sampling:  # a replay with the same state draws the same tokens
                    again = chosen.clone()
                    assert torch.equal(step(rows, length), again)
                    print(f"      distinct tokens drawn over {rows} rows: {len(set(again.tolist()))}")
                bound = (weights + rows * live * per_token) / bandwidth
                print(
                    f"{rows:5d} {live:7d} {seconds * 1e3:8.2f} {bound * 1e3:8.2f} {seconds / bound:7.2f}"
                    f"   (compiled and captured in {made:.0f} s)"
                )
                if args.waited:
                    waited_steps(step, rows, length)
                began = time.perf_counter()
            if args.no_profile or rows != max(args.rows) or sampling:
                del step, cache
                torch.cuda.empty_cache()
                continue
            # Where the time goes, kernel by kernel, in the largest case (the step as compiled,
            # launched without its graph: the same kernels).
            args.work.mkdir(parents=True, exist_ok=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step._run(rows, length)
                torch.cuda.synchronize()
            print(f"rows {rows}, live {args.live[-1]} of {length}, 5 steps:")
            print_kernel_time(prof, args.work)


def waited_steps(step: DecodeStep, rows: int, length: int, steps: int = 20) -> None:
    """Each step's time where the host waits for its tokens before it launches the next, as the
    engine reads them back: beside the steps launched back to back, what the graph's launch
    costs a step (the 8B on an H200 at 64 rows: 6.39 ms either way, nothing)."""
    began = time.perf_counter()
    for _ in range(steps):
        step(rows, length).tolist()
    print(f"      each step waited for: {(time.perf_counter() - began) / steps * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
