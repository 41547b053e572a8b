"""Greedy answers of vlft.generation.engine (continuous batching over a slot cache, packed prefills) are
the token ids transformers' `generate` gives, for every Qwen-VL family, in float32 on the CPU:
with no adapter, an untrained one and a trained one, at several answer lengths, with rows
refilled while others still answer, several questions on one image prefilled with its prefix once."""

from __future__ import annotations

import math

import pytest
import torch

from vlft.forward.batching import NOT_MODEL_INPUTS, collate, to_device
from vlft.config import stage_defaults
from vlft.demo.shapes import make_dataset
from vlft.demo.tiny_model import FAMILIES
from vlft.files import read_jsonl, write_jsonl
from vlft.generation.evaluate import prompt_request, shared_prefixes
from vlft.forward.image_groups import ImageGroup
from vlft.generation.engine import answer_requests
from vlft.generation.kv_cache import KV_BLOCK, SlotCache, live_blocks, refresh_live_blocks
from vlft.generation.runner import DECODE_ATTENTION, DecodeStep, prefill
from vlft.generation.shared_prefixes import cascade_for
from vlft.modeling import language_model, load_base_model, load_tokenizer, with_adapter, with_new_adapter
from vlft.forward.packing import use_packed_attention
from vlft.data.prompts import PromptBuilder
from vlft.data.stage_data import load_stage_data
from vlft.modeling import compile_decoder_layers
from vlft.training.train import StageInputs, train_stage
from tests.helpers import assert_close_normwise, tiny_family_data, tiny_stage_settings

CPU, FLOAT32 = torch.device("cpu"), torch.float32
# Per sample, in turn: answers stopped after 2, 7 or 24 tokens (or at the end of the turn), so
# that rows finish at different steps and are refilled while the others answer.
LIMITS = (2, 7, 24)


