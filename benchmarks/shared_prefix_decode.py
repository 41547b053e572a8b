"""The decode step with each group's shared prefix kept once (vlft.generation.shared_prefixes)
against the step that reads every row's own copy of it: time a step as the answers grow, agreement
of the two steps' logits on the same keys and values, and the rows that fit in the device's memory.

Groups of `--group` rows share a prompt of `--prefix` tokens (a GRPO question's sampled answers, an
image's questions); each row holds room for `--answer-room` answer tokens.

    python benchmarks/shared_prefix_decode.py --arch qwen3-vl-8b
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch


from train_speed import build_model, print_kernel_time
from vlft.demo.tiny_model import make_tokenizer
from vlft.generation.kv_cache import KV_BLOCK, SlotCache, refresh_live_blocks
from vlft.generation.runner import DecodeStep
from vlft.generation.shared_prefixes import Cascade, SharedPrefixes, own_length


def rounded(length: int) -> int:
    return -(-length // (2 * KV_BLOCK)) * 2 * KV_BLOCK


def caches(model, rows: int, group: int, prefix: int, room: int, shared: bool) -> SlotCache:
    """A slot cache of `rows` rows in groups of `group` after a `prefix`-token prompt, each with room
    for `room` answer tokens: the prefix in each row, or once a group in its prefix slot."""
    if not shared:
        return SlotCache(model, rows, rounded(prefix + room))
    cascade = Cascade(seats=group, prefixes=rows // group, own_length=room)
    cache = SlotCache(model, rows, own_length(cascade, room))
    cache.prefixes = SharedPrefixes(model, cascade, rounded(prefix), rows)
    store = cache.prefixes
    slots = torch.arange(rows, device=cache.rows.device)
    store.seated.copy_(slots.view(rows // group, group))
    store.seat_of.copy_(slots)
    store.last.fill_(prefix - 1)
    refresh_live_blocks(store.live, store.last)
    return cache


def same_contents(unshared: SlotCache, shared: SlotCache, group: int, prefix: int, answered: int) -> None:
    """Random keys and values in the shared cache, and the very same ones in the unshared rows: each
    row its group's prefix, then its own `answered` positions."""
    generator = torch.Generator(device=unshared.rows.device).manual_seed(0)
    for layer in range(len(unshared.keys)):
        for store, copy in ((shared.prefixes.keys, unshared.keys), (shared.prefixes.values, unshared.values)):
            store[layer][:, :, :prefix].normal_(generator=generator)
            copy[layer][:, :, :prefix] = store[layer][:, :, :prefix].repeat_interleave(group, 0)
        for store, copy in ((shared.keys, unshared.keys), (shared.values, unshared.values)):
            store[layer][:, :, :answered].normal_(generator=generator)
            copy[layer][:, :, prefix : prefix + answered] = store[layer][:, :, :answered]


def timed(step: DecodeStep, rows: int, length: int, repeats: int = 20) -> float:
    for _ in range(3):
        step(rows, length)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        step(rows, length)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats


def most_rows(model, group: int, prefix: int, room: int, shared: bool, ceiling: int) -> int:
    """The most rows (a multiple of `group`) whose cache the device can allocate beside the model."""

    def fits(rows: int) -> bool:
        try:
            caches(model, rows, group, prefix, room, shared)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    low, high = 0, ceiling // group + 1  # in groups: low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * group) else (low, middle)
    return low * group


