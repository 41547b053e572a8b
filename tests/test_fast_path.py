"""The fast training path changes no result: for the same samples, the vision cache, token-budget
micro-batches (packed rows with per-sample positions and attention, or padded groups of similar
length with positions from the host and no padding mask), and the fused head + loss give the loss
and LoRA gradients of the plain path (pixels through the vision tower, padded batches with their
attention mask, full-vocabulary logits), for every Qwen-VL family."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from vlft.batching import collate, to_device, token_budget_batches
from vlft.demo.shapes import make_dataset
from vlft.errors import ConfigError
from vlft.files import read_jsonl
from vlft.image_cache import ImageCache, PixelSettings, build_image_cache
from vlft.loss import answer_loss_sum, linear_cross_entropy_sum
from vlft.modeling import load_base_model, load_image_processor, load_tokenizer, rope_index, with_new_adapter
from vlft.packing import pack, packed_attention, packed_batches, use_packed_attention
from vlft.prompts import PromptBuilder
from vlft.records import prepare_split
from vlft.vision_cache import VisionCache, build_vision_cache, estimate_bytes, use_vision_cache
from vlft.demo.tiny_model import FAMILIES, make_tiny_model

# fp32 on the CPU: the paths differ only in summation order.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module", params=FAMILIES)
def family_setup(request, tmp_path_factory):
    """A tiny model of one family, 12 demo records of varied answer lengths, and their pixel cache."""
    root = tmp_path_factory.mktemp(request.param)
    make_tiny_model(root / "model", family=request.param)
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 12}, seed=1)
    prepare_split(root / "train.jsonl", root / "images", root / "prepared.jsonl")
    settings = PixelSettings.from_processor(load_image_processor(root / "model"), 4096, 16384)
    build_image_cache(root / "prepared.jsonl", root / "pixels", settings)
    return root


def lora_model(model_dir):
    torch.manual_seed(0)
    model = with_new_adapter(load_base_model(model_dir, torch.device("cpu"), torch.float32), LORA)
    # Non-zero B matrices, so that every LoRA gradient is non-trivial.
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return model


def samples_and_images(root, cache):

    tokenizer = load_tokenizer(root / "model")
    model_config = load_base_model(root / "model", torch.device("cpu"), torch.float32).config
    builder = PromptBuilder(tokenizer, model_config.image_token_id)
    records = read_jsonl(root / "prepared.jsonl")
    samples = [builder.sample(r["id"], r["question"], r["answer"] + " because" * (3 * i), cache.num_image_tokens(r["id"]), 1024)
               for i, r in enumerate(records)]
    return samples, {r["id"]: (cache, r["id"]) for r in records}, builder, tokenizer.pad_token_id


def plain_loss_sum(model, batch):
    """The reference: full-vocabulary logits from the model's own forward, summed cross-entropy."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


