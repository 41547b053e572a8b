"""The fast training path changes no result: for the same samples, the vision cache, token-budget
micro-batches (packed rows with per-sample positions and attention, or padded groups of similar
length with positions from the host and no padding mask), and the fused head + loss give the loss
and LoRA gradients of the plain path (pixels through the vision tower, padded batches with their
attention mask, full-vocabulary logits), for every Qwen-VL family."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import yaml

from vlft.forward.batching import collate, to_device, token_budget_batches
from vlft.demo.shapes import make_dataset
from vlft.errors import ConfigError
from vlft.files import read_jsonl
from vlft.caches.image_cache import ImageCache
from vlft.forward.loss import answer_loss_sum, linear_cross_entropy_sum
from vlft.modeling import load_base_model, load_tokenizer, rope_index, unwrapped, with_new_adapter
from vlft.forward.packing import pack, packed_attention, packed_batches, use_packed_attention
from vlft.data.prompts import PromptBuilder
from vlft.modeling import compile_decoder_layers
from vlft.caches.vision_cache import VisionCache, build_vision_cache, estimate_bytes, use_vision_cache
from vlft.demo.tiny_model import FAMILIES, HYBRID_FAMILIES, MOE_FAMILIES
from vlft.training.census import part_of
from tests.helpers import FLOAT64_RTOL, assert_close_normwise, image_groups_rtol, tiny_family_data, train_float64

FLOAT64 = torch.float64
LORA = {
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "vision_lora": False,
    "train_merger": False,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module", params=FAMILIES + HYBRID_FAMILIES + MOE_FAMILIES)
def family_setup(request, tmp_path_factory):
    """A tiny model of one family, 12 demo records of varied answer lengths, and their pixel cache."""
    root = tmp_path_factory.mktemp(request.param)
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 12}, seed=1)
    return tiny_family_data(root, request.param, root / "train.jsonl")


def lora_model(model_dir, dtype=FLOAT64, lora=LORA):
    torch.manual_seed(0)
    model = with_new_adapter(load_base_model(model_dir, torch.device("cpu"), dtype), lora)
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
    samples = [
        builder.sample(
            r["id"],
            r,
            r["answer"] + " because" * (3 * i),
            cache.num_image_tokens(cache.image_of(r["id"])),
            1024,
        )
        for i, r in enumerate(records)
    ]
    return samples, {r["id"]: (cache, cache.image_of(r["id"])) for r in records}, builder, tokenizer.pad_token_id


def plain_loss_sum(model, batch):
    """The reference: full-vocabulary logits from the model's own forward, summed cross-entropy."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1]
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
    cpu = torch.device("cpu")

    # Plain: one padded batch of pixels, full logits.
    model.zero_grad()
    batch = to_device(collate(samples, pixel_images, builder, pad_id), cpu, FLOAT64)
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
        loss, n = answer_loss_sum(fast_model, to_device(fast_batch, cpu, FLOAT64))
        (loss / n_targets).backward()
        fast, counted = fast + loss.item(), counted + n
    # In float64, where the layouts' different orders of summation stay far below the tolerance.
    assert counted == n_targets
    assert fast == pytest.approx(plain.item(), rel=FLOAT64_RTOL)
    for name, grad in plain_grads.items():
        assert_close_normwise(dict(fast_model.named_parameters())[name].grad, grad, FLOAT64_RTOL, name)


