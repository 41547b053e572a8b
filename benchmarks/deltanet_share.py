"""What share of a Qwen3.5 training step transformers' torch delta rule takes on the GPU.

Random weights at the published Qwen3.5-9B text dimensions (benchmarks/hybrid_packing.py's model:
`--layers` of them, three Gated DeltaNet layers then one of attention, bf16, LoRA r=16 on every
projection). One packed row of `--tokens` tokens in samples of `--sample` tokens, forward and backward
through vlft's packed path, timed (the best of 3 after one) three ways:

- as a training step runs it where flash-linear-attention's kernel cannot (vlft.forward.linear_attention
  over transformers' torch chunked delta rule, the row's samples side by side);
- the same with the delta rule replaced by a stand-in that costs next to nothing (its output the
  values, its state zero): the difference is the rule's share;
- the delta rule alone, forward and backward, once a DeltaNet layer's inputs.

ms-swift runs the same torch function on the same layers (padded, not packed), so this share bounds
what packing and the other layers' kernels can gain against it.

    python benchmarks/deltanet_share.py --layers 8 --tokens 8192 --sample 1300 --out $OUT/deltanet_share.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch

from hybrid_packing import build
from vlft.forward import linear_attention


def timed(step, repeats: int = 3) -> float:
    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def stand_in(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    """The values as the output and a zero state: the layer's other work without the rule's."""
    state = value.new_zeros(value.shape[0], value.shape[2], key.shape[-1], value.shape[-1])
    return value * 1.0, state if output_final_state else None


def packed_row(tokens: int, sample: int):
    """A packed row of `tokens` random tokens in samples of `sample` (the last the rest)."""
    lengths = [sample] * (tokens // sample) + ([tokens % sample] if tokens % sample else [])
    ids = torch.randint(0, 150000, (1, tokens), device="cuda")
    ends = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    return lengths, ids, ends, positions


def step_with_and_without_rule(model, wrapper, lengths, ids, ends, positions) -> tuple[float, float]:
    """Seconds of the model's forward and backward on the row, with the delta rule, then with the stand-in."""

    def step():
        out = model(
            input_ids=ids,
            position_ids=positions,
            packed_cu_seqlens=ends,
            packed_max_seqlen=max(lengths),
            use_cache=False,
        )
        out.logits.float().sum().backward()

    rule = wrapper.vlft_plain
    with_rule = timed(step)
    wrapper.vlft_plain = stand_in
    try:
        return with_rule, timed(step)
    finally:
        wrapper.vlft_plain = rule


def rule_alone(rule, config, tokens: int, ends) -> float:
    """Seconds of the rule's forward and backward on one DeltaNet layer's inputs for the row."""
    # transformers' layer repeats the key heads to the value heads' count before it calls the rule.
    heads, k_dim, v_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    bf16 = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    query, key = (torch.randn(1, tokens, heads, k_dim, **bf16) for _ in range(2))
    value = torch.randn(1, tokens, heads, v_dim, **bf16)
    g = (-torch.rand(1, tokens, heads, device="cuda")).to(torch.bfloat16).requires_grad_()
    beta = torch.rand(1, tokens, heads, **bf16)
    spans = list(zip(ends.tolist(), ends.tolist()[1:]))

    def step():
        tensors = (query, key, value, g, beta)
        outs, _ = linear_attention.side_by_side(rule, tensors, spans, None, use_qk_l2norm_in_kernel=True)
        torch.cat(outs, dim=1).float().sum().backward()

    return timed(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sample", type=int, default=1300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    linear_attention.respect_segments()
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    wrapper = getattr(modeling, linear_attention.DELTA_RULE)
    model = build(args.layers)
    lengths, ids, ends, positions = packed_row(args.tokens, args.sample)
    with_rule, without_rule = step_with_and_without_rule(model, wrapper, lengths, ids, ends, positions)
    alone = rule_alone(wrapper.vlft_plain, model.config, args.tokens, ends)
    deltanet_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    result = {
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "deltanet_layers": deltanet_layers,
        "tokens": args.tokens,
        "samples": lengths,
        "step_s": with_rule,
        "step_without_rule_s": without_rule,
        "rule_share": (with_rule - without_rule) / with_rule,
        "rule_alone_s_a_layer": alone,
        "rule_alone_share": alone * deltanet_layers / with_rule,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
