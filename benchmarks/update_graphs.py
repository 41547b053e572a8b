"""What CUDA graphs would take out of a GRPO update's host-bound passes: the language model's 36
decoder layers, LoRA on every linear layer, a forward and a backward over a pass of a few thousand
tokens (a reward stage's prefill with gradients, or its answers' forward, on one Kvasir-like image),
run three ways on one GPU:

- `compiled`: each layer through one compiled function, as the stage runs them
  (vlft.training.shared_prompts: torch.compile, dynamic shapes), the host launching every kernel;
- `eager`: the layers as they are, the host launching every kernel;
- `graphed`: each layer's forward and backward captured once (torch.cuda.make_graphed_callables, at
  a fixed shape), replayed: the host launches one graph a layer and direction;
- `compiled, C++ wrapper` (`--cpp-wrapper`): as `compiled`, inductor's code that launches a graph's
  kernels written in C++ rather than Python (its `cpp_wrapper` option), dynamic shapes kept;
- `compiled, reduce-overhead` (`--reduce-overhead`): torch.compile's own CUDA graphs of the
  compiled layers (one recorded for each shape it meets), forward and backward; with
  `--reduce-overhead-static`, compiled for each shape rather than for dynamic shapes.

A spike, not the stage's code: plain causal attention (SDPA) over one sequence, not the stage's
packed prompts and answers; the point is the host's share at these sizes. The gradients of the
graphed pass are compared with the eager pass's: the same kernels, but flash attention's backward
adds its query gradients atomically, in no fixed order, so two eager passes differ as much.

    python benchmarks/update_graphs.py --arch qwen3-vl-8b --tokens 1300 2600 --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch


from train_speed import build_model, commit_of
from vlft.demo.tiny_model import make_tokenizer

LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


class CompiledCall(torch.nn.Module):
    """A LayerCall through the one compiled function every layer runs (as the stage's passes run them)."""

    def __init__(self, call: "LayerCall", compiled):
        super().__init__()
        self.call, self.compiled = call, compiled

    def forward(self, hidden, cos, sin):
        return self.compiled(self.call, hidden, cos, sin)


class LayerCall(torch.nn.Module):
    """One decoder layer called as the stage's passes call it, its inputs tensors alone (what
    make_graphed_callables takes)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, cos, sin):
        return self.layer(hidden, position_embeddings=(cos, sin), attention_mask=None)


def adapted_layers(arch: str, device: str):
    """The model's decoder layers with a fresh LoRA (r 16, float32 weights, B random so that its
    gradients are not all zero), and its rotary embedding."""
    from peft import LoraConfig, get_peft_model

    model = build_model(arch, make_tokenizer(), device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    torch.manual_seed(1)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
            if "lora_B" in name:
                parameter.data.normal_(std=0.01)
    text = model.base_model.model.model.language_model
    return [LayerCall(layer) for layer in text.layers], text.rotary_emb, model


def pass_inputs(rotary, tokens: int, width: int, device: str):
    hidden = torch.randn(1, tokens, width, device=device, dtype=torch.bfloat16) * 0.5
    positions = torch.arange(tokens, device=device).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = rotary(hidden, positions)
    return hidden, cos, sin


def run_pass(calls, hidden, cos, sin, autocast_dtype, device: str):
    """A forward through every layer and a backward from a fixed direction: the host's seconds to
    launch it and the seconds until the device is done."""
    torch.cuda.synchronize() if device == "cuda" else None
    began = time.perf_counter()
    # torch.compile's CUDA graphs: a new pass, so the last one's outputs may be overwritten.
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(device, dtype=autocast_dtype, cache_enabled=False):
        h = hidden.detach().requires_grad_()
        for call in calls:
            h = call(h, cos, sin)
    (h.float() * DIRECTION[h.shape[1]]).sum().backward()
    launched = time.perf_counter() - began
    torch.cuda.synchronize() if device == "cuda" else None
    return launched, time.perf_counter() - began


DIRECTION: dict[int, torch.Tensor] = {}


def lora_grads(model) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return grads


def timed(calls, inputs, model, repeats: int, device: str) -> dict:
    for _ in range(3):  # compiles, autotuning, allocator warm-up
        run_pass(calls, *inputs, torch.bfloat16, device)
        model.zero_grad(set_to_none=True)
    launched, done = [], []
    for _ in range(repeats):
        a, b = run_pass(calls, *inputs, torch.bfloat16, device)
        launched.append(a)
        done.append(b)
        model.zero_grad(set_to_none=True)
    launched.sort(), done.sort()
    return {"host_launch_s": launched[len(launched) // 2], "pass_s": done[len(done) // 2], "repeats": repeats}


def graphed_pass(modules, inputs, model, eager_grads, repeats: int, device: str) -> dict:
    """The pass with each module's forward and backward captured at this shape and replayed; its
    LoRA gradients against the eager pass's (`eager_grads`)."""
    # Each layer's input as the pass hands it on: requiring gradients, as the graphs are replayed.
    samples = tuple((inputs[0].detach().clone().requires_grad_(), inputs[1], inputs[2]) for _ in modules)
    with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(tuple(modules), samples)
    model.zero_grad(set_to_none=True)
    row = timed(list(graphed), inputs, model, repeats, device)
    run_pass(list(graphed), *inputs, torch.bfloat16, device)
    return row | {"grad_max_rel_to_eager": largest_difference(lora_grads(model), eager_grads)}