# The image each record asks about, by record: 4, 3, 1, 2 and 4 questions on five images (of three
# sizes), in turn, as Kvasir asks several of each; the prefills share each image's prefix.
IMAGE_OF_RECORD = [0, 0, 0, 0, 4, 4, 4, 7, 8, 8, 10, 10, 10, 10]
IMAGE_SIZES = {4: (128, 64), 8: (64, 112)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """A tiny model of one family, 14 demo records asking 1 to 4 questions each about 5 images,
    their pixel cache, and an adapter trained on them (60 steps; its answers are the demo's, not
    the untrained model's)."""
    root = images_asked_about(tmp_path_factory.mktemp(request.param), request.param)
    settings = tiny_stage_settings(
        answer_format="cot", dataset="shapes", micro_batch=7, max_steps=60, learning_rate=3e-3
    )
    inputs = StageInputs(str(root / "model"), [str(root / "prepared.jsonl")], [str(root / "pixels")], None)
    stage = root / "stage"
    train_stage(inputs, settings, stage / "adapter", stage / "log.jsonl", stage / "summary.json", stage / "ckpt", 10**6)
    return request.param, root


def model_with(root, adapter: str):
    model = load_base_model(root / "model", CPU, FLOAT32)
    if adapter == "untrained":
        # A fresh adapter (B = 0) as a stage starts from: merged, the base model's weights again.
        model = with_new_adapter(model, {**stage_defaults(), "lora_r": 8, "lora_alpha": 16}).merge_and_unload()
    elif adapter == "trained":
        model = with_adapter(model, root / "stage/adapter", trainable=False).merge_and_unload()
    return model.eval()


def stage_data(root, model):
    """The tokenizer, prompt builder and records of the family's stage, as evaluation reads them."""
    tokenizer = load_tokenizer(root / "model")
    builder = PromptBuilder(tokenizer, model.config.image_token_id)
    data = load_stage_data(
        [str(root / "prepared.jsonl")], [str(root / "pixels")], builder, {}, answer_format="cot", max_seq_len=512
    )
    return tokenizer, builder, data


@pytest.mark.parametrize("adapter", ["none", "untrained", "trained"])
def test_answer_requests_are_generates_token_for_token(family, adapter):
    name, root = family
    assert_answers_are_generates(name, root, model_with(root, adapter), trained=adapter == "trained")


def images_asked_about(root, family: str):
    """A tiny model of `family` and 14 demo records asking 1 to 4 questions each about 5 images
    (IMAGE_OF_RECORD, of three sizes), prepared and pixel-cached in `root`."""
    from PIL import Image

    make_dataset({"train": root / "raw.jsonl"}, root / "images", {"train": 14}, seed=2)
    records = read_jsonl(root / "raw.jsonl")
    for record, owner in zip(records, IMAGE_OF_RECORD):
        record["image"] = records[owner]["image"]
    for owner, size in IMAGE_SIZES.items():
        path = root / "images" / records[owner]["image"]
        Image.open(path).resize(size).save(path)
    write_jsonl(root / "train.jsonl", records)
    return tiny_family_data(root, family, root / "train.jsonl")


def assert_answers_are_generates(name, root, model, trained: bool) -> None:
    """The engine's greedy answers to the records' prompts (rows refilled as answers end, prompts on
    one image prefilled with its prefix once; alone and scored) are `generate`'s, token for token."""
    tokenizer, builder, data = stage_data(root, model)
    samples = [data.samples[r["key"]] for r in data.records]
    pad_id, longest = tokenizer.pad_token_id, max(LIMITS)

    # The reference: left-padded batches of 5 through `generate`, as an evaluation script runs it;
    # greedy, so an answer stopped after n tokens is the first n of the longer one.
    reference = []
    with torch.no_grad():
        for start in range(0, len(samples), 5):
            prompts = collate(samples[start : start + 5], data.images, builder, pad_id, left_pad=True, prompt_only=True)
            prompts = {k: v for k, v in to_device(prompts, CPU, FLOAT32).items() if k not in NOT_MODEL_INPUTS}
            out = model.generate(
                **prompts,
                max_new_tokens=longest,
                do_sample=False,
                eos_token_id=builder.end_of_turn,
                pad_token_id=pad_id,
            )
            reference += out[:, prompts["input_ids"].shape[1] :].tolist()
    expected = {}
    for index, ids in enumerate(reference):
        ids = ids[: LIMITS[index % len(LIMITS)]]
        expected[index] = ids[: ids.index(builder.end_of_turn) + 1] if builder.end_of_turn in ids else ids

    def requests(scored: bool):
        for index, sample in enumerate(samples):
            limit = LIMITS[index % len(LIMITS)]
            yield prompt_request(index, sample, data, builder, pad_id, model, CPU, FLOAT32, limit, scored=scored)

    prompt_tokens = max(s.prompt_length for s in samples)
    on_image = {}
    for sample, image in zip(samples, IMAGE_OF_RECORD):
        on_image.setdefault(image, []).append(sample)
    # Prompts alone, and scored (each reference answer after its prompt in the prefill, its keys
    # not kept): the same answers either way.
    for scored in (False, True):
        answers, stats, losses = {}, {}, {}
        with torch.no_grad():
            # 4 rows for 14 samples; prefills of up to 3 prompts, or scored, up to the largest image group
            # (its samples' whole lengths: the budget does not cut it).
            answer_requests(
                model,
                requests(scored),
                slots=4,
                end_id=builder.end_of_turn,
                max_length=prompt_tokens + longest,
                on_answer=answers.__setitem__,
                prefill_tokens=(
                    max(sum(len(s.input_ids) for s in g) for g in on_image.values()) if scored else 3 * prompt_tokens
                ),
                stats=stats,
                on_loss=lambda key, loss, tokens: losses.__setitem__(key, tokens),
            )
        assert answers == expected, (name, scored)
        # Prompts on one image that met in a prefill shared its prefix: fewer tokens than the prompts.
        assert stats["prefill_tokens"] < sum(len(s.input_ids) if scored else s.prompt_length for s in samples)
        if scored:  # the questions on one image waited for rows to prefill together: each image once
            assert stats["prefill_tokens"] == sum(ImageGroup.of(group).tokens for group in on_image.values())
        assert losses == ({i: len(s.input_ids) - s.prompt_length for i, s in enumerate(samples)} if scored else {})
    lengths = [len(ids) for ids in answers.values()]
    assert len(set(lengths)) >= 3, lengths  # rows did finish at different steps
    if trained:  # the demo's chain of thought, ended by the model itself
        assert sum(ids[-1] == builder.end_of_turn for ids in answers.values()) >= 2
        assert any("Final answer" in tokenizer.decode(ids) for ids in answers.values())


def test_a_stage_evaluating_as_it_trains_runs_its_layers_as_an_evaluate_job(family):
    """Evaluating during training (vlft.training.step_evals), the stage's layers are compiled for its steps
    (vlft.modeling.compile_decoder_layers). The evaluation runs them as an evaluate job does, eagerly
    on a CPU: the same answers and losses, bit for bit, and nothing traced by the compiler (through
    a prefill's KV cache it traced each layer apart, past dynamo's limit of 8 recompiles on the
    GPU); the layers are compiled for the steps again after."""
    name, root = family
    model = model_with(root, "trained")
    tokenizer, builder, data = stage_data(root, model)
    samples = [data.samples[r["key"]] for r in data.records]
    layers = model.model.language_model.layers

    def answers_and_losses():
        answers, losses = {}, {}
        requests = (
            prompt_request(i, s, data, builder, tokenizer.pad_token_id, model, CPU, FLOAT32, 7, scored=True)
            for i, s in enumerate(samples)
        )
        with torch.no_grad():
            answer_requests(
                model,
                requests,
                slots=4,
                end_id=builder.end_of_turn,
                max_length=max(len(s.input_ids) for s in samples) + 7,
                on_answer=answers.__setitem__,
                on_loss=lambda key, loss, tokens: losses.__setitem__(key, (loss, tokens)),
            )
        return answers, losses

    expected = answers_and_losses()
    traced = []

    def tracing_backend(graph_module, example_inputs):
        traced.append(graph_module)
        return graph_module

    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=False):  # dynamo's default; set by the call below
        compile_decoder_layers(model, backend=tracing_backend)
        compiled = [layer._compiled_call_impl for layer in layers]
        assert all(compiled)
        assert answers_and_losses() == expected, name
    torch._dynamo.reset()
    assert traced == [], f"{name}: {len(traced)} graphs traced while evaluating"
    assert [layer._compiled_call_impl for layer in layers] == compiled


