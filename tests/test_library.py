"""The library's parts on their own: config inheritance, answers, the pixel cache, resuming."""

import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch
import yaml
from PIL import ExifTags, Image
from safetensors.torch import load_file

from transformers.image_utils import load_image

from conftest import FLOAT64_RTOL, REPO, assert_close_normwise
from vlft.config import resolve_config
from vlft.files import read_jsonl
from vlft.data.answers import final_answer, is_correct, normalize
from vlft.caches.image_cache import ImageCache, PixelSettings, build_image_cache, to_patches
from vlft.modeling import load_image_processor
from vlft.plan import build_plan
from vlft.data.records import order_records, prepare_split
from vlft.jobs.stopping import RESERVE_S, StopRequest, slurm_end_time
from vlft.training.train import Preempted, StageInputs, train_stage


def test_stages_inherit_defaults_and_override_them():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    plan = build_plan(config)
    stage1, stage2 = plan.stage("exp4", "stage1"), plan.stage("exp4", "stage2")
    assert stage1.settings["epochs"] == 4 and stage1.settings["learning_rate"] == config["defaults"]["learning_rate"]
    assert stage1.settings["filter"] == {"category": ["color", "yes/no"]} and stage2.settings["filter"] == {}
    assert stage2.init_from == "exp4/stage1" and plan.ancestors(stage2) == [stage1]
    assert "resources" not in stage1.train_params() and "checkpoint_every" not in stage1.train_params()


def test_example_config_is_valid():
    config = resolve_config(yaml.safe_load((REPO / "config/examples/kvasir-vqa-qwen3-vl-8b.yaml").read_text()))
    plan = build_plan(config)
    assert sorted({s.experiment for s in plan.stages.values()}) == ["exp1", "exp2", "exp3", "exp4", "exp5"]
    assert plan.stage("exp4", "stage2").init_from == "exp4/stage1"
    # Kvasir asks about 9 questions an image (x1 about 25): each image computed once; from the
    # vision cache where it fits the bound (Kvasir-VQA's train split), else from pixels.
    assert all(s.settings["image_groups"] for s in plan.stages.values())
    assert {s.id for s in plan.stages.values() if s.settings["vision_cache"]} == {
        "exp1/main",
        "exp4/stage1",
        "exp4/stage2",
    }
    assert {s.settings["dataset"] for s in plan.stages.values() if not s.settings["vision_cache"]} == {"kvasir-x1"}
    assert plan.stage("exp3", "stage1").settings["filter"] == {"difficulty": [1]}
    assert plan.stage("exp5", "main").settings["answer_format"] == "cot"


def test_click_example_config_is_valid_and_its_base_model_is_asked_for_clicks():
    config = resolve_config(yaml.safe_load((REPO / "config/examples/click-qwen3-vl-8b.yaml").read_text()))
    plan = build_plan(config)
    settings = plan.stage("click", "main").settings
    assert settings["answer_format"] == "click" and settings["epochs"] == 1
    assert (settings["lora_r"], settings["lora_alpha"], settings["checkpoint_every"]) == (32, 64, 200)
    assert plan.eval_settings("base", "base", config["evaluation"])["answer_format"] == "click"
    assert plan.evaluations() == [
        ("click", "main", "val"),
        ("click", "main", "test"),
        ("base", "base", "test"),
        ("base", "base", "val"),
    ]


def test_base_model_is_evaluated_on_each_dataset_in_its_format():
    """The demo trains on two datasets: the base model answers the shapes (the defaults' dataset,
    stage `base`) directly and the screens (stage `screens`) with clicks."""
    config = resolve_config(yaml.safe_load((REPO / "config/config.yaml").read_text()))
    plan = build_plan(config)
    base = [(stage, split) for experiment, stage, split in plan.evaluations() if experiment == "base"]
    assert base == [("base", "test"), ("base", "val"), ("screens", "test")]
    shapes, screens = (plan.eval_settings("base", stage, config["evaluation"]) for stage in ("base", "screens"))
    assert (shapes["dataset"], shapes["answer_format"]) == ("shapes", "final")
    assert (screens["dataset"], screens["answer_format"]) == ("screens", "click")
    assert screens == plan.eval_settings("click", "main", config["evaluation"])