def test_chunked_fallback_equals_full_logits_cross_entropy():
    """The chunked head and loss in float32, against the exact values (float64, from the same
    inputs), within the error bound of float32 arithmetic: a sum of n terms, in any order, is within
    gamma(n) = n*u / (1 - n*u) of the sum of the terms' magnitudes, u = 2^-24 (Higham, Accuracy and
    Stability of Numerical Algorithms, ch. 3). The bound holds on any CPU, whatever its kernels."""
    torch.manual_seed(0)
    rows, width, vocab = 2500, 32, 300
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    fused = linear_cross_entropy_sum(hidden, weight, targets)
    fused.backward()

    def gamma(n):
        u = 2.0**-24
        return n * u / (1 - n * u)

    h, w = hidden.detach().double(), weight.detach().double()
    logits = h @ w.T
    probs, onehot = logits.softmax(-1), torch.nn.functional.one_hot(targets, vocab).double()
    log_normalizer = logits.logsumexp(-1)
    per_row = log_normalizer - logits.gather(1, targets[:, None])[:, 0]
    exact = {"loss": per_row.sum(), "hidden": (probs - onehot) @ w, "weight": (probs - onehot).T @ h}
    # Each logit is a sum of `width` products; a row's probabilities then move by at most twice its
    # largest logit error, plus the roundings of the exponentials and their sum over the vocabulary.
    logit_error = gamma(width) * (h.abs() @ w.abs().T)
    row_error = logit_error.max(-1).values
    prob_error = probs * (2 * row_error + gamma(vocab + 2))[:, None]
    residual = (probs - onehot).abs()
    bound = {
        "loss": (2 * row_error + gamma(vocab + 2) * log_normalizer.abs()).sum() + gamma(rows) * per_row.abs().sum(),
        "hidden": gamma(vocab + 1) * residual @ w.abs() + prob_error @ w.abs(),
        "weight": gamma(rows + 1) * residual.T @ h.abs() + prob_error.T @ h.abs(),
    }
    got = {"loss": fused.detach(), "hidden": hidden.grad, "weight": weight.grad}
    for name in exact:
        error = (got[name].double() - exact[name]).abs()
        assert (error <= bound[name]).all(), f"{name}: {(error / bound[name]).max():.2f} of the bound"
        # The bound is tight enough to matter: far below the values it bounds.
        assert (bound[name] <= 1e-3 * exact[name].abs().max()).all(), name


def test_vision_cache_larger_than_its_budget_is_refused_before_anything_runs(family_setup, tmp_path):
    root = family_setup
    model = load_base_model(root / "model", torch.device("cpu"), torch.float32)
    size = estimate_bytes(ImageCache(root / "pixels"), model.config, torch.float32)
    with pytest.raises(ConfigError, match="vision_cache_max_gb"):
        build_vision_cache(root / "pixels", model, tmp_path / "vision", max_gb=size / 2e9, device=torch.device("cpu"))
    assert not (tmp_path / "vision").exists()
    build_vision_cache(
        root / "pixels", model, tmp_path / "vision", max_gb=size * 1.01 / 1e9, device=torch.device("cpu")
    )
    on_disk = sum(p.stat().st_size for p in (tmp_path / "vision").glob("*.safetensors"))
    assert size <= on_disk < size * 1.05


def demo_stage_inputs(demo_workdir, cache: str):
    from vlft.training.train import StageInputs

    return StageInputs(
        str(demo_workdir / "results/demo/tiny-qwen3-vl"),
        [str(demo_workdir / "results/prepared/shapes/train.jsonl")],
        [cache],
        None,
    )


def demo_stage_losses(demo_workdir, out, inputs, **overrides) -> list[float]:
    """The demo's exp1 stage trained in float64 for a few steps; its logged losses."""
    from vlft.plan import build_plan

    plan = build_plan(yaml.safe_load((demo_workdir / "config/config.yaml").read_text()))
    train_float64(inputs, dict(plan.stage("exp1", "main").train_params(), **overrides), out)
    return [row["loss"] for row in read_jsonl(out / "log.jsonl")]