@pytest.mark.parametrize("attention", ["sdpa", DECODE_ATTENTION])
def test_a_decode_step_gives_the_logits_of_a_full_forward(family, attention):
    """Row 2 of 4 (the others idle) after a packed prefill, step by step against the model's own
    forward over the prompt and the answer so far: the cache, the mask and the position past the
    image are right, not just close enough to keep the argmax. Through transformers' SDPA, as a
    CPU runs the step, and through the GPU's attention (flex_attention over the live blocks,
    here its eager form, which applies the mask but reads every block)."""
    name, root = family
    model = model_with(root, "trained")
    tokenizer, builder, data = stage_data(root, model)
    request = prompt_request(0, data.samples[data.records[3]["key"]], data, builder, 0, model, CPU, FLOAT32, 8)
    inputs, positions = request.inputs, request.positions
    cache = SlotCache(model, 4, 256)
    with torch.no_grad():
        use_packed_attention(model)
        step = DecodeStep(model, cache, attention=attention)
        prefilled = prefill(model, [request])
        first, (prompt_length,) = prefilled.firsts[0], cache.fill([2], prefilled)
        step.tokens[2], step.positions[2] = first, positions.max() + 1
        ids = inputs["input_ids"][0].tolist() + [first]
        model.set_attn_implementation({"text_config": "sdpa"})
        for _ in range(8):
            got = step.logits()[2]
            full = model(
                **(
                    inputs
                    | {
                        "input_ids": torch.tensor([ids]),
                        "mm_token_type_ids": builder.mm_token_type_ids(torch.tensor([ids])),
                    }
                )
            ).logits[0, -1]
            # float32 (u = 6e-8) over sums of at most a few hundred terms in 2 layers: 1e-5 of the
            # logits' norm is far above rounding and far below a wrong position or a lost token.
            assert_close_normwise(got, full, rtol=1e-5, msg=f"{name}, {attention}, token {len(ids) - prompt_length}")
            token = int(got.argmax())
            ids.append(token)
            cache.write_at[2] += 1
            step.positions[2] += 1
            step.tokens[2] = token


