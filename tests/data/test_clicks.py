"""Click prediction: coordinates in each model family's convention, parsing, scoring, and a click
stage trained and evaluated on tiny models of every family."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from PIL import Image, ImageDraw

from vlft.data import clicks
from vlft.data.clicks import Convention, Frame, parse_point, score
from vlft.demo.tiny_model import FAMILIES, PATCH_SIZE
from vlft.errors import InputError
from vlft.generation.evaluate import evaluate_split
from vlft.files import read_jsonl, write_jsonl
from vlft.caches.image_cache import PixelSettings
from vlft.modeling import load_base_model, load_tokenizer
from vlft.data.prompts import PromptBuilder
from vlft.data.records import prepare_split
from vlft.data.stage_data import load_stage_data
from vlft.training.train import StageInputs, train_stage
from tests.helpers import tiny_family_data, tiny_stage_settings

# (width, height) of screenshots and photos, landscape, portrait, odd sizes.
SIZES = [(1920, 1080), (1280, 720), (720, 1280), (333, 517), (96, 160)]
# (min_pixels, max_pixels): Qwen2.5-VL's usual range, the demo's, and one that upsizes small images.
PIXEL_RANGES = [(256 * 28 * 28, 1280 * 28 * 28), (4096, 16384), (512 * 512, 1024 * 1024)]


def frame_for(family: str, width: int, height: int, pixel_range: tuple[int, int]) -> Frame:
    """The frame as a click stage builds it: the pixel cache's resize, read back off its patch grid."""
    patch = PATCH_SIZE[family]
    resize = PixelSettings(patch, 2, 2, (0.5,) * 3, (0.5,) * 3, 3, *pixel_range)
    resized_w, resized_h = resize.target_size(width, height)
    record = {"width": width, "height": height}
    return Convention(clicks.COORDINATES_OF_FAMILY[family], patch).frame(
        record, [1, resized_h // patch, resized_w // patch]
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pixel_range", PIXEL_RANGES, ids=lambda r: f"{r[0]}-{r[1]}px")
@pytest.mark.parametrize("width, height", SIZES, ids=lambda v: str(v))
def test_a_box_round_trips_through_the_models_coordinates_to_original_pixels(family, pixel_range, width, height):
    frame = frame_for(family, width, height, pixel_range)
    if family == "qwen2_5_vl":
        grid_x, grid_y = frame.resized_width, frame.resized_height
        assert (frame.resized_width * frame.resized_height) <= pixel_range[1] * 1.0001
    else:
        grid_x = grid_y = 1000
    # Rounding to the model's integer units moves a point at most half a unit: in original pixels,
    # half of width / grid_x along x (and likewise along y).
    half_x, half_y = 0.5 * width / grid_x, 0.5 * height / grid_y
    rng = random.Random(width * height)
    for _ in range(200):
        x1, y1 = rng.uniform(0, width - 4), rng.uniform(0, height - 4)
        x2, y2 = rng.uniform(x1 + 2 * half_x + 1e-6, width), rng.uniform(y1 + 2 * half_y + 1e-6, height)
        record = {"id": "r", "box": [x1, y1, x2, y2], "width": width, "height": height}
        mx, my = frame.to_model(*clicks.target_point(record, "test"))
        assert 0 <= mx <= grid_x and 0 <= my <= grid_y
        x, y = frame.to_original(mx, my)
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        assert abs(x - cx) <= half_x * (1 + 1e-9) and abs(y - cy) <= half_y * (1 + 1e-9)
        # A box at least one model unit wide takes its own target back.
        assert score(record, clicks.point_text(mx, my), frame, "test")["correct"]


def test_each_family_says_the_point_in_its_own_coordinates():
    record = {"id": "r", "box": [900, 500, 1020, 580], "width": 1920, "height": 1080}  # centre (960, 540)
    assert clicks.target_text(record, frame_for("qwen3_vl", 1920, 1080, PIXEL_RANGES[0]), "t") == "(500, 500)"
    assert clicks.target_text(record, frame_for("qwen2_vl", 1920, 1080, PIXEL_RANGES[0]), "t") == "(500, 500)"
    # Qwen2.5-VL: pixels of the image as its processor resizes it, 1316 x 728 (multiples of 28,
    # within 1280 x 28 x 28 pixels).
    frame = frame_for("qwen2_5_vl", 1920, 1080, PIXEL_RANGES[0])
    assert (frame.resized_width, frame.resized_height) == (1316, 728)
    assert clicks.target_text(record, frame, "t") == "(658, 364)"
    # A point, when given, is the target rather than the box's centre: 192 x 1316 / 1920 = 131.6.
    assert clicks.target_text(record | {"point": [192, 108]}, frame, "t") == "(132, 73)"
    with pytest.raises(InputError, match="split.jsonl: record r has neither a point nor a box"):
        clicks.target_text({"id": "r", "width": 10, "height": 10}, frame, "split.jsonl")


@pytest.mark.parametrize(
    "answer, point",
    [
        ("(500, 250)", (500, 250)),
        ("[500,250]", (500, 250)),
        ('{"point_2d": [500, 250], "label": "Save"}', (500, 250)),
        ('[{"bbox_2d": [400, 200, 600, 300], "label": "Save"}]', (500, 250)),
        ("<|box_start|>(400,200),(600,300)<|box_end|>", (500, 250)),
        ("<point>500.5 250</point>", (500.5, 250)),
        ("x=500, y=250", (500, 250)),
        ("The button is at the top. Final answer: (500, 250)", (500, 250)),
        ("click(x=500, y=250)", (500, 250)),
        ("the Save button", None),
        # Numbers in prose are no point: the untrained base model's garbage scored clicks so.
        ("I see 3 buttons and 2 icons", None),
        ("Step 1, open the menu. 2 items", None),
        ("(500)", None),
        ("", None),
    ],
)
def test_the_forms_these_models_answer_in_are_parsed(answer, point):
    assert parse_point(answer) == point


def test_scores_are_taken_in_original_pixels_with_inclusive_bounds_and_unparseable_answers_counted():
    frame = Frame(200, 100, 200, 100, "relative")  # 1 unit = 0.2 px along x, 0.1 px along y
    record = {"id": "r", "box": [50, 20, 100, 40], "width": 200, "height": 100}
    on_edge = score(record, "(250, 200)", frame, "t")  # (50, 20): the box's corner
    assert on_edge["correct"] and on_edge["point"] == [50, 20]
    assert not score(record, "(249, 200)", frame, "t")["correct"]
    # Outside the image: clamped to its edge, then judged.
    clamped = score(record, "(-40, 5000)", frame, "t")
    assert clamped["point"] == [0, 100] and not clamped["correct"]
    assert clamped["distance"] == pytest.approx(math.dist((0, 100), (75, 30)) / math.hypot(200, 100))
    unparsed = score(record, "no idea", frame, "t")
    assert unparsed == {"point": None, "correct": False, "parsed": False, "distance": None}
    # A point without a box: no right or wrong, only the distance.
    assert score({"id": "p", "point": [75, 30]}, "(375, 300)", frame, "t")["correct"] is None


def make_click_split(root, name: str, n: int, seed: int) -> None:
    """Screens of varied sizes with one coloured button each, the instruction naming its colour:
    <root>/<name>.jsonl, images under <root>/images/."""
    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        width, height = rng.choice([(192, 128), (128, 192), (160, 160)])
        bw, bh = rng.randint(40, 70), rng.randint(30, 50)
        x1, y1 = rng.randint(0, width - bw), rng.randint(0, height - bh)
        image = Image.new("RGB", (width, height), (240, 240, 240))
        ImageDraw.Draw(image).rectangle((x1, y1, x1 + bw - 1, y1 + bh - 1), fill=(40, 70, 220))
        image.save(root / "images" / f"{name}-{i}.png")
        record = {"id": str(i), "image": f"{name}-{i}.png", "question": "Click the blue button.", "answer": "-"}
        record |= {"box": [x1, y1, x1 + bw - 1, y1 + bh - 1], "category": "button" if i % 2 else "icon"}
        records.append(record)
    records[0] |= {"point": [records[0]["box"][0] + 3, records[0]["box"][1] + 3]}  # a point inside its box
    write_jsonl(root / f"{name}.jsonl", records)


@pytest.fixture(scope="module", params=FAMILIES)
def click_family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"click-{request.param}")
    make_click_split(root, "raw", 16, seed=3)
    return request.param, tiny_family_data(root, request.param, root / "raw.jsonl")


def test_a_click_stage_trains_on_targets_in_the_familys_coordinates_and_is_scored_in_pixels(click_family, tmp_path):
    family, root = click_family
    tokenizer = load_tokenizer(root / "model")
    config = load_base_model(root / "model", torch.device("cpu"), torch.float32).config
    data = load_stage_data(
        [str(root / "prepared.jsonl")],
        [str(root / "pixels")],
        PromptBuilder(tokenizer, config.image_token_id),
        filters={},
        answer_format="click",
        max_seq_len=256,
        convention=Convention.of(config),
    )
    for record in data.records:
        sample = data.samples[record["key"]]
        said = tokenizer.decode(sample.input_ids[sample.prompt_length :], skip_special_tokens=True).strip()
        frame = data.frames[record["key"]]
        # What the model is taught: its own coordinates of the target, which land back in the box.
        assert said == clicks.target_text(record, frame, "t")
        x, y = frame.to_original(*parse_point(said))
        assert clicks.in_box(x, y, record["box"]), (said, record)
        if family == "qwen2_5_vl":
            assert (frame.resized_width, frame.resized_height) != (frame.width, frame.height)

    settings = tiny_stage_settings(
        answer_format="click", dataset="clicks", micro_batch=8, max_steps=40, learning_rate=3e-3
    )
    out = tmp_path / "stage"
    inputs = StageInputs(str(root / "model"), [str(root / "prepared.jsonl")], [str(root / "pixels")], None)
    train_stage(
        inputs, settings, out / "adapter", out / "log.jsonl", out / "summary.json", out / "ckpt", checkpoint_every=1000
    )
    losses = [row["loss"] for row in read_jsonl(out / "log.jsonl")]
    assert losses[-1] < losses[0] / 3, losses

    eval_settings = {k: settings[k] for k in ("dataset", "answer_format", "min_pixels", "max_pixels", "max_seq_len")}
    eval_settings |= {"max_new_tokens": 16, "batch_size": 5}
    metrics = evaluate_split(
        str(root / "model"),
        str(out / "adapter"),
        str(root / "prepared.jsonl"),
        str(root / "pixels"),
        eval_settings,
        tmp_path / "predictions.jsonl",
        tmp_path / "metrics.json",
    )
    predictions = read_jsonl(tmp_path / "predictions.jsonl")
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert metrics["n"] == metrics["n_with_box"] == 16 and metrics["answer_format"] == "click"
    # Trained on these very screens, the model answers with points, and the scores follow from them.
    assert metrics["unparseable"] == sum(not p["parsed"] for p in predictions) < 16
    assert metrics["accuracy"] == sum(p["correct"] for p in predictions) / 16
    assert set(metrics["accuracy_by_category"]) == {"button", "icon"}
    distances = [p["distance"] for p in predictions if p["parsed"]]
    assert metrics["mean_distance"] == pytest.approx(sum(distances) / len(distances))
    for p, record in zip(predictions, data.records):
        assert p["reference"] == clicks.target_text(record, data.frames[record["key"]], "t")
        if p["parsed"]:
            assert p["correct"] == clicks.in_box(*p["point"], record["box"])


def test_a_box_whose_corners_are_swapped_is_refused_with_its_file_and_line(tmp_path):
    make_click_split(tmp_path, "raw", 3, seed=0)
    lines = (tmp_path / "raw.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    x1, y1, x2, y2 = record["box"]
    lines[1] = json.dumps(record | {"box": [x2, y1, x1, y2]})
    (tmp_path / "raw.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"raw.jsonl:2: field 'box': must be \[x1, y1, x2, y2\] with x1 <= x2"):
        prepare_split(tmp_path / "raw.jsonl", tmp_path / "images", tmp_path / "prepared.jsonl")
    assert not (tmp_path / "prepared.jsonl").exists()


def test_the_report_draws_the_target_box_and_the_answered_point_on_the_thumbnail(tmp_path):
    import base64
    import io

    from vlft.report.page import examples_html
    from vlft.report.study import Evaluation
    from vlft.thumbnails import thumbnail_jpeg

    Image.new("RGB", (400, 200), (255, 255, 255)).save(tmp_path / "screen.png")
    # The thumbnail is 160 x 80: every original pixel coordinate is scaled by 0.4.
    drawn = Image.open(io.BytesIO(thumbnail_jpeg(str(tmp_path / "screen.png"), [100, 50, 200, 150], [300, 100])))
    assert drawn.size == (160, 80)
    r, g, b = drawn.getpixel((40, 40))  # the box's left edge, x = 100 x 0.4
    assert g > 150 and r < 100 and b < 120, (r, g, b)
    r, g, b = drawn.getpixel((120, 40))  # the point's crosshair, (300, 100) x 0.4
    assert r > 180 and g < 100 and b < 100, (r, g, b)
    assert drawn.getpixel((140, 70))[0] > 240 and drawn.getpixel((140, 70))[1] > 240  # elsewhere untouched

    predictions = [
        {"id": "a", "question": "Click OK", "reference": "(375, 500)", "prediction": "(750, 500)", "category": "text"}
        | {"box": [100, 50, 200, 150], "point": [300, 100], "correct": False, "parsed": True, "distance": 0.5},
        {"id": "b", "question": "Click OK", "reference": "(375, 500)", "prediction": "?", "category": "text"}
        | {"box": [100, 50, 200, 150], "point": None, "correct": False, "parsed": False, "distance": None},
    ]
    write_jsonl(tmp_path / "predictions.jsonl", predictions)
    write_jsonl(tmp_path / "prepared.jsonl", [{"id": i, "image": "screen.png"} for i in "ab"])
    page = examples_html(
        [
            Evaluation(
                "e",
                "s",
                "val",
                "",
                str(tmp_path / "predictions.jsonl"),
                str(tmp_path / "prepared.jsonl"),
                str(tmp_path),
            )
        ]
    )
    assert "Green: the target box; red: the point answered." in page and "0 right, 2 wrong" in page
    images = [base64.b64decode(src) for src in re.findall(r"base64,([^\"]+)\"", page)]
    # The answered point is drawn on the first, not on the unparseable second; both show the box.
    assert images[0] == thumbnail_jpeg(str(tmp_path / "screen.png"), [100, 50, 200, 150], [300, 100])
    assert images[1] == thumbnail_jpeg(str(tmp_path / "screen.png"), [100, 50, 200, 150], None)