def compiled_row(compile_options: dict, calls, inputs, model, compiled_grads, repeats, device) -> dict:
    """The pass through layers compiled with `compile_options`; its LoRA gradients against the
    plainly compiled pass's (`compiled_grads`)."""
    try:
        compile_options = {"dynamic": True} | compile_options
        layer = torch.compile(lambda call, h, cos, sin: call(h, cos, sin), **compile_options)
        modules = [CompiledCall(call, layer) for call in calls]
        row = timed(modules, inputs, model, repeats, device)
        run_pass(modules, *inputs, torch.bfloat16, device)
    except Exception as error:  # a spike: what failed is the finding
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return row | {"grad_max_rel_to_compiled": largest_difference(lora_grads(model), compiled_grads)}


def largest_difference(grads, reference) -> float:
    """The largest difference of any LoRA gradient from its reference, over that reference's largest value."""
    return max(float((g - e).abs().max() / e.abs().max().clamp_min(1e-30)) for g, e in zip(grads, reference))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3-vl-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1300, 2600])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--graph-compiled",
        action="store_true",
        help="also capture the compiled layers (with torch 2.11 on an H200 the capture failed and left the device unusable)",
    )
    parser.add_argument(
        "--cpp-wrapper", action="store_true", help="also the compiled layers with inductor's C++ wrapper"
    )
    parser.add_argument(
        "--reduce-overhead", action="store_true", help="also the compiled layers as torch.compile's own CUDA graphs"
    )
    parser.add_argument(
        "--reduce-overhead-static", action="store_true", help="the same, compiled for each shape (not dynamic)"
    )
    parser.add_argument("--commit")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls, rotary, model = adapted_layers(args.arch, device)
    width = model.base_model.model.config.text_config.hidden_size
    compiled_layer = torch.compile(lambda call, h, cos, sin: call(h, cos, sin), dynamic=True)
    compiled = [CompiledCall(call, compiled_layer) for call in calls]
    results = {}
    for tokens in args.tokens:
        inputs = pass_inputs(rotary, tokens, width, device)
        DIRECTION[tokens] = torch.randn(1, tokens, width, device=device)
        row = {"eager": timed(calls, inputs, model, args.repeats, device)}
        run_pass(calls, *inputs, torch.bfloat16, device)
        eager_grads = lora_grads(model)
        row["compiled"] = timed(compiled, inputs, model, args.repeats, device)
        run_pass(compiled, *inputs, torch.bfloat16, device)
        compiled_grads = lora_grads(model)
        # How far two passes of the same compiled layers lie apart: what the variants' differences
        # from compiled_grads are measured against.
        run_pass(compiled, *inputs, torch.bfloat16, device)
        row["compiled"]["grad_max_rel_to_itself"] = largest_difference(lora_grads(model), compiled_grads)
        # make_graphed_callables first: after torch.compile's own graphs its capture failed.
        if device == "cuda":
            both = (("graphed", calls), ("compiled, graphed", compiled))
            for name, modules in both if args.graph_compiled else both[:1]:
                try:
                    row[name] = graphed_pass(modules, inputs, model, eager_grads, args.repeats, device)
                except Exception as error:  # a spike: what failed is the finding
                    row[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                for module in modules:  # make_graphed_callables replaced each one's forward: put back
                    module.__dict__.pop("forward", None)
        variants = {"compiled, C++ wrapper": {"options": {"cpp_wrapper": True}}} if args.cpp_wrapper else {}
        if args.reduce_overhead and device == "cuda":
            variants["compiled, reduce-overhead"] = {"mode": "reduce-overhead"}
        if args.reduce_overhead_static and device == "cuda":
            variants["compiled for its shape, reduce-overhead"] = {"mode": "reduce-overhead", "dynamic": False}
        for name, compile_options in variants.items():
            row[name] = compiled_row(compile_options, calls, inputs, model, compiled_grads, args.repeats, device)
        results[tokens] = row
        print(tokens, json.dumps(row), flush=True)
    report = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "date": date.today().isoformat(),
        "commit": commit_of(args.commit),
        "command": "benchmarks/update_graphs.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "passes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