def test_a_gpu_step_reads_each_rows_blocks_up_to_its_length_and_no_further():
    """The blocks flex_attention's kernel reads for each row (which its eager form above does not
    show) are those its mask leaves any position in, as flex_attention itself derives them from
    the mask: at block edges, for an idle row, and after the rows grow."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = 4 * KV_BLOCK
    write_at = torch.tensor([0, KV_BLOCK - 1, KV_BLOCK, 2 * KV_BLOCK + 5, length - 1])
    live = live_blocks(write_at, length)
    for grown in range(3):
        derived = create_block_mask(live.mask_mod, len(write_at), None, 1, length, device="cpu", BLOCK_SIZE=KV_BLOCK)
        # It names the blocks all of whose positions are in apart from those only some are.
        read = derived.kv_num_blocks + derived.full_kv_num_blocks
        assert live.kv_num_blocks.flatten().tolist() == read.flatten().tolist(), grown
        write_at[:-1] += KV_BLOCK // 2
        refresh_live_blocks(live, write_at)


# Inductor's C++ flex_attention takes no fused epilogue (Qwen3.5's gated output): on a CPU its
# layers compile with aot_eager, which traces as inductor does and runs torch's own ops.
@pytest.mark.parametrize("name, backend", [("qwen3_vl", "inductor"), ("qwen3_5", "aot_eager")])
def test_the_gpu_steps_attention_compiled_gives_the_cpu_steps_logits(tmp_path, name, backend):
    """The GPU's step as it runs there, its layers compiled (flex_attention's kernel, reading each
    row's live blocks only), against the CPU's eager SDPA step on the same cache: rows at lengths
    that end in the first, second, third and fourth block of 128, over random keys and values (and,
    for a hybrid model, random states of its linear-attention layers). One graph serves every layer
    of a kind: a recompile for a later layer is an error here."""
    from vlft.demo.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "model", family=name)
    model = load_base_model(tmp_path / "model", CPU, FLOAT32).eval()
    kinds = len(set(getattr(language_model(model).config, "layer_types", None) or ["full_attention"]))
    logits = {}
    for attention in ("sdpa", DECODE_ATTENTION):
        torch.manual_seed(0)
        cache = SlotCache(model, 4, 4 * KV_BLOCK)
        for tensor in cache.tensors:
            tensor.normal_()
        cache.write_at.copy_(torch.tensor([0, KV_BLOCK + 2, 2 * KV_BLOCK - 1, 3 * KV_BLOCK + 17]))
        step = DecodeStep(model, cache, compile=attention == DECODE_ATTENTION, backend=backend, attention=attention)
        step.tokens.copy_(torch.tensor([5, 17, 33, 2]))
        step.positions.copy_(cache.write_at + 40)
        torch._dynamo.reset()  # what earlier tests compiled of the step's layer call
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=kinds, fail_on_recompile_limit_hit=True):
            logits[attention] = step.logits()
        assert all(layer._compiled_call_impl is None for layer in language_model(model).layers)
    # float32 over sums of at most 401 terms in 2 layers, as in the full-forward test above; a
    # block read too few or too many changes a row's attention outright.
    assert_close_normwise(logits[DECODE_ATTENTION], logits["sdpa"], rtol=1e-5, msg="compiled flex step")


def test_the_evaluation_loss_is_the_plain_padded_computations(family, tmp_path, capsys):
    """The validation loss the evaluate rule reports (batches of 4, the head applied to answer
    tokens alone through the fused loss) is the model's own forward over one padded batch of all
    14 records, full logits, cross-entropy summed over the answer tokens and divided by their count.
    Its progress is one line on stderr, answers counted as they end."""
    from vlft.generation.evaluate import evaluate_split

    name, root = family
    settings = tiny_stage_settings(answer_format="cot", dataset="shapes", max_seq_len=512)
    settings = {k: settings[k] for k in ("dataset", "answer_format", "min_pixels", "max_pixels", "max_seq_len")}
    metrics = evaluate_split(
        str(root / "model"),
        str(root / "stage/adapter"),
        str(root / "prepared.jsonl"),
        str(root / "pixels"),
        settings | {"max_new_tokens": 2, "batch_size": 4},
        tmp_path / "predictions.jsonl",
        tmp_path / "metrics.json",
    )

    model = model_with(root, "trained")
    tokenizer, builder, data = stage_data(root, model)
    batch = collate([data.samples[r["key"]] for r in data.records], data.images, builder, tokenizer.pad_token_id)
    batch = to_device(batch, CPU, FLOAT32)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    answer_tokens = int((targets != -100).sum())
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / answer_tokens
    # Both sum positive float32 terms, one an answer token each, in different orders and batches:
    # their rounding differs by at most about n * eps of the sum (n the terms), while one token
    # left out or shifted moves the mean by about 1/n of it (n = 245 here: n * eps = 3e-5 and
    # 1/n = 4e-3; measured 2e-8 to 6e-8).
    assert metrics["loss"] == pytest.approx(plain.item(), rel=answer_tokens * torch.finfo(FLOAT32).eps), name
    assert answer_tokens > 100
    # One line (its updates `\r`-separated), ending at all 14 answered.
    [progress] = [line for line in capsys.readouterr().err.split("\n") if "answers:" in line]
    assert progress.split("\r")[-1].startswith("answers: 100%") and "14/14" in progress


def test_sampled_answers_are_generates_with_the_same_draws_in_any_rows(family):
    """Sampled answers (temperature 1.2, top-k 20, top-p 0.95), each prompt with its own seed: the
    engine's are `generate`'s token for token where generate draws each token as the engine's
    sampler does (draw_tokens with the prompt's seed at the token's position), prompt by prompt; the
    same with 4 rows as with 3 and the prompts in reverse order (a draw depends on its prompt and
    position alone); top-k 1 through the seeded path gives the greedy answers."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from vlft.generation.sampling import Sampling, draw_tokens

    name, root = family
    model = model_with(root, "none")  # untrained: near-flat next-token distributions, draws that vary
    tokenizer, builder, data = stage_data(root, model)
    samples = [data.samples[r["key"]] for r in data.records]
    pad_id, limit = tokenizer.pad_token_id, 12
    settings = Sampling(temperature=1.2, top_p=0.95, top_k=20)

    class SameDraws(LogitsProcessor):
        def __init__(self, seed: int, prompt_length: int):
            self.seed, self.prompt_length = seed, prompt_length

        def __call__(self, input_ids, scores):
            index = torch.tensor([input_ids.shape[1] - self.prompt_length])
            token = draw_tokens(scores, torch.tensor([self.seed]), index, settings)
            return torch.full_like(scores, float("-inf")).scatter(1, token[:, None], 0.0)

    expected = {}
    with torch.no_grad():
        for index, sample in enumerate(samples):
            prompt = collate([sample], data.images, builder, pad_id, prompt_only=True)
            prompt = {k: v for k, v in to_device(prompt, CPU, FLOAT32).items() if k not in NOT_MODEL_INPUTS}
            length = prompt["input_ids"].shape[1]
            out = model.generate(
                **prompt,
                max_new_tokens=limit,
                do_sample=False,
                logits_processor=LogitsProcessorList([SameDraws(1000 + index, length)]),
                eos_token_id=builder.end_of_turn,
                pad_token_id=pad_id,
            )
            expected[index] = out[0, length:].tolist()

    def answers(slots: int, order: list[int], sampling: Sampling | None) -> dict:
        def requests():
            for index in order:
                request = prompt_request(index, samples[index], data, builder, pad_id, model, CPU, FLOAT32, limit)
                request.seed = 1000 + index
                yield request

        found = {}
        with torch.no_grad():
            answer_requests(
                model,
                requests(),
                slots=slots,
                end_id=builder.end_of_turn,
                max_length=max(s.prompt_length for s in samples) + limit,
                on_answer=found.__setitem__,
                sampling=sampling,
            )
        return found

    in_order = list(range(len(samples)))
    sampled = answers(4, in_order, settings)
    assert sampled == expected, name
    assert answers(3, in_order[::-1], settings) == sampled, name
    greedy = answers(4, in_order, None)
    assert sampled != greedy  # the draws are not the greedy tokens
    assert answers(4, in_order, Sampling(temperature=1.0, top_k=1)) == greedy, name


