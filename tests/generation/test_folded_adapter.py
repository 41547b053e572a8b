"""A rollout's decode steps on its adapter folded into a copy of the weights
(vlft.generation.folded_adapter): the adapter's logits and answers, on the CPU in float64, for the
three families; folded anew at each run of a kept engine; the model's own weights never written;
folded only where plain LoRA's copy fits its share of the GPU."""

from __future__ import annotations

import pytest
import torch

from vlft.config import stage_defaults
from vlft.demo.shapes import make_dataset
from vlft.demo.tiny_model import FAMILIES
from vlft.generation import folded_adapter
from vlft.generation.engine import Engine, answer_requests
from vlft.generation.evaluate import prompt_request
from vlft.generation.folded_adapter import FoldedAdapter, adapted_layers, why_not_folded
from vlft.generation.kv_cache import KV_BLOCK, SlotCache
from vlft.generation.runner import DECODE_ATTENTION, DecodeStep, prefill
from vlft.generation.sampling import Sampling
from vlft.modeling import load_base_model, unwrapped, with_new_adapter
from vlft.forward.packing import use_packed_attention
from tests.helpers import assert_close_normwise, tiny_family_data
from tests.generation.test_generation import greedy_steps_logits, stage_data

CPU, FLOAT64 = torch.device("cpu"), torch.float64


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"folded-{request.param}")
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 6}, seed=3)
    tiny_family_data(root, request.param, root / "raw.jsonl")
    return request.param, root


def adapted(root, device=CPU, dtype=FLOAT64):
    """The tiny model with an adapter whose B is not zero (a fresh one's is: folded, the base's
    weights again), as a stage's adapter is after some steps."""
    model = with_new_adapter(load_base_model(root / "model", device, dtype), {**stage_defaults(), "lora_r": 8})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return unwrapped(model).eval()


def requests_of(root, model, limit: int, device=CPU, dtype=FLOAT64):
    tokenizer, builder, data = stage_data(root, model)
    for n, record in enumerate(data.records):
        request = prompt_request(n, data.samples[record["key"]], data, builder, 0, model, device, dtype, limit)
        request.seed = 100 + n
        yield request


def test_a_decode_step_on_the_folded_adapter_gives_the_adapters_logits(family):
    """Eight steps of four rows, the step reading the folded copies against the step computing the
    adapter's two matmuls, in float64: each step's logits within 1e-11 of their norm (each folded
    weight W + s B A rounded once, u = 1.1e-16 of it; the step's sums of a few hundred terms through
    two layers whose weights scale an error by less than 100, as the cascade step's test bounds
    them), and the same greedy tokens. The model's own weights are the same tensors, bit for bit,
    after; the adapter is marked merged nowhere."""
    name, root = family
    model = adapted(root)
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    group = list(requests_of(root, model, 8))[:4]
    folded = FoldedAdapter(adapted_layers(model))
    folded.refresh()
    steps = {}
    with torch.no_grad():
        use_packed_attention(model)
        prefilled = prefill(model, group)
        for fold in (None, folded):
            cache = SlotCache(model, 4, 2 * KV_BLOCK)
            cache.fill([0, 1, 2, 3], prefilled)
            step = DecodeStep(model, cache, attention=DECODE_ATTENTION, folded=fold)
            steps[fold] = greedy_steps_logits(step, group, prefilled)
        model.set_attn_implementation({"text_config": "sdpa"})
    for n, (got, want) in enumerate(zip(steps[folded], steps[None])):
        assert_close_normwise(got, want, rtol=1e-11, msg=f"{name}, step {n}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (name, n)
    # The copies carry the adapter: they are not the base's weights.
    assert all(not torch.equal(w, layer.base_layer.weight) for w, layer in zip(folded.weights, folded.layers))
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters()), name
    assert not any(layer.merged for layer in folded.layers)


def test_a_kept_engine_on_the_folded_adapter_draws_the_adapters_answers_as_the_adapter_changes(family):
    """Sampled answers (temperature 1.0, each prompt's own seed) from one engine kept over two runs,
    its decode steps reading the folded adapter, are those of a fresh engine computing the adapter
    each run, token for token (float64), and the adapter changed between the runs (as a step's
    update changes it) changes them: the copies are folded anew at each run."""
    name, root = family
    answers_of_a_kept_engine_on_the_folded_adapter(root, Sampling(temperature=1.0), CPU, FLOAT64, name)


def answers_of_a_kept_engine_on_the_folded_adapter(root, sampling, device, dtype, name: str) -> None:
    model = adapted(root, device, dtype)
    limit = 10
    longest = max(r.prompt for r in requests_of(root, model, limit, device, dtype)) + limit
    engine = Engine(model, 3, longest, sampling, None, FoldedAdapter(adapted_layers(model)))
    runs = []
    with torch.no_grad():
        for run in range(2):
            if run:  # an update
                for layer in adapted_layers(model):
                    layer.lora_B["default"].weight.mul_(-2.0)
            folded, fresh = {}, {}
            engine.answer(requests_of(root, model, limit, device, dtype), end_id=-1, on_answer=folded.__setitem__)
            fresh_requests = requests_of(root, model, limit, device, dtype)
            answer_requests(model, fresh_requests, 3, -1, longest, fresh.__setitem__, sampling=sampling)
            assert folded == fresh, (name, run)
            runs.append(folded)
    assert runs[0] != runs[1], name
    engine.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's compiled decode step and its CUDA graph")
def test_a_gpus_kept_engine_replays_its_graph_on_the_adapter_folded_anew_at_each_run(tmp_path):
    """On a GPU the decode step is compiled and captured once, in the engine's first run, reading the
    folded copies where they lie: greedy answers in float32 are a fresh engine's computing the
    adapter, in both runs, the adapter changed between them."""
    make_dataset({"train": tmp_path / "raw.jsonl"}, tmp_path / "images", {"train": 6}, seed=3)
    tiny_family_data(tmp_path, "qwen3_vl", tmp_path / "raw.jsonl")
    answers_of_a_kept_engine_on_the_folded_adapter(tmp_path, None, torch.device("cuda"), torch.float32, "gpu")


def test_a_rollout_folds_plain_lora_where_its_copy_fits_and_says_why_not_elsewhere(family, monkeypatch):
    from peft import LoraConfig, get_peft_model

    name, root = family
    model = adapted(root)
    assert why_not_folded(model, None) == "on a CPU, where the adapter's matmuls are the least of a decode step"
    monkeypatch.setattr(folded_adapter, "FOLD_DEVICES", ("cuda", "cpu"))
    layers = adapted_layers(model)
    copy = sum(layer.base_layer.weight.nbytes for layer in layers)
    assert why_not_folded(model, None) is None
    assert why_not_folded(model, copy * 8) is None  # an eighth of the memory, exactly
    too_small = why_not_folded(model, copy * 8 - 1)
    assert too_small.startswith("the folded copy (") and "would take more than 12.5% of the GPU's" in too_small
    folded, why = FoldedAdapter.for_rollouts(model, copy * 8)
    assert why is None and folded.bytes == copy and len(folded.layers) == len(layers)
    assert FoldedAdapter.for_rollouts(model, copy * 8 - 1) == (None, too_small)
    base = load_base_model(root / "model", CPU, FLOAT64)
    assert why_not_folded(base, None) == "no adapter"
    dora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert why_not_folded(dora, None).startswith("not plain LoRA (merged, transposed, DoRA or with a bias) (Linear at ")
    layers[0].merge()
    assert why_not_folded(model, None).startswith("not plain LoRA")
