"""Whether a reward stage's reference pass over its prompts could run beside the rollout's decode
steps on one GPU, rather than after them: the two kinds of work side by side on two CUDA streams.

A decode step of 64 rows (8 screenshots, 8 answers each) reads every weight for a few rows: it is
bound by memory, and each of its matmuls fills few of the GPU's multiprocessors. The reference's
forward over the step's prompts (8 screenshots of some 1,300 tokens) is bound by arithmetic. The
reference's forward over the prompts needs nothing the decode makes, so it could start with it.

The workload is the 8B's linear layers alone (36 layers: q, k, v, o, gate, up, down; bfloat16
weights of the model's own sizes, random), without attention, norms or LoRA: what the matmuls
alone would gain. Each side is captured as one CUDA graph (as the engine's decode steps are), so
that the host's launches play no part; it reports each alone, one after the other, and both at
once on two streams.

    python benchmarks/stream_overlap.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from train_speed import commit_of  # noqa: E402

# The 8B's text model (benchmarks/configs/qwen3-vl-8b.json): hidden 4096, MLP 12288, 32 query and
# 8 key/value heads of 128.
HIDDEN, MLP, LAYERS = 4096, 12288, 36
SHAPES = [
    (HIDDEN, HIDDEN),
    (HIDDEN, 1024),
    (HIDDEN, 1024),
    (HIDDEN, HIDDEN),
    (HIDDEN, MLP),
    (HIDDEN, MLP),
    (MLP, HIDDEN),
]


def layer_weights(device) -> list[list[torch.Tensor]]:
    return [[torch.randn(k, n, device=device, dtype=torch.bfloat16) * 0.02 for k, n in SHAPES] for _ in range(LAYERS)]


def through_layers(x: torch.Tensor, weights, buffers: dict) -> None:
    """Every layer's seven matmuls over `x`'s rows, each written into a buffer of its own (the
    graph's memory stays fixed)."""
    for layer in weights:
        for (k, n), weight in zip(SHAPES, layer):
            source = x if k == HIDDEN else buffers[(x.shape[0], HIDDEN, MLP)]
            torch.mm(source, weight, out=buffers[(x.shape[0], k, n)])


def captured(rows: int, repeats: int, weights, device) -> torch.cuda.CUDAGraph:
    """`repeats` passes of `rows` rows through every layer, as one CUDA graph."""
    x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    buffers = {(rows, k, n): torch.empty(rows, n, device=device, dtype=torch.bfloat16) for k, n in SHAPES}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        through_layers(x, weights, buffers)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            through_layers(x, weights, buffers)
    graph.keep = (x, buffers)
    return graph


def seconds(run, repeats: int = 10) -> float:
    """The median of `repeats` timed runs of `run()`, the device synchronized around each."""
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    times = sorted(times[2:])
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-rows", type=int, default=64, help="rows a decode step: prompts times answers")
    parser.add_argument("--decode-steps", type=int, default=19)
    parser.add_argument("--prompt-tokens", type=int, default=8 * 1300, help="the reference's prompts' tokens")
    parser.add_argument("--commit")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    weights = layer_weights(device)
    decode = captured(args.decode_rows, args.decode_steps, weights, device)
    prompts = captured(args.prompt_tokens, 1, weights, device)
    beside = torch.cuda.Stream()

    def both_at_once():
        beside.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(beside):
            prompts.replay()
        decode.replay()
        torch.cuda.current_stream().wait_stream(beside)

    alone = {"decode": seconds(decode.replay), "reference prompts": seconds(prompts.replay)}
    serial = seconds(lambda: (prompts.replay(), decode.replay()))
    overlapped = seconds(both_at_once)
    weight_bytes = sum(k * n * 2 for k, n in SHAPES) * LAYERS
    report = {
        "device": torch.cuda.get_device_name(),
        "date": date.today().isoformat(),
        "commit": commit_of(args.commit),
        "command": "benchmarks/stream_overlap.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "decode_rows": args.decode_rows,
        "decode_steps": args.decode_steps,
        "prompt_tokens": args.prompt_tokens,
        "alone_s": alone,
        "decode_step_ms": alone["decode"] / args.decode_steps * 1e3,
        "weights_read_ms_at_4_8_tb_s": weight_bytes / 4.8e12 * 1e3,
        "one_after_the_other_s": serial,
        "on_two_streams_s": overlapped,
        "saved_s": serial - overlapped,
        "saved_of_the_decode": (serial - overlapped) / alone["decode"],
    }
    print(json.dumps(report, indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