def test_cascade_attention_is_softmax_over_the_prefix_and_the_row_within_its_rounding():
    """The cascade's attention (vlft.generation.shared_prefixes) against plain softmax attention over
    each row's prefix and own keys together, in float64: three slots of prefixes ending inside,
    at and past a block edge (one empty), 4 seats each (some empty), 7 rows (one seated nowhere),
    grouped-query heads as Qwen3-VL has them.

    The bound: each way computes o = sum_i p_i v_i with p the softmax of the scores. With n keys,
    scores spanning R, one max shift, exp's error at most (|x| + 1) u for a shifted score x, a sum of
    n positive terms off by at most n u relatively and one division, either result is within
    (2 n + 2 R + 4) u max|v| of the exact one; the merge adds two exps of shifted log-sum-exps (each
    within R + log n of the top) and three roundings. Twice that covers the two results' distance."""
    from vlft.generation.shared_prefixes import PrefixLayer, cascade_attention

    torch.manual_seed(3)
    heads, kv_heads, dim, rows, seats, own = 4, 2, 16, 7, 4, KV_BLOCK
    prefix_lengths = [KV_BLOCK - 1, 0, KV_BLOCK + 9]  # slot 1 empty
    length = 2 * KV_BLOCK
    double = torch.float64
    keys, values = torch.randn(3, kv_heads, length, dim, dtype=double), torch.randn(
        3, kv_heads, length, dim, dtype=double
    )
    own_keys, own_values = torch.randn(rows, kv_heads, own, dim, dtype=double), torch.randn(
        rows, kv_heads, own, dim, dtype=double
    )
    query = torch.randn(rows, heads, 1, dim, dtype=double) * 2
    write_at = torch.tensor([0, 5, KV_BLOCK - 1, 17, 3, 60, 9])
    seat_at = {0: (0, 0), 1: (0, 2), 2: (2, 0), 3: (2, 1), 4: (2, 3), 6: (0, 1)}  # row 5 seated nowhere
    seated = torch.full((3, seats), rows)
    seat_of = torch.full((rows,), 3 * seats)
    for row, (slot, seat) in seat_at.items():
        seated[slot, seat], seat_of[row] = row, slot * seats + seat
    last = torch.tensor(prefix_lengths) - 1
    prefixes = PrefixLayer(keys, values, seated, seat_of, live_blocks(last, length, queries=seats))
    scale = dim**-0.5
    got, _ = cascade_attention(
        None, query, own_keys, own_values, None, scale, live=live_blocks(write_at, own), prefixes=prefixes
    )

    u = torch.finfo(double).eps / 2
    for row in range(rows):
        slot = seat_at.get(row, (None,))[0]
        prefix = prefix_lengths[slot] if slot is not None else 0
        row_keys = torch.cat(
            [keys[slot, :, :prefix] if prefix else keys[0, :, :0], own_keys[row, :, : write_at[row] + 1]], 1
        )
        row_values = torch.cat(
            [values[slot, :, :prefix] if prefix else values[0, :, :0], own_values[row, :, : write_at[row] + 1]], 1
        )
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = (query[row, head, 0] @ row_keys[kv].T) * scale
            want = torch.softmax(scores, 0) @ row_values[kv]
            n, spread = scores.numel(), float(scores.max() - scores.min())
            bound = 2 * (2 * n + 3 * spread + math.log(n) + 10) * u * float(row_values[kv].abs().max())
            error = float((got[row, 0, head] - want).abs().max())
            assert error <= bound, (row, head, error, bound)
    # A wrong merge (a part's weight, a seat's row) is off by the parts' difference, far above it.
    assert bound < 1e-10