def attention_check(rows: int = 64, group: int = 8, prefix: int = 1300, answered: int = 200) -> float:
    """The cascade's attention as the step compiles it, in float32 on the device, against softmax
    attention over each row's prefix and own keys together: the largest difference, relative to the
    largest value."""
    from vlft.generation.kv_cache import live_blocks
    from vlft.generation.shared_prefixes import PrefixLayer, cascade_attention

    generator = torch.Generator(device="cuda").manual_seed(1)
    heads, kv_heads, dim, slots = 32, 8, 128, rows // group

    def normal(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    keys, values = normal(slots, kv_heads, rounded(prefix), dim), normal(slots, kv_heads, rounded(prefix), dim)
    own_keys, own_values = normal(rows, kv_heads, rounded(answered), dim), normal(
        rows, kv_heads, rounded(answered), dim
    )
    query = normal(rows, heads, 1, dim)
    row = torch.arange(rows, device="cuda")
    write_at = torch.full((rows,), answered - 1, device="cuda")
    last = torch.full((slots,), prefix - 1, device="cuda")
    layer = PrefixLayer(keys, values, row.view(slots, group), row, live_blocks(last, rounded(prefix), queries=group))
    compiled = torch.compile(cascade_attention)
    got, _ = compiled(
        None,
        query,
        own_keys,
        own_values,
        None,
        dim**-0.5,
        live=live_blocks(write_at, rounded(answered)),
        prefixes=layer,
    )
    union_keys = torch.cat([keys[:, :, :prefix].repeat_interleave(group, 0), own_keys[:, :, :answered]], 2)
    union_values = torch.cat([values[:, :, :prefix].repeat_interleave(group, 0), own_values[:, :, :answered]], 2)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, union_keys, union_values, scale=dim**-0.5, enable_gqa=True
    ).transpose(1, 2)
    return float((got - want).abs().max() / want.abs().max())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3-vl-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[128])
    parser.add_argument("--shared-rows", type=int, nargs="*", default=[512], help="rows timed shared alone")
    parser.add_argument("--shared-room", type=int, default=128, help="their answer room")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1300, help="the tokens a group's rows share")
    parser.add_argument("--answer-room", type=int, default=400)
    parser.add_argument("--answered", type=int, nargs="+", default=[20, 100, 200, 400])
    parser.add_argument(
        "--fit-rooms", type=int, nargs="+", default=[20, 400], help="answer rooms for the rows that fit"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true")
    return parser.parse_args()


def shared_against_unshared(model, args, results: dict) -> None:
    """At each row count and answer length: the shared step against the unshared one, their logits'
    agreement (and bf16's own spread: SDPA against flex_attention) and their seconds."""
    for rows in args.rows:
        plain = caches(model, rows, args.group, args.prefix, args.answer_room, shared=False)
        cascade = caches(model, rows, args.group, args.prefix, args.answer_room, shared=True)
        steps = {False: DecodeStep(model, plain, compile=True), True: DecodeStep(model, cascade, compile=True)}
        # bfloat16's own spread: the unshared step through transformers' SDPA instead of flex_attention.
        sdpa = DecodeStep(model, plain, attention="sdpa")
        tokens = torch.randint(0, 1000, (rows,), device="cuda")
        for step in [*steps.values(), sdpa]:
            step.tokens.copy_(tokens)
        for answered in args.answered:
            same_contents(plain, cascade, args.group, args.prefix, answered)
            plain.write_at.fill_(args.prefix + answered)
            cascade.write_at.fill_(answered)
            for step in [*steps.values(), sdpa]:
                step.positions.fill_(args.prefix + answered)
            # Agreement first (eager, the same tokens written where the steps write them).
            logits = {shared: step.logits().float() for shared, step in steps.items()}
            logits["sdpa"] = sdpa.logits().float()
            error = float((logits[True] - logits[False]).norm() / logits[False].norm())
            agree = float((logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean())
            floor = float((logits["sdpa"] - logits[False]).norm() / logits[False].norm())
            floor_agree = float((logits["sdpa"].argmax(-1) == logits[False].argmax(-1)).float().mean())
            seconds = {shared: timed(step, rows, step.cache.keys[0].shape[2]) for shared, step in steps.items()}
            ratio = seconds[False] / seconds[True]
            print(
                f"{rows:5d} {answered:8d} {seconds[False] * 1e3:11.2f} {seconds[True] * 1e3:9.2f} {ratio:6.2f}"
                f" {error:9.2e} {agree:7.1%}   (SDPA against flex, unshared: {floor:.2e}, {floor_agree:.1%})"
            )
            results["steps"].append(
                {
                    "rows": rows,
                    "answered": answered,
                    "unshared_ms": seconds[False] * 1e3,
                    "shared_ms": seconds[True] * 1e3,
                    "ratio": ratio,
                    "logits_relative_error": error,
                    "argmax_agreement": agree,
                    "sdpa_relative_error": floor,
                    "sdpa_argmax_agreement": floor_agree,
                }
            )
        if args.profile:  # where the shared step's time goes, at the last answer length
            work = Path("/tmp/vlft-cascade")
            work.mkdir(parents=True, exist_ok=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    steps[True]._run(rows, cascade.keys[0].shape[2])
                torch.cuda.synchronize()
            print(f"the shared step, rows {rows}, 5 steps:")
            print_kernel_time(prof, work)
        del steps, step, sdpa, plain, cascade, logits
        gc.collect()  # the steps' graphs and caches sit in reference cycles
        torch.cuda.empty_cache()


def shared_alone(model, args, results: dict) -> None:
    """Row counts that fit only shared: the shared step's seconds."""
    for rows in args.shared_rows:  # more rows than fit unshared
        cascade = caches(model, rows, args.group, args.prefix, args.shared_room, shared=True)
        step = DecodeStep(model, cascade, compile=True)
        for answered in (a for a in args.answered if a < args.shared_room):
            cascade.write_at.fill_(answered)
            step.positions.fill_(args.prefix + answered)
            seconds = timed(step, rows, cascade.keys[0].shape[2])
            print(f"{rows:5d} {answered:8d} {'-':>11} {seconds * 1e3:9.2f}   (shared alone)")
            results["steps"].append({"rows": rows, "answered": answered, "shared_ms": seconds * 1e3})
        del step, cascade
        gc.collect()
        torch.cuda.empty_cache()


def rows_that_fit(model, args, results: dict) -> None:
    """For each answer room, the most rows that fit unshared and shared."""
    for room in args.fit_rooms:
        fit = {
            shared: most_rows(model, args.group, args.prefix, room, shared, ceiling=8192) for shared in (False, True)
        }
        print(f"answer room {room}: {fit[False]} rows fit unshared, {fit[True]} shared ({fit[True] / fit[False]:.2f}x)")
        results["fit"].append({"answer_room": room, "unshared_rows": fit[False], "shared_rows": fit[True]})


def main():
    args = parse_args()
    model = build_model(args.arch, make_tokenizer(), "cuda").eval()
    print(f"{args.arch}: groups of {args.group} rows after {args.prefix} shared tokens, room for {args.answer_room}")
    results = {"arch": args.arch, "group": args.group, "prefix": args.prefix, "steps": [], "fit": []}
    error = attention_check()
    print(f"cascade attention compiled, float32, against softmax over the union: max error {error:.1e} of the max")
    results["attention_float32_error"] = error
    print(
        f"{'rows':>5} {'answered':>8} {'unshared ms':>11} {'shared ms':>9} {'ratio':>6} {'logit err':>9} {'argmax':>7}"
    )
    with torch.no_grad():
        shared_against_unshared(model, args, results)
        shared_alone(model, args, results)
        rows_that_fit(model, args, results)
    print(f"device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