def test_a_stage_trained_from_the_vision_cache_follows_the_pixel_trained_loss_curve(demo_workdir, tmp_path):
    import shutil

    from tests.helpers import planned_outputs, snakemake

    # Through the workflow: the stage asks for the split's vision cache, and trains from it as the
    # pixel-trained stage did (float32 here: the same steps, and the loss falls as far).
    workdir = tmp_path / "work"
    shutil.copytree(demo_workdir, workdir, symlinks=True)
    config_file = workdir / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["exp1"]["stages"][0]["vision_cache"] = True
    config_file.write_text(yaml.safe_dump(config))
    planned = planned_outputs(workdir, "--cores", "2", "results/train/exp1/main/log.jsonl")
    assert planned == {"results/cache/vision/shapes/train/4096-16384", "results/train/exp1/main/adapter"}
    snakemake(workdir, "--cores", "2", "results/train/exp1/main/log.jsonl")
    from_pixels, from_vision_cache = (
        [row["loss"] for row in read_jsonl(root / "results/train/exp1/main/log.jsonl")]
        for root in (demo_workdir, workdir)
    )
    assert len(from_pixels) == len(from_vision_cache) > 100
    assert from_vision_cache[-1] < from_vision_cache[0] / 3 and from_pixels[-1] < from_pixels[0] / 3

    # The same loss curve, step by step, in float64: the cached features are the tower's own outputs.
    model = load_base_model(demo_workdir / "results/demo/tiny-qwen3-vl", torch.device("cpu"), FLOAT64)
    pixels = str(demo_workdir / "results/cache/images/shapes/train/4096-16384")
    build_vision_cache(pixels, model, tmp_path / "vision", max_gb=1, device=torch.device("cpu"))
    steps = dict(max_steps=12)
    from_pixels = demo_stage_losses(demo_workdir, tmp_path / "pixels", demo_stage_inputs(demo_workdir, pixels), **steps)
    from_vision_cache = demo_stage_losses(
        demo_workdir, tmp_path / "cached", demo_stage_inputs(demo_workdir, str(tmp_path / "vision")), **steps
    )
    assert len(from_pixels) == 12
    assert from_vision_cache == pytest.approx(from_pixels, rel=FLOAT64_RTOL)
    # A stage whose tower trains cannot read the frozen tower's outputs: given them, it stops at once.
    with pytest.raises(
        ConfigError, match="trains the vision tower's LoRA or the merger, but was given the vision cache"
    ):
        demo_stage_losses(
            demo_workdir,
            tmp_path / "tower",
            demo_stage_inputs(demo_workdir, str(tmp_path / "vision")),
            vision_lora=True,
        )
    assert not (tmp_path / "tower" / "adapter").exists()


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
    # bf16 rounds each result to 8 significant bits, within 2^-9 (0.2%); float32's own rounding is
    # 2^16 times finer. Any value of this 2-layer model passes fewer than 10 such roundings on its
    # way to the loss (embedding, norms, attention, MLP, head): within 10 * 2^-9, 2%. A gradient
    # passes them forward and back, 25 * 2^-9 (5%) as a whole tensor, since single elements that
    # cancel to near zero carry their terms' rounding.
    assert loss16 == pytest.approx(loss32, rel=10 * 2**-9)
    for name, grad in grads32.items():
        assert_close_normwise(grads16[name], grad, 25 * 2**-9, name)