@pytest.mark.parametrize("sampled", [False, True])
def test_answers_with_shared_prefixes_are_the_unshared_ones(family, sampled):
    """The engine with each shared prefix kept once and read once a step (vlft.generation.shared_prefixes),
    in float64: the same tokens as without, greedy (the unshared ones are `generate`'s, above) and
    drawn with each prompt's seed. Three seats a prefix split the image of four questions, two
    prefix slots keep some prompts waiting for a slot, rows end and take new prompts."""
    from vlft.generation.sampling import Sampling
    from vlft.generation.shared_prefixes import Cascade

    name, root = family
    model = load_base_model(root / "model", CPU, torch.float64).eval()
    tokenizer, builder, data = stage_data(root, model)
    samples = [data.samples[r["key"]] for r in data.records]
    sampling = Sampling(temperature=1.2, top_p=0.95, top_k=20) if sampled else None

    def answers(cascade):
        def requests():
            for index, sample in enumerate(samples):
                request = prompt_request(
                    index, sample, data, builder, 0, model, CPU, torch.float64, LIMITS[index % len(LIMITS)]
                )
                request.seed = 1000 + index
                yield request

        found, stats = {}, {}
        with torch.no_grad():
            answer_requests(
                model,
                requests(),
                slots=4,
                end_id=builder.end_of_turn,
                max_length=max(s.prompt_length for s in samples) + max(LIMITS),
                on_answer=found.__setitem__,
                sampling=sampling,
                cascade=cascade,
                stats=stats,
            )
        return found, stats

    plain, _ = answers(None)
    shared, stats = answers(Cascade(seats=3, prefixes=2))
    assert shared == plain, name
    assert len({len(ids) for ids in plain.values()}) >= 3  # rows ended at different steps
    assert stats["prefills"] >= 5  # the slots held prompts back: more prefills than the 5 images
    # The layout an evaluation on a GPU takes: its rows' own parts hold what follows each prefix.
    layout = shared_prefixes(data, list(range(len(samples))), 4, max(LIMITS))
    on_image = [IMAGE_OF_RECORD.count(owner) for owner in dict.fromkeys(IMAGE_OF_RECORD)]
    assert (layout.seats, layout.prefixes) == (4, min(4, 2 * math.ceil(4 / (len(samples) / len(on_image)))))
    assert layout.own_length - max(LIMITS) < min(s.prompt_length for s in samples)  # the image is not in it
    assert answers(layout)[0] == plain, name