@pytest.mark.parametrize(
    "prediction,reference,correct",
    [
        ("It is round and red. Final answer: Red.", "Final answer: red", True),
        ("final answer: three", "I count one, two, three. Final answer: 3", True),
        ("Final answer: 2", "Final answer: 3", False),
        ("yes", "The shape is blue. Final answer: yes", True),
    ],
)
def test_final_answers_are_compared_normalized(prediction, reference, correct):
    assert is_correct(prediction, reference) is correct


def test_final_answer_takes_the_last_marker():
    assert final_answer("Final answer: no... wait. Final answer: yes") == "yes"
    assert normalize("The  Left!") == "left"


def test_orders_random_given_and_by_field():
    records = [{"id": str(i), "d": d} for i, d in enumerate([3, 1, 2, 1])]
    assert [r["id"] for r in order_records(records, "given", None, False, 0, 0)] == ["0", "1", "2", "3"]
    assert [r["id"] for r in order_records(records, "by_field", "d", False, 0, 0)] == ["1", "3", "2", "0"]
    assert [r["id"] for r in order_records(records, "by_field", "d", True, 0, 0)] == ["0", "2", "1", "3"]
    first, second = (order_records(records, "random", None, False, 7, e) for e in (0, 1))
    assert sorted(r["id"] for r in first) == ["0", "1", "2", "3"]
    assert order_records(records, "random", None, False, 7, 0) == first  # seeded
    assert first != second or first != order_records(records, "random", None, False, 7, 2)


def awkward_images(directory) -> dict[str, tuple[int, int]]:
    """Images as researchers have them, saved in `directory`; each name with its size as a person
    sees it (width, height)."""
    rng = np.random.default_rng(0)

    def noise(w, h, channels=3):
        return rng.integers(0, 255, (h, w, channels), dtype=np.uint8)

    sizes = {}

    def save(name, image, seen=None, **options):
        image.save(directory / name, **options)
        sizes[name] = seen or image.size

    save("rgb.jpg", Image.fromarray(noise(157, 211)))
    save("wide.jpg", Image.fromarray(noise(300, 120)))
    save("square.jpg", Image.fromarray(noise(64, 64)))
    # Stored 400x200, EXIF orientation 6: a camera held upright, seen as 200x400.
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    save("exif-rotated.jpg", Image.fromarray(noise(400, 200)), seen=(200, 400), exif=exif)
    save("grayscale.png", Image.fromarray(noise(120, 90, 1)[:, :, 0], mode="L"))
    save("rgba.png", Image.fromarray(noise(100, 140, 4), mode="RGBA"))
    save("palette.png", Image.fromarray(noise(130, 70)).convert("P", palette=Image.Palette.ADAPTIVE))
    save("cmyk.jpg", Image.fromarray(noise(90, 110, 4), mode="CMYK"))
    save("16bit.png", Image.fromarray(rng.integers(0, 65535, (80, 120), dtype=np.uint16)))
    save("tiny.png", Image.fromarray(noise(3, 2)))
    # Aspect ratios just under the image processor's limit of 200, both ways.
    save("strip-wide.png", Image.fromarray(noise(1990, 10)))
    save("strip-tall.png", Image.fromarray(noise(10, 1990)))
    return sizes


def test_cached_pixels_give_exactly_the_processors_patches(tmp_path, tiny_model_dir):
    """For every kind of image, the cache holds what the model's own processor makes of the image
    as transformers loads it (EXIF orientation applied, any mode to RGB): the same grid, the same
    patches, bit for bit."""
    sizes = awkward_images(tmp_path)
    assert Image.open(tmp_path / "16bit.png").mode.startswith("I") and Image.open(tmp_path / "cmyk.jpg").mode == "CMYK"
    rows = [{"id": name, "image": name, "question": "q", "answer": "a"} for name in sizes]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_split(tmp_path / "raw.jsonl", tmp_path, tmp_path / "prepared.jsonl")
    prepared = {r["id"]: (r["width"], r["height"]) for r in read_jsonl(tmp_path / "prepared.jsonl")}
    assert prepared == sizes
    processor = load_image_processor(tiny_model_dir)
    settings = PixelSettings.from_processor(processor, 32 * 32, 128 * 128)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path / "cache", settings, shard_bytes=50_000)
    cache = ImageCache(tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("shard-*.safetensors"))) > 1
    for name in sizes:
        expected = processor(
            images=[load_image(str(tmp_path / name))],
            size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
            return_tensors="pt",
        )
        image = cache.image_of(name)
        assert cache.grid_thw(image) == expected["image_grid_thw"][0].tolist(), name
        assert torch.equal(to_patches(cache.tensor(image), cache.settings), expected["pixel_values"]), name
    # The rotated photo is cached upright: taller than wide, as a person and the processor see it.
    _, grid_h, grid_w = cache.grid_thw(cache.image_of("exif-rotated.jpg"))
    assert grid_h > grid_w


