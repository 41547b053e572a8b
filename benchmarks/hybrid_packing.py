"""A packed row through Qwen3.5's hybrid text layers on the GPU, against each sample alone.

Random weights at the published Qwen3.5-9B text dimensions (hidden 4096, 16 attention heads of 256,
DeltaNet 16 key and 32 value heads of 128), `--layers` of them (three DeltaNet layers, then one of
attention), bf16, LoRA r=16 on the attention, DeltaNet and MLP projections. `--samples` random
token sequences of 200 to 1,500 tokens: their summed loss and LoRA gradients computed (a) each
alone, through transformers' own path, and (b) in one packed row, through vlft.forward.packing's
attention and vlft.forward.linear_attention's layers (flash-linear-attention's varlen kernel where
installed); (c) the packed row with transformers' functions as they are, to show what (b) fixes. Each against
the same weights in float32, each sample alone: (a)'s error is bf16's own, and (b) should add
nothing to it. Also the seconds of one forward and backward of each (the best of 3 after one).

    python benchmarks/hybrid_packing.py --layers 8 --samples 8 --out $OUT/hybrid_packing.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from vlft.forward import linear_attention
from vlft.forward.packing import PACKED_ATTENTION

TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]


def build(layers: int):
    config = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model


def loss_sum(logits: torch.Tensor, ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """Each token predicts the next of its own sample; a sample's last token predicts nothing."""
    keep = torch.ones(ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    keep[[end - 1 for end in ends[:-1]]] = False
    losses = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")
    return losses[keep].sum()


def run(model, samples: list[torch.Tensor], packed: bool) -> tuple[float, dict, float]:
    """The summed loss, the LoRA gradients and the seconds of one forward and backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    if packed:
        ids = torch.cat(samples)[None]
        ends = torch.tensor([0] + [len(s) for s in samples], device="cuda").cumsum(0)
        positions = torch.cat([torch.arange(len(s), device="cuda") for s in samples])[None]
        logits = model(
            input_ids=ids,
            position_ids=positions,
            packed_cu_seqlens=ends.int(),
            packed_max_seqlen=max(len(s) for s in samples),
            use_cache=False,
        ).logits
        loss = loss_sum(logits, ids, ends[1:].tolist())
        loss.backward()
        total = loss.item()
    else:
        total = 0.0
        for sample in samples:
            loss = loss_sum(model(input_ids=sample[None], use_cache=False).logits, sample[None], [len(sample)])
            loss.backward()
            total += loss.item()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}, seconds


def relative_error(got: dict, want: dict) -> float:
    """Over all LoRA gradients together: |got - want| / |want|."""
    error = sum(((got[n] - want[n]).norm() ** 2).item() for n in want) ** 0.5
    return error / sum((want[n].norm() ** 2).item() for n in want) ** 0.5


def measured(model, samples, packed: bool, repeats: int = 3) -> tuple[float, dict, float]:
    run(model, samples, packed)  # warm-up: kernels compiled and tuned
    results = [run(model, samples, packed) for _ in range(repeats)]
    return results[-1][0], results[-1][1], min(r[2] for r in results)


def leaking(model, samples):
    """The packed row with transformers' own conv and delta-rule functions put back: the leak (c)."""
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    ours = {name: getattr(modeling, name) for name in (linear_attention.CONV, linear_attention.DELTA_RULE)}
    for name, function in ours.items():
        setattr(modeling, name, function.vlft_plain)
    try:
        return run(model, samples, packed=True)
    finally:
        for name, function in ours.items():
            setattr(modeling, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = build(args.layers)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(200, 1500, (args.samples,), generator=generator).tolist()
    samples = [torch.randint(0, 248320, (n,), generator=generator).cuda() for n in lengths]
    runs = {"alone": measured(model, samples, packed=False)}
    model.base_model.model.set_attn_implementation(PACKED_ATTENTION)
    linear_attention.respect_segments()
    runs["packed"] = measured(model, samples, packed=True)
    runs["transformers_packed"] = leaking(model, samples)
    # The reference: the same weights in float32, each sample alone. bf16's own rounding is what
    # "alone" differs from it by; a packed row that adds nothing to that changes no result.
    model.base_model.model.set_attn_implementation("sdpa")
    model.float()
    truth_loss, truth_grads, _ = run(model, samples, packed=False)
    modeling = importlib.import_module(linear_attention.HYBRID_MODELING[0])
    result = {
        "device": torch.cuda.get_device_name(),
        "delta_rule": getattr(modeling, linear_attention.DELTA_RULE).vlft_plain.__module__,
        "lengths": lengths,
        "float32_alone_loss": truth_loss,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    for name, (loss, grads, seconds) in runs.items():
        result[name] = {
            "loss": loss,
            "loss_error_vs_float32": abs(loss - truth_loss) / abs(truth_loss),
            "grad_error_vs_float32": relative_error(grads, truth_grads),
            "s": seconds,
        }
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