@pytest.mark.parametrize("layout", ["packed", "grouped"])
def test_cached_budgeted_fused_path_gives_the_plain_paths_loss_and_gradients(family_setup, layout):
    root = family_setup
    pixels = ImageCache(root / "pixels")
    model = lora_model(root / "model")
    build_vision_cache(root / "pixels", model.get_base_model(), root / "vision", max_gb=1, device=torch.device("cpu"))
    vision = VisionCache(root / "vision")
    samples, pixel_images, builder, pad_id = samples_and_images(root, pixels)
    cpu, fp32 = torch.device("cpu"), torch.float32

    # Plain: one padded batch of pixels, full logits.
    model.zero_grad()
    batch = to_device(collate(samples, pixel_images, builder, pad_id), cpu, fp32)
    assert "attention_mask" in batch and "position_ids" not in batch  # the model's own masking and positions
    plain = plain_loss_sum(model, batch)
    n_targets = int((batch["labels"][:, 1:] != -100).sum())
    (plain / n_targets).backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g.abs().sum() > 0 for g in plain_grads.values())

    # Fast: the vision tower replaced by its cached outputs, micro-batches under a token budget.
    fast_model = copy.deepcopy(model)
    use_vision_cache(fast_model)
    fast_model.zero_grad()
    vision_images = {key: (vision, image_id) for key, (_, image_id) in pixel_images.items()}
    budget = max(len(s.input_ids) for s in samples) * 3
    if layout == "packed":
        use_packed_attention(fast_model)
        groups = packed_batches(samples, budget)
        assert all(sum(len(s.input_ids) for s in g) <= budget for g in groups)
    else:
        groups = token_budget_batches(samples, budget)
        assert all(len(g) * max(len(s.input_ids) for s in g) <= budget for g in groups)
    assert len(groups) > 1 and sorted(s.record_id for g in groups for s in g) == sorted(s.record_id for s in samples)
    fast, counted = 0.0, 0
    for group in groups:
        # Positions from the host and no attention mask, as the training loop does.
        if layout == "packed":
            fast_batch = pack(group, vision_images, builder, rope_index(fast_model))
            assert fast_batch["input_ids"].shape == (1, sum(len(s.input_ids) for s in group))
        else:
            fast_batch = collate(group, vision_images, builder, pad_id, rope_index=rope_index(fast_model))
        assert "position_ids" in fast_batch and "attention_mask" not in fast_batch
        loss, n = answer_loss_sum(fast_model, to_device(fast_batch, cpu, fp32))
        (loss / n_targets).backward()
        fast, counted = fast + loss.item(), counted + n
    assert counted == n_targets
    assert fast == pytest.approx(plain.item(), rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(dict(fast_model.named_parameters())[name].grad, grad, **TOLERANCE, msg=name)


def test_chunked_fallback_equals_full_logits_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(2500, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (2500,))
    fused = linear_cross_entropy_sum(hidden, weight, targets)
    fused.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grads[0], hidden.grad, **TOLERANCE)
    torch.testing.assert_close(grads[1], weight.grad, **TOLERANCE)


def test_vision_cache_larger_than_its_budget_is_refused_before_anything_runs(family_setup, tmp_path):
    root = family_setup
    model = load_base_model(root / "model", torch.device("cpu"), torch.float32)
    size = estimate_bytes(ImageCache(root / "pixels"), model.config, torch.float32)
    with pytest.raises(ConfigError, match="vision_cache_max_gb"):
        build_vision_cache(root / "pixels", model, tmp_path / "vision", max_gb=size / 2e9, device=torch.device("cpu"))
    assert not (tmp_path / "vision").exists()
    build_vision_cache(root / "pixels", model, tmp_path / "vision", max_gb=size * 1.01 / 1e9, device=torch.device("cpu"))
    on_disk = sum(p.stat().st_size for p in (tmp_path / "vision").glob("*.safetensors"))
    assert size <= on_disk < size * 1.05


def test_a_stage_trained_from_the_vision_cache_follows_the_pixel_trained_loss_curve(demo_workdir, tmp_path):
    import shutil

    from conftest import planned_outputs, snakemake

    workdir = tmp_path / "work"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    config_file = workdir / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["exp1"]["stages"][0]["vision_cache"] = True
    config_file.write_text(yaml.safe_dump(config))
    planned = planned_outputs(workdir, "--cores", "2", "results/train/exp1/main/log.jsonl")
    assert planned == {"results/cache/vision/shapes/train/4096-16384", "results/train/exp1/main/adapter"}
    snakemake(workdir, "--cores", "2", "results/train/exp1/main/log.jsonl")

    def losses(root):
        return [row["loss"] for row in read_jsonl(root / "results/train/exp1/main/log.jsonl")]

    from_pixels, from_vision_cache = losses(demo_workdir), losses(workdir)
    assert len(from_pixels) == len(from_vision_cache) > 100
    assert from_vision_cache == pytest.approx(from_pixels, rel=1e-3, abs=1e-4)


def test_lora_in_bf16_uses_float32_weights_in_bf16_and_keeps_float32_gradients(family_setup):
    """On a bf16 model the LoRA layers compute in bf16 from their float32 weights (no float32 copies
    of the activations), their gradients stay float32, and the loss and gradients are those of a
    float32 run within bf16 rounding."""
    from vlft.modeling import adapter_autocast

    root = family_setup
    pixels = ImageCache(root / "pixels")
    samples, images, builder, pad_id = samples_and_images(root, pixels)
    batch = collate(samples[:4], images, builder, pad_id)
    cpu = torch.device("cpu")

    def run(dtype):
        torch.manual_seed(0)
        model = with_new_adapter(load_base_model(root / "model", cpu, dtype), LORA)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.02)
        lora_dtypes = set()  # (input, output) of every LoRA A matmul
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_hook(lambda m, args, out: lora_dtypes.add((args[0].dtype, out.dtype)))
        with adapter_autocast(model, cpu, dtype):
            loss, n = answer_loss_sum(model, to_device(batch, cpu, dtype))
        (loss / n).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), grads, lora_dtypes

    loss32, grads32, dtypes32 = run(torch.float32)
    loss16, grads16, dtypes16 = run(torch.bfloat16)
    assert dtypes32 == {(torch.float32, torch.float32)} and dtypes16 == {(torch.bfloat16, torch.bfloat16)}
    assert all(g.dtype == torch.float32 for g in grads16.values())
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    # bf16 keeps 8 bits of mantissa: compare each gradient by its relative error as a whole.
    for name, grad in grads32.items():
        assert (grads16[name] - grad).norm() <= 0.05 * grad.norm(), name