class StopAfter:
    """Stands in for a SIGTERM arriving while step `n` runs."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def reason(self):
        self.calls += 1
        return "SIGTERM received" if self.calls == self.n else None


@pytest.fixture
def stop_request():
    """A StopRequest whose signal handlers are pytest's again afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield StopRequest
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_a_signal_stops_training_at_the_next_step_boundary(stop_request):
    stop = stop_request()
    assert stop.reason() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.reason() == "SIGUSR1 received"
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the same stop, not a KeyboardInterrupt mid-step
    assert stop.reason() == "SIGINT received"


def test_the_time_limit_stops_training_while_two_slowest_steps_and_the_save_still_fit(stop_request):
    now = [1000.0]
    stop = stop_request(end_time=now[0] + RESERVE_S + 3.0, clock=lambda: now[0])
    assert stop.reason() is None  # no step measured yet: the reserve alone fits, 3 s to spare
    now[0] += 0.5
    assert stop.reason() is None  # reserve + 2 x 0.5 s fits in the 2.5 s left
    now[0] += 1.0
    assert stop.reason() == f"the job's time limit is {round(RESERVE_S + 1.5)} s away"  # reserve + 2 x 1 s does not fit


def test_the_job_end_time_comes_from_slurm_and_is_none_elsewhere(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert slurm_end_time() is None
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1795336463")
    assert slurm_end_time() == 1795336463.0


def test_a_stopped_stage_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_one_does(tmp_path, tiny_model_dir):
    from vlft.demo.shapes import make_dataset

    make_dataset({"train": tmp_path / "train.jsonl"}, tmp_path / "images", {"train": 48}, seed=0)
    prepare_split(tmp_path / "train.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    settings_px = PixelSettings.from_processor(load_image_processor(tiny_model_dir), 4096, 16384)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path / "cache", settings_px)
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    settings = build_plan(config).stage("exp1", "main").train_params() | {
        "max_steps": 6,
        "micro_batch": 8,
        "lora_dropout": 0.1,
    }
    inputs = StageInputs(str(tiny_model_dir), [str(tmp_path / "prepared.jsonl")], [str(tmp_path / "cache")], None)

    def run(name, stop=None, retry=False):
        out = tmp_path / name
        return (
            train_stage(
                inputs,
                settings,
                out / "adapter",
                out / "log.jsonl",
                out / "summary.json",
                out / "ckpt",
                2,
                stop,
                dtype=torch.float64,
                reuse_finished=retry,
            ),
            out,
        )

    _, whole = run("whole")
    with pytest.raises(Preempted, match="after step 3"):
        run("split", StopAfter(3))
    assert not (tmp_path / "split/adapter").exists()
    summary, split = run("split")
    assert summary["resumed_from_step"] == 3
    log = [json.loads(line) for line in (split / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1, 2, 3, 4, 5, 6]
    a = load_file(whole / "adapter/adapter_model.safetensors")
    b = load_file(split / "adapter/adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert_close_normwise(a[key], b[key], FLOAT64_RTOL, key)

    # A retry of a job that finished its steps but was stopped as it wrote its outputs (a late
    # time limit; Snakemake then deletes them) restores them from the kept result: nothing trains.
    # Only the finished result is kept; the checkpoints have served.
    assert [p.name for p in (split / "ckpt").glob("*/*")] == ["finished"]
    before = {
        name: (split / name).read_bytes() for name in ("log.jsonl", "summary.json", "adapter/adapter_model.safetensors")
    }
    shutil.rmtree(split / "adapter")
    for name in ("log.jsonl", "summary.json"):
        (split / name).unlink()
    restored, _ = run("split", retry=True)
    assert restored == summary and {name: (split / name).read_bytes() for name in before} == before
    # A first attempt (a new run, or one forced with -f or -R) trains again.
    retrained, _ = run("split")
    assert retrained["resumed_from_step"] == 0 and retrained["wall_time_s"] != summary["wall_time_s"]
