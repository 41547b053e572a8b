"""Image groups: caches hold each image once, steps take whole groups in the stage's order, data-
parallel shares cut a group only where whole groups leave a process idle, and a stage trained with groups follows the plain loss curve
where both take the same steps. (Equality of a grouped step's loss and gradients with the samples
computed alone: tests/forward/test_fast_path.py.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vlft.demo.shapes import make_dataset
from vlft.errors import InputError
from vlft.files import read_jsonl
from vlft.caches.image_cache import ImageCache
from vlft.forward.image_groups import ImageGroup, common_prefix, group_rows, share_groups, shared_prefix_length
from vlft.job_settings import StageSettings
from vlft.training.steps import groups_in_order, image_of, plan_steps
from vlft.jobs.distributed import share_by_tokens
from vlft.data.prompts import Sample
from tests.helpers import FLOAT64_RTOL, tiny_family_data, tiny_stage_settings, train_float64
from vlft.demo.shapes import questions_on_shared_images


def test_the_pixel_cache_holds_each_image_once_and_every_record_finds_it(tmp_path):
    per_record = tmp_path / "per-record"
    per_record.mkdir()
    make_dataset({"train": per_record / "train.jsonl"}, per_record / "images", {"train": 9}, seed=3)
    tiny_family_data(per_record, "qwen3_vl", per_record / "train.jsonl")
    shared = tmp_path / "shared"
    shared.mkdir()
    tiny_family_data(shared, "qwen3_vl", questions_on_shared_images(shared, images=1, per_image=9))

    def cache_bytes(root):
        return sum(p.stat().st_size for p in (root / "pixels").glob("*.safetensors"))

    cache = ImageCache(shared / "pixels")
    assert len(cache.entries) == 1 and len(cache.records) == 9
    assert len(set(cache.records.values())) == 1
    # Nine questions on one image: the cache is a ninth of one entry per record.
    assert cache_bytes(shared) * 8 <= cache_bytes(per_record)
    assert len(ImageCache(per_record / "pixels").entries) == 9


def test_a_cache_of_the_older_layout_is_refused_with_the_delete_and_rerun_sentence(tmp_path):
    root = tmp_path
    make_dataset({"train": root / "train.jsonl"}, root / "images", {"train": 2}, seed=0)
    tiny_family_data(root, "qwen2_vl", root / "train.jsonl")
    index_path = root / "pixels/index.json"
    index = json.loads(index_path.read_text())
    old = dict(index, format=2, records=index["images"])  # one entry per record, as format 2 wrote
    del old["images"]
    index_path.write_text(json.dumps(old))
    with pytest.raises(InputError, match="older version of this workflow; delete it and run again"):
        ImageCache(root / "pixels")


def sample(record_id: str, prompt: list[int], answer: int) -> Sample:
    return Sample(record_id, prompt + [0] * answer, [-100] * len(prompt) + [0] * answer, len(prompt))


def test_the_shared_prefix_stops_where_the_prompts_part_and_before_each_ones_last_prompt_token():
    header, image = [1, 2], [9] * 5
    a = sample("a", header + image + [3, 4, 7], 4)
    b = sample("b", header + image + [3, 5, 7], 2)
    assert shared_prefix_length([a]) == 0
    assert shared_prefix_length([a, b]) == len(header + image) + 1  # the common "3" too
    same = sample("c", header + image + [3, 4, 7], 1)
    assert shared_prefix_length([a, same]) == len(a.input_ids) - 4 - 1  # the last prompt token kept
    group = ImageGroup.of([a, b, same])
    assert group.tokens == group.shared + sum(len(s.input_ids) - group.shared for s in (a, b, same))


def test_the_common_prefix_is_the_token_at_a_time_count():
    """common_prefix's binary search over slices against its definition: the leading positions at
    which every sequence holds the first one's token, at most `limit`; on sequences that part at
    every place, of one to four sequences over a three-token alphabet."""
    import random

    def one_at_a_time(sequences, limit):
        length = 0
        while length < limit and all(seq[length] == sequences[0][length] for seq in sequences):
            length += 1
        return length

    draw = random.Random(0)
    cases = 0
    for _ in range(5000):
        base = [draw.randint(0, 2) for _ in range(draw.randint(0, 12))]
        sequences = [
            base[: draw.randint(0, len(base))] + [draw.randint(0, 2) for _ in range(draw.randint(0, 5))]
            for _ in range(draw.randint(1, 4))
        ]
        limit = draw.randint(0, min(map(len, sequences)))
        assert common_prefix(sequences, limit) == one_at_a_time(sequences, limit), (sequences, limit)
        cases += 0 < one_at_a_time(sequences, limit) < limit
    assert cases > 500  # many part before the limit, not at its start


def records_of(groups: list[int], field=None) -> tuple[list[dict], dict]:
    """Records in groups of the given sizes (group g's images are 'img-g'), as a stage holds them."""
    records, images = [], {}
    for g, size in enumerate(groups):
        for q in range(size):
            key = f"r{g}-{q}"
            records.append({"key": key, "id": key, "difficulty": (q + 2 * g) % 5 if field else 0})
            images[key] = (None, f"img-{g}")
    return records, images


STEP = {"micro_batch": 4, "grad_accum": 2, "order_field": None, "order_descending": False, "seed": 7}


@pytest.mark.parametrize("order", ["random", "given", "by_field"])
def test_steps_take_whole_groups_in_the_stages_order(order):
    sizes = [9, 1, 4, 18, 2, 7, 3, 9, 5]
    records, images = records_of(sizes, field=order == "by_field")
    settings = dict(STEP, order=order, order_field="difficulty" if order == "by_field" else None, epochs=2, max_steps=0)
    steps = plan_steps(records, StageSettings.resolve(settings), image_of(images))
    groups_of = {r["key"]: images[r["key"]][1] for r in records}
    epoch_steps = []
    for step in steps:
        # Whole groups, each once in the step; at least micro_batch x grad_accum samples, short by
        # less than a group only at an epoch's end.
        assert all(len({groups_of[k] for k in group}) == 1 for group in step)
        assert all(len(group) == sizes[int(groups_of[group[0]].split("-")[1])] for group in step)
        epoch_steps.append(sum(map(len, step)))
    assert Counter(k for step in steps for g in step for k in g) == Counter({r["key"]: 2 for r in records})
    assert sum(1 for n in epoch_steps if n < 8) <= 2
    first_epoch = [groups_of[g[0]] for step in steps for g in step][: len(sizes)]
    if order == "given":
        assert first_epoch == [f"img-{g}" for g in range(len(sizes))]
    elif order == "by_field":
        # Each group where its easiest question falls in the sorted records.
        easiest = {
            f"img-{g}": min(r["difficulty"] for r in records if groups_of[r["key"]] == f"img-{g}")
            for g in range(len(sizes))
        }
        assert [easiest[g] for g in first_epoch] == sorted(easiest[g] for g in first_epoch)
    else:
        second_epoch = [groups_of[g[0]] for step in steps for g in step][len(sizes) :]
        assert sorted(first_epoch) == sorted(second_epoch) and first_epoch != second_epoch
    # max_steps: cut short, or further epochs.
    assert plan_steps(records, StageSettings.resolve(dict(settings, max_steps=3)), image_of(images)) == steps[:3]
    longer = StageSettings.resolve(dict(settings, max_steps=len(steps) + 5))
    assert len(plan_steps(records, longer, image_of(images))) == len(steps) + 5


def test_rows_keep_groups_whole_where_they_fit_and_shares_never_cut_a_group():
    prompt = list(range(40))
    groups = [
        ImageGroup.of([sample(f"g{g}-{q}", prompt[:30] + [100 + g, 200 + q], 5 + q) for q in range(size)])
        for g, size in enumerate([9, 1, 4, 2])
    ]
    assert [g.shared for g in groups] == [31, 0, 31, 31]
    rows = group_rows(groups, max_tokens=120, max_samples=None)
    assert all(sum(g.tokens for g in row) <= 120 for row in rows)
    parts = [g for row in rows for g in row]
    assert sorted(s.record_id for g in parts for s in g.samples) == sorted(
        s.record_id for g in groups for s in g.samples
    )
    assert max(len(g.samples) for g in parts) < 9  # the 9-question group (more than 120 tokens) was cut
    assert sum(1 for g in parts if g.samples[0].record_id.startswith("g2")) == 1  # the 4 fit whole
    by_samples = group_rows(groups, max_tokens=None, max_samples=4)
    assert all(sum(len(g.samples) for g in row) <= 4 for row in by_samples)
    shares = share_by_tokens(groups, 3, length=lambda g: g.tokens)
    assert sorted(id(g) for share in shares for g in share) == sorted(id(g) for g in groups)


def test_shares_keep_groups_whole_where_that_balances_and_cut_them_where_a_process_would_idle():
    """Kvasir's steps: 16 samples hold two images of 9 questions. At 2 processes each takes an image;
    at 4, whole groups would leave two processes idle, so each image is cut in two, each part with
    the prefix: the busiest process computes about half of what it would."""
    prompt = list(range(100))  # the header and the image, shared

    def image(g: int, questions: int, unit: int = 1) -> ImageGroup:
        return ImageGroup.of(
            [sample(f"g{g}-{q}", prompt + [1000 + g, 2000 + q], 20 + 7 * q) for q in range(questions)], unit
        )

    step = [image(0, 9), image(1, 9)]
    assert share_groups(step, 1) == [step]
    halves = share_groups(step, 2)
    assert [[g.samples for g in share] for share in halves] == [[step[0].samples], [step[1].samples]]

    quarters = share_groups(step, 4)
    parts = [g for share in quarters for g in share]
    assert sorted(s.record_id for g in parts for s in g.samples) == sorted(s.record_id for g in step for s in g.samples)
    assert all(share for share in quarters) and all(g.shared == 101 for g in parts if len(g.samples) > 1)
    whole_busiest = max(g.tokens for g in step)
    busiest = max(sum(g.tokens for g in share) for share in quarters)
    assert busiest < 0.65 * whole_busiest
    # Preference pairs (units of 2) are cut between pairs only.
    pairs = share_groups([image(0, 8, unit=2)], 3)
    assert all(len(g.samples) % 2 == 0 for share in pairs for g in share)
    assert [s.record_id for share in pairs for g in share for s in g.samples] == [f"g0-{q}" for q in range(8)]
    # Balanced already: nothing is cut (a cut repeats the prefix).
    four = [image(g, 9) for g in range(4)]
    assert sorted(len(share) for share in share_groups(four, 4)) == [1, 1, 1, 1]


def test_by_image_groups_records_of_one_image_across_splits_in_order_of_first_appearance():
    records = [{"key": k} for k in ("a", "b", "c", "d")]
    images = {"a": ("cache-1", "/x.png"), "b": ("cache-1", "/y.png"), "c": ("cache-2", "/x.png"), "d": (None, "/z.png")}
    assert [[r["key"] for r in g] for g in groups_in_order(records, image_of(images))] == [["a", "c"], ["b"], ["d"]]


def test_a_stage_with_image_groups_follows_the_plain_loss_curve_where_the_steps_are_the_same(tmp_path):
    """The training loop with image_groups: images of 4 questions each, in the given order, steps
    of 4 samples: the grouped stage takes the plain stage's very steps, one image each, and logs
    the same losses in float64. A group lays out as 14 shared tokens and 4 of 13 to 14 of its
    own (68 tokens): a 50-token budget cuts each into pairs of questions, each pair with the prefix."""
    from vlft.training.train import StageInputs

    root = tiny_family_data(tmp_path, "qwen3_vl", questions_on_shared_images(tmp_path, images=4, per_image=4))
    inputs = StageInputs(str(root / "model"), [str(root / "prepared.jsonl")], [str(root / "pixels")], None)
    common = dict(order="given", micro_batch=4, grad_accum=1, max_steps=8, lora_dropout=0.0, max_batch_tokens=50)

    def losses(name, **settings):
        train_float64(inputs, tiny_stage_settings(**common, **settings), tmp_path / name)
        return [row["loss"] for row in read_jsonl(tmp_path / name / "log.jsonl")]

    plain, grouped = losses("plain"), losses("grouped", image_groups=True)
    assert len(plain) == 8
    # The first two steps' losses agree to float64 rounding (Adam's first update is lr x the
    # gradient's sign, whatever its last bits). After that AdamW divides each gradient element by
    # its running magnitude: where that is near its eps (1e-8), a rounding difference of 1e-16 in
    # the gradient moves the weight by up to lr / eps (2e4) times as much, so the curves drift
    # apart faster than rounding (1e-8 relative by step 5 here). A wrong layout moves the very first
    # loss by 1e-3 and more (a prefix mask aligned top-left instead: 2e-3, tests/forward/test_fast_path.py).
    assert grouped[:2] == pytest.approx(plain[:2], rel=FLOAT64_RTOL)
    assert grouped == pytest.approx(plain, rel=1e-6)