def test_packed_batches_fill_rows_under_the_budget_and_keep_every_sample():
    from vlft.prompts import Sample

    lengths = [900, 120, 700, 300, 2500, 650, 80, 400]
    samples = [Sample(str(i), [0] * n, [-100] * n, n) for i, n in enumerate(lengths)]
    rows = packed_batches(samples, 1000)
    assert sorted(s.record_id for row in rows for s in row) == [str(i) for i in range(len(lengths))]
    # The 2,500-token sample alone; every other row within the budget; first fit by decreasing
    # length needs no more rows than the total length asks for.
    assert [s.record_id for s in rows[0]] == ["4"]
    assert all(sum(len(s.input_ids) for s in row) <= 1000 for row in rows[1:])
    assert len(rows) == 1 + -(-sum(lengths[:4] + lengths[5:]) // 1000)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_attention_attends_within_each_sample_only(device):
    """Against SDPA with a block-diagonal causal mask, forward and backward; 8 query heads share 2
    key/value heads, as in Qwen-VL. On a GPU in bf16 this is the variable-length flash kernel."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [5, 17, 1, 9]
    total = sum(lengths)
    query = torch.randn(1, 8, total, 64, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0, dtype=torch.int32)
    packed, _ = packed_attention(None, query, key, value, None, scaling=0.125, packed_cu_seqlens=cu_seqlens,
                                 packed_max_seqlen=max(lengths))
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    mask = causal & (sample[:, None] == sample[None, :])
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float().repeat_interleave(4, dim=1), value.float().repeat_interleave(4, dim=1),
        attn_mask=mask, scale=0.125,
    ).transpose(1, 2)
    assert packed.shape == (1, total, 8, 64)
    gradients = torch.autograd.grad(packed.float().square().sum(), (query, key, value))
    expected_gradients = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for got, want in zip((packed, *gradients), (expected, *expected_gradients)):
        if dtype == torch.bfloat16:
            # 8 bits of mantissa, and key/value gradients summed over many queries: compare each
            # tensor by its relative error as a whole (one sample's leak would be of order 1).
            assert (got.float() - want.float()).norm() <= 0.01 * want.float().norm()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_training_on_packed_rows_follows_the_padded_loss_curve(demo_workdir, tmp_path):
    """The training loop itself: a stage trained on packed rows and the same stage on padded
    micro-batches under the same token budget log the same losses step by step."""
    from vlft.plan import build_plan
    from vlft.train import StageInputs, train_stage

    plan = build_plan(yaml.safe_load((demo_workdir / "config/config.yaml").read_text()))
    # Demo samples are 27 to 29 tokens: 8 a step, in 3 micro-batches either way.
    settings = dict(plan.stage("exp1", "main").train_params(), max_steps=12, micro_batch=4, grad_accum=2,
                    max_batch_tokens=100)
    inputs = StageInputs(str(demo_workdir / "results/demo/tiny-qwen3-vl"),
                         [str(demo_workdir / "results/prepared/shapes/train.jsonl")],
                         [str(demo_workdir / "results/cache/images/shapes/train/4096-16384")], None)

    def losses(packing):
        out = tmp_path / f"packing-{packing}"
        train_stage(inputs, dict(settings, packing=packing), out / "adapter", out / "log.jsonl", out / "summary.json",
                    out / "checkpoints", 1000)
        return [row["loss"] for row in read_jsonl(out / "log.jsonl")]

    packed, padded = losses(True), losses(False)
    assert len(packed) == 12
    assert packed == pytest.approx(padded, rel=1e-4)