def test_packed_batches_fill_rows_under_the_budget_and_keep_every_sample():
    from vlft.data.prompts import Sample

    lengths = [900, 120, 700, 300, 2500, 650, 80, 400]
    samples = [Sample(str(i), [0] * n, [-100] * n, n) for i, n in enumerate(lengths)]
    rows = packed_batches(samples, 1000)
    assert sorted(s.record_id for row in rows for s in row) == [str(i) for i in range(len(lengths))]
    # The 2,500-token sample alone; every other row within the budget; first fit by decreasing
    # length needs no more rows than the total length asks for.
    assert [s.record_id for s in rows[0]] == ["4"]
    assert all(sum(len(s.input_ids) for s in row) <= 1000 for row in rows[1:])
    assert len(rows) == 1 + -(-sum(lengths[:4] + lengths[5:]) // 1000)


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_attention_attends_within_each_sample_only(device, shared_prefix):
    """Against SDPA with an explicit mask over the row, forward and backward; 8 query heads share
    2 key/value heads, as in Qwen-VL. On a GPU in bf16 this is the variable-length flash kernel.
    With a shared prefix (an image group, vlft.forward.image_groups): a 6-token prefix laid out with the
    first of three samples, the other two after it attending to the prefix and causally to
    themselves, then a sample alone."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else FLOAT64
    if shared_prefix:
        prefix, own = 6, [4, 3, 5]
        lengths = [prefix + own[0], own[1], own[2], 7]  # query segments as pack_groups lays them out
        key_ranges = [[(0, 10)], [(0, 6), (10, 13)], [(0, 6), (13, 18)], [(18, 25)]]
    else:
        lengths = [5, 17, 1, 9]
        bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
        key_ranges = [[(a, b)] for a, b in zip(bounds[:-1], bounds[1:])]
    total = sum(lengths)
    query = torch.randn(1, 8, total, 64, device=device, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0, dtype=torch.int32)
    extra = {}
    if shared_prefix:
        key_lengths = [sum(b - a for a, b in ranges) for ranges in key_ranges]
        extra = {
            "packed_key_index": torch.cat([torch.arange(a, b) for ranges in key_ranges for a, b in ranges]).to(device),
            "packed_cu_seqlens_k": torch.tensor([0] + key_lengths, device=device).cumsum(0, dtype=torch.int32),
            "packed_max_seqlen_k": max(key_lengths),
        }
    packed, _ = packed_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=0.125,
        packed_cu_seqlens=cu_seqlens,
        packed_max_seqlen=max(lengths),
        **extra,
    )
    # The mask over the row itself: a query sees the keys of its segment's ranges up to itself.
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    bounds = cu_seqlens.tolist()
    for segment, ranges in enumerate(key_ranges):
        for position in range(bounds[segment], bounds[segment + 1]):
            for a, b in ranges:
                mask[position, a : min(b, position + 1)] = True
    reference = torch.float32 if dtype == torch.bfloat16 else dtype  # the bf16 values, computed exactly enough
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(x.to(reference).repeat_interleave(1 if x is query else 4, dim=1) for x in (query, key, value)),
        attn_mask=mask,
        scale=0.125,
    ).transpose(1, 2)
    assert packed.shape == (1, total, 8, 64)
    gradients = torch.autograd.grad(packed.to(reference).square().sum(), (query, key, value))
    expected_gradients = torch.autograd.grad(expected.square().sum(), (query, key, value))
    for got, want in zip((packed, *gradients), (expected, *expected_gradients)):
        if dtype == torch.bfloat16:
            # The kernel reads the same bf16 values, accumulates in float32 and rounds to bf16
            # (2^-9 each time) the attention weights and its output; backward also the incoming
            # gradient and two intermediates: at most 5 roundings, 5 * 2^-9 (1%) as whole
            # tensors. One sample's leak into another would be of order 1.
            assert_close_normwise(got, want, 5 * 2**-9)
        else:
            assert_close_normwise(got, want, FLOAT64_RTOL)


def test_training_on_packed_rows_follows_the_padded_loss_curve(demo_workdir, tmp_path):
    """The training loop itself: a stage trained on packed rows and the same stage on padded
    micro-batches under the same token budget log the same losses step by step (in float64)."""
    # Demo samples are 27 to 29 tokens: 8 a step, in 3 micro-batches either way.
    settings = dict(max_steps=12, micro_batch=4, grad_accum=2, max_batch_tokens=100)
    inputs = demo_stage_inputs(demo_workdir, str(demo_workdir / "results/cache/images/shapes/train/4096-16384"))
    packed, padded = (
        demo_stage_losses(demo_workdir, tmp_path / f"packing-{packing}", inputs, packing=packing, **settings)
        for packing in (True, False)
    )
    assert len(packed) == 12
    assert packed == pytest.approx(padded, rel=FLOAT64_RTOL)


# Records of the grouped fixture by the image they ask about: groups of 5, 3, 2, 1 and 1 questions.
IMAGE_OF_RECORD = [0, 0, 0, 0, 0, 5, 5, 5, 8, 8, 10, 11]


@pytest.fixture(scope="module", params=FAMILIES + HYBRID_FAMILIES + MOE_FAMILIES)
def grouped_family_setup(request, tmp_path_factory):
    """A tiny model of one family and 12 records asking 1 to 5 questions each about 5 images of
    three sizes (the questions of one image differ, as Kvasir's do; some with a history or a system
    prompt), prepared and pixel-cached."""
    from PIL import Image

    root = tmp_path_factory.mktemp(f"grouped-{request.param}")
    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 12}, seed=2)
    records = read_jsonl(root / "raw.jsonl")
    for record, owner in zip(records, IMAGE_OF_RECORD):
        record["image"] = records[owner]["image"] if owner < record_index(records, record) else record["image"]
    # Conversations too: two questions of the first image carry earlier rounds (history), and the
    # second image's questions a system prompt; the image still comes first in what they share.
    records[1]["history"] = [{"question": "What is in the image?", "answer": "Shapes."}]
    records[2]["history"] = [{"question": "How many?", "answer": "Two."}, {"question": "Colour?", "answer": "Red."}]
    for index in (5, 6, 7):
        records[index]["system"] = "Answer briefly."
    for owner, size in ((5, (128, 64)), (8, (64, 112))):  # other sizes than the demo's 96 x 96
        path = root / "images" / records[owner]["image"]
        Image.open(path).resize(size).save(path)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tiny_family_data(root, request.param, root / "train.jsonl")


def record_index(records, record):
    return next(i for i, r in enumerate(records) if r is record)


@pytest.mark.parametrize("source", ["pixels", "vision cache", "trained tower"])
def test_image_groups_give_each_question_the_loss_and_gradients_it_gets_alone(grouped_family_setup, source):
    """A grouped step: every image's prefix (template header and image) once, its questions after
    it, in packed rows with the fused loss, the largest group cut across rows by the token budget;
    against every sample computed separately on the plain path, in float64 with lora_dropout 0.
    With a trained tower (LoRA on its blocks, the mergers trained in full) the tower still runs
    once per image, and its gradients are the sum of each question's alone."""
    from vlft.forward.image_groups import ImageGroup, group_rows
    from vlft.training.steps import groups_in_order, image_of
    from vlft.forward.packing import pack_groups

    root = grouped_family_setup
    pixels = ImageCache(root / "pixels")
    assert len(pixels.entries) == 5 and len(pixels.records) == 12  # the cache holds each image once
    trained_tower = source == "trained tower"
    model = lora_model(root / "model", lora=LORA | {"vision_lora": trained_tower, "train_merger": trained_tower})
    samples, pixel_images, builder, pad_id = samples_and_images(root, pixels)
    cpu = torch.device("cpu")

    # Plain: each sample in a row of its own (a padded batch with its mask), pixels, full logits.
    model.zero_grad()
    batch = to_device(collate(samples, pixel_images, builder, pad_id), cpu, FLOAT64)
    plain = plain_loss_sum(model, batch)
    n_targets = int((batch["labels"][:, 1:] != -100).sum())
    (plain / n_targets).backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    tower_grads = [g for n, g in plain_grads.items() if "visual." in n]
    assert bool(tower_grads) == trained_tower and all(g.abs().sum() > 0 for g in tower_grads)
    if trained_tower:  # LoRA on every block's linear layers, and each merger (DeepStack's too) in full
        parts = {part_of(n) for n in plain_grads}
        assert parts == {"LoRA adapter", "vision LoRA adapter", "merger"}, parts
        left_out = [
            n
            for n, m in model.named_modules()
            if "visual.blocks" in n and type(m) is torch.nn.Linear and not re.search(r"lora_[AB]|base_layer", n)
        ]
        assert not left_out, left_out  # every linear layer of the tower's blocks carries LoRA

    grouped_model = copy.deepcopy(model)
    images = pixel_images
    if source == "vision cache":
        build_vision_cache(root / "pixels", model.get_base_model(), root / "vision", max_gb=1, device=cpu)
        vision = VisionCache(root / "vision")
        use_vision_cache(grouped_model)
        images = {key: (vision, image_id) for key, (_, image_id) in pixel_images.items()}
    use_packed_attention(grouped_model)
    grouped_model.zero_grad()
    tower_calls = []
    grouped_model.get_base_model().model.visual.register_forward_hook(
        lambda m, args, kwargs, out: tower_calls.append(kwargs.get("grid_thw", args[1:2] and args[1])),
        with_kwargs=True,
    )

    by_id = {s.record_id: s for s in samples}
    records = [{"key": s.record_id} for s in samples]
    groups = [ImageGroup.of([by_id[r["key"]] for r in g]) for g in groups_in_order(records, image_of(images))]
    assert [len(g.samples) for g in groups] == [5, 3, 2, 1, 1]
    # The shared prefix holds the whole image: header, vision start, image tokens, vision end.
    image_tokens = [pixels.num_image_tokens(pixels.image_of(g.samples[0].record_id)) for g in groups[:3]]
    assert all(g.shared >= n + 3 for g, n in zip(groups, image_tokens))
    budget = groups[0].tokens - 1  # the 5-question group cannot stay whole
    rows = group_rows(groups, budget, None)
    assert all(sum(g.tokens for g in row) <= budget for row in rows) and len(rows) > 1
    parts = [g for row in rows for g in row]
    assert sorted(len(g.samples) for g in parts if g.samples[0] in groups[0].samples)[-1] < 5
    assert sorted(s.record_id for g in parts for s in g.samples) == sorted(by_id)

    loss_sum, counted, laid_out = 0.0, 0, 0
    for row in rows:
        host = pack_groups(row, images, builder, rope_index(grouped_model))
        assert host["input_ids"].shape[1] == sum(g.tokens for g in row)
        loss, n = answer_loss_sum(grouped_model, to_device(host, cpu, FLOAT64))
        (loss / n_targets).backward()
        loss_sum, counted, laid_out = loss_sum + loss.item(), counted + n, laid_out + host["input_ids"].shape[1]
    # The tower (or the cache standing in for it) saw each group part's image once.
    assert sum(len(grids) for grids in tower_calls) == len(parts)
    # Every prefix laid out once per group part, nothing else left out.
    assert laid_out == sum(len(s.input_ids) for s in samples) - sum((len(g.samples) - 1) * g.shared for g in parts)
    assert counted == n_targets
    family = json.loads((root / "model" / "config.json").read_text())["model_type"]
    rtol = image_groups_rtol(family, max(len(g.samples) for g in parts), trained_tower)
    assert loss_sum == pytest.approx(plain.item(), rel=rtol)
    for name, grad in plain_grads.items():
        assert_close_normwise(dict(grouped_model.named_parameters())[name].grad, grad, rtol, name)


def test_a_packed_row_computes_each_prompts_positions_once_and_gives_every_sample_its_own(grouped_family_setup):
    """A reward stage's answers to one question (or a preference pair's two) share its prompt: a
    packed row computes the prompt's M-RoPE positions once for them, and each sample's positions
    are those of the model's own function over the sample alone, integer for integer; a sample with
    an image after its prompt gets the function's positions over it whole."""
    from dataclasses import replace

    from vlft.data.prompts import Sample
    from vlft.forward.image_groups import ImageGroup
    from vlft.forward.packing import pack_groups

    root = grouped_family_setup
    samples, images, builder, _ = samples_and_images(root, ImageCache(root / "pixels"))
    index = rope_index(lora_model(root / "model"))
    asked = []
    for sample in samples[:6]:  # five questions on one image, one on another
        prompt = sample.input_ids[: sample.prompt_length]
        for n, more in enumerate(([], [7], [7, 8, 9])):  # three answers of their own lengths
            ids = sample.input_ids + more
            images[f"{sample.record_id}#{n}"] = images[sample.record_id]
            asked.append(Sample(f"{sample.record_id}#{n}", ids, [-100] * len(prompt) + ids[len(prompt) :], len(prompt)))
    images["whole"] = images[samples[0].record_id]
    asked.append(replace(samples[0], record_id="whole", prompt_length=1))  # its "answer" holds the image
    calls = []

    def counted(**inputs):
        calls.append(inputs["input_ids"].shape[1])
        return index(**inputs)

    row = pack_groups([ImageGroup([s], 0) for s in asked], images, builder, counted)
    start = 0
    for sample in asked:
        alone = collate([sample], images, builder, pad_id=0, rope_index=index)["position_ids"]
        assert torch.equal(row["position_ids"][..., start : start + alone.shape[-1]], alone), sample.record_id
        start += alone.shape[-1]
    assert start == row["position_ids"].shape[-1]
    # Once a prompt on its image (two records of the fixture ask the same question of one image), and
    # the sample whose image follows its prompt, whole.
    prompts = {(tuple(s.input_ids[: s.prompt_length]), images[s.record_id][1]): s.prompt_length for s in samples[:6]}
    assert len(prompts) >= 4 and sorted(calls) == sorted([*prompts.values(), len(samples[0].input_ids)])

    # Laid out as image groups, each sample after a group's first collated without the prefix it
    # shares: its tokens, labels and positions past the prefix are those it has alone, and each
    # answer position is followed in the row by the token it predicts.
    by_image: dict = {}
    for sample in asked[:-1]:
        by_image.setdefault(images[sample.record_id][1], []).append(sample)
    groups = [ImageGroup.of(group) for group in by_image.values()]
    assert all(group.shared > 0 for group in groups)
    row = pack_groups(groups, images, builder, index)
    start = 0
    for group in groups:
        for n, sample in enumerate(group.samples):
            alone = collate([sample], images, builder, pad_id=0, rope_index=index)
            drop = group.shared if n else 0
            for key in ("input_ids", "labels", "position_ids"):
                own = alone[key][..., drop:]
                assert torch.equal(row[key][..., start : start + own.shape[-1]], own), (key, sample.record_id)
            start += len(sample.input_ids) - drop
    assert start == row["input_ids"].shape[-1]
    assert len(row["answer_targets"]) == sum(len(s.input_ids) - s.prompt_length for s in asked[:-1])
    assert torch.equal(row["input_ids"][0, row["answer_positions"] + 1], row["answer_targets"])


def test_compiled_decoder_layers_take_no_python_float_as_a_cpu_tensor(tiny_model_dir):
    """With dynamic shapes dynamo would pass LoRA's scaling and the norms' epsilon into each layer's
    graph as float64 CPU tensors, and inductor would compile a C++ kernel for them: in a GPU job, a
    C++ compiler run and a CPU instruction-set probe on every load of the cached graph. The graphs
    the layers compile to take tensors of the model's dtype and integer sizes only, and every layer
    shares them (the first layer's input needs no gradient, so two graphs at most)."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append([(x.dtype, x.dim()) for x in example_inputs if isinstance(x, torch.Tensor)])
        return graph_module

    model = with_new_adapter(load_base_model(tiny_model_dir, torch.device("cpu"), torch.float32), LORA)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=False):  # dynamo's default; set by the call below
        compile_decoder_layers(model, backend=recording_backend)
        for length in (7, 11):  # a second width: dynamic shapes, no recompile
            model(input_ids=torch.randint(10, 100, (2, length))).logits.sum().backward()
    torch._dynamo.reset()
    assert (
        1 <= len(graphs) <= 2
    ), f"{len(graphs)} graphs for {len(model.base_model.model.model.language_model.layers)} layers"
    for inputs in graphs:
        assert (torch.float64, 0) not in inputs, f"a Python float became a float64 CPU tensor input: {inputs}"
        assert {dtype for dtype, _ in inputs} <= {torch.float32, torch.int64}, inputs


def test_activation_checkpointing_gives_the_same_loss_and_gradients(family_setup):
    """Recomputing each layer in the backward pass changes memory, not the result: packed rows of
    pixels, in float64, with and without it."""
    from vlft.modeling import use_activation_checkpointing

    root = family_setup
    pixels = ImageCache(root / "pixels")
    samples, images, builder, _ = samples_and_images(root, pixels)
    results = []
    for checkpointing in (False, True):
        model = lora_model(root / "model")
        use_packed_attention(model)
        if checkpointing:
            use_activation_checkpointing(model)
        model.train()
        batches = [pack(group, images, builder, rope_index(model)) for group in packed_batches(samples, 2048)]
        total = 0.0
        for batch in batches:
            loss, _ = answer_loss_sum(model, to_device(batch, torch.device("cpu"), FLOAT64))
            loss.backward()
            total += loss.item()
        layers = unwrapped(model).model.language_model.layers
        assert all(layer.gradient_checkpointing == checkpointing for layer in layers)
        results.append((total, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (plain, plain_grads), (checkpointed, grads) = results
    assert checkpointed == pytest.approx(plain, rel=FLOAT64_RTOL)
    for name, grad in plain_grads.items():
        assert_close_normwise(grads[name], grad, FLOAT64_RTOL, name)