def test_a_cascade_layout_seats_each_images_run_and_sizes_a_row_for_its_longest_own_part():
    """cascade_for on a reward stage's asking order: 2 images, 3 questions on the first and 1 on the
    second, each question asked twice in a row (its 2 answers). A row's own part is the longest
    prompt past the prefix its image's prompts share, plus the answer room; a question alone on
    its image shares nothing with another one's (its run holds only its own repeats)."""
    image = list(range(100))  # the template and the image's tokens: what an image's prompts share
    questions = [image + [200, 201], image + [300], image + [400, 401, 402, 403]]
    asked = [("a", ids) for ids in questions for _ in range(2)] + [("b", list(range(50)) + [7]) for _ in range(2)]
    layout = cascade_for(asked, slots=8, answer_room=20)
    # Seats: the longest run on one image (6 rows); slots: twice the rows over the average run (4).
    assert (layout.seats, layout.prefixes) == (6, 4)
    # The first image's prompts share its 100 tokens: its longest question is 4 tokens past them;
    # the second image's one question, asked twice, shares its whole prompt but the last token.
    assert layout.own_length == max(104 - 100, 51 - 50) + 20
    assert cascade_for([("a", image), ("b", image)], 2, 20) is None  # no two consecutive on one image


def test_a_cascade_step_gives_the_unshared_steps_logits(family):
    """Four questions on one image in one prefill, three seated at one prefix slot and the fourth at
    another (3 seats a slot), against the same four rows holding their prompts whole, for eight
    steps, in float64: each step's logits within 1e-11 of their norm (u = 1.1e-16; the attention
    bound above, about 1e-13 over a few hundred keys, through two layers whose weights scale it
    by less than 100), and the same greedy tokens."""
    from vlft.generation.shared_prefixes import Cascade, SharedPrefixes, seat_plan

    name, root = family
    model = load_base_model(root / "model", CPU, torch.float64).eval()
    tokenizer, builder, data = stage_data(root, model)
    group = [
        prompt_request(n, data.samples[data.records[n]["key"]], data, builder, 0, model, CPU, torch.float64, 8)
        for n in range(4)  # records 0-3 ask about one image
    ]
    rows = [0, 1, 2, 3]
    steps = {}
    with torch.no_grad():
        use_packed_attention(model)
        prefilled = prefill(model, group)
        assert min(prefilled.shared) > 0
        for shared in (False, True):
            cache = SlotCache(model, 4, 2 * KV_BLOCK)
            skip = None
            if shared:
                cascade = Cascade(seats=3, prefixes=2)
                cache.prefixes = SharedPrefixes(model, cascade, 2 * KV_BLOCK, 4)
                skip = prefilled.shared
                cache.prefixes.fill(prefilled, seat_plan(group, cascade.seats), skip, rows)
            cache.fill(rows, prefilled, skip)
            steps[shared] = greedy_steps_logits(DecodeStep(model, cache, attention=DECODE_ATTENTION), group, prefilled)
        model.set_attn_implementation({"text_config": "sdpa"})
    for n, (got, want) in enumerate(zip(steps[True], steps[False])):
        assert_close_normwise(got, want, rtol=1e-11, msg=f"{name}, step {n}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (name, n)


def greedy_steps_logits(step: DecodeStep, group: list, prefilled, steps: int = 8) -> list[torch.Tensor]:
    """The logits of `steps` decode steps after the prefill of `group`, each row taking its greedy
    token, its rows holding the group's prompts in order."""
    step.tokens.copy_(torch.tensor(prefilled.firsts))
    step.positions.copy_(torch.stack([r.positions.max() + 1 for r in group]))
    found = []
    for _ in range(steps):
        logits = step.logits()
        found.append(logits)
        step.tokens.copy_(logits.argmax(-1))
        step.cache.write_at += 1
        step.positions += 1
    return found


@pytest.mark.parametrize("questions", [1, 2])
def test_answers_asking_one_prompt_again_share_its_prefill(family, questions, monkeypatch):
    """A reward stage asks each question's prompt once an answer (dataclasses.replace: the same
    inputs). The prefill computes it once for them all, with one question on the image (a
    screenshot: its answers' prompt whole, once) or two (each question's own tokens once, after
    the image's prefix): every answer's first-token logits, its prompt's keys and values and its
    shared prefix are those of the prefill that computed each answer's prompt for it (float64:
    the same arithmetic, a shorter row), and the row is shorter by the repeats."""
    from dataclasses import replace

    from vlft.generation import runner
    from vlft.generation.kv_cache import prompt_positions
    from vlft.generation.scheduler import Scheduler

    name, root = family
    model = load_base_model(root / "model", CPU, torch.float64).eval()
    tokenizer, builder, data = stage_data(root, model)
    asked = [
        prompt_request(n, data.samples[data.records[n]["key"]], data, builder, 0, model, CPU, torch.float64, 8)
        for n in range(questions)  # records 0-1 ask about one image
    ]
    answers = 3
    group = [replace(prompt, key=prompt.key * answers + a, seed=a) for prompt in asked for a in range(answers)]
    with torch.no_grad():
        use_packed_attention(model)
        once = prefill(model, group)
        with monkeypatch.context() as each:
            each.setattr(runner, "asks_again", lambda *args: False)
            repeated = prefill(model, group)
        model.set_attn_implementation({"text_config": "sdpa"})
    assert once.shared == repeated.shared and min(once.shared) > 0, name
    # Each repeat's own part past the image's prefix (with one question: its prompt's last token) is gone.
    repeats = (answers - 1) * sum(prompt.prompt - once.shared[0] for prompt in asked)
    assert repeated.tokens - once.tokens == repeats > 0, name
    assert once.firsts == repeated.firsts, name
    # The engine's scheduler counts a repeat as no tokens: a budget of one prompt takes all its answers.
    scheduler = Scheduler(iter(group), len(group), prefill_tokens=group[0].prompt)
    assert scheduler.next_group(len(group)) == group[:answers], name
    assert_close_normwise(once.last_hidden, repeated.last_hidden, rtol=1e-12, msg=name)
    for spans_once, spans_repeated in zip(once.spans, repeated.spans):
        for kept_once, kept_repeated in zip(once.cache.layers, repeated.cache.layers):
            for a, b in ((kept_once.keys, kept_repeated.keys), (kept_once.values, kept_repeated.values)):
                got = a[0].index_select(1, prompt_positions(spans_once))
                want = b[0].index_select(1, prompt_positions(spans_repeated))
                assert_close_normwise(got, want, rtol=1e-12, msg=name)


def test_the_cascade_step_compiled_gives_its_eager_logits(tmp_path):
    """The cascade step as a GPU runs it, its layers compiled, against the same step eager, over
    random keys and values: prefixes of 200 and 75 positions, two of the three slots used, rows at
    own lengths across block edges. One graph serves every layer: a recompile for the second
    layer is an error here. (The CPU's inductor has no flex_attention with its log-sum-exp, so the
    graph is traced as on a GPU and run by AOT autograd's eager backend; the GPU's kernels are
    checked against the unshared step by benchmarks/shared_prefix_decode.py.)"""
    from vlft.demo.tiny_model import make_tiny_model

    torch._dynamo.reset()  # the unshared step's layer, compiled by a test before, is another graph
    from vlft.generation.shared_prefixes import Cascade, SharedPrefixes

    make_tiny_model(tmp_path / "model", family="qwen3_vl")
    model = load_base_model(tmp_path / "model", CPU, FLOAT32).eval()
    logits = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        cache = SlotCache(model, 4, 2 * KV_BLOCK)
        cache.prefixes = store = SharedPrefixes(model, Cascade(seats=3, prefixes=3), 2 * KV_BLOCK, 4)
        for tensor in cache.keys + cache.values + store.keys + store.values:
            tensor.normal_()
        cache.write_at.copy_(torch.tensor([0, KV_BLOCK + 2, 7, KV_BLOCK - 1]))
        store.seated.copy_(torch.tensor([[0, 3, 4], [4, 4, 4], [1, 4, 4]]))  # row 2 seated nowhere
        store.seat_of.copy_(torch.tensor([0, 6, 9, 1]))
        store.last.copy_(torch.tensor([199, -1, 74]))
        refresh_live_blocks(store.live, store.last)
        step = DecodeStep(model, cache, compile=compiled, backend="aot_eager")
        step.tokens.copy_(torch.tensor([5, 17, 33, 2]))
        step.positions.copy_(cache.write_at + 240)
        # (Eager, each flex_attention call compiles its own wrapper: the two parts' shapes differ.)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=compiled):
            logits[compiled] = step.logits()
    # float32 over sums of at most 331 terms in 2 layers, as in the tests above.
    assert_close_normwise(logits[True], logits[False], rtol=1e-5, msg="compiled cascade step")
