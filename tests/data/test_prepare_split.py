"""prepare_split on bad input: one clear error naming the file and line, and nothing half-written."""

import json
import subprocess
import sys
import pytest
from PIL import Image
from tests.helpers import REPO
from vlft.data.records import aspect_ratio_problem


def record(i, **fields):
    return {"id": i, "image": f"{i}.png", "question": "What color?", "answer": "Final answer: red", **fields}


@pytest.fixture
def split(tmp_path):
    """A valid raw split of three records; tests break one thing in it."""
    for i in range(3):
        Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / f"{i}.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record(i)) + "\n" for i in range(3)))
    return path


def prepare(split_path):
    output = split_path.parent / "prepared" / "train.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/prepare_split.py"),
            "--records",
            str(split_path),
            "--image-root",
            str(split_path.parent),
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
    )
    return result, output


def assert_one_error(result, output, *expected):
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert not output.exists() and not list(output.parent.glob(".*tmp*"))


def test_valid_split_is_prepared(split):
    result, output = prepare(split)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["width"] for r in rows] == [40, 40, 40] and rows[0]["id"] == "0"


def test_missing_image(split):
    (split.parent / "1.png").unlink()
    assert_one_error(*prepare(split), f"{split}:2", "field 'image'", "file not found", "1.png")


def test_unreadable_image(split):
    (split.parent / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert_one_error(*prepare(split), f"{split}:3", "field 'image'", "cannot be read as an image")


def test_truncated_image(split):
    data = (split.parent / "0.png").read_bytes()
    (split.parent / "0.png").write_bytes(data[: len(data) // 2])
    assert_one_error(*prepare(split), f"{split}:1", "cannot be read as an image")


def test_image_beyond_the_processors_aspect_ratio_limit(split):
    Image.new("RGB", (3000, 10)).save(split.parent / "1.png")
    assert_one_error(
        *prepare(split),
        f"{split}:2",
        "field 'image'",
        "3000x10 pixels",
        "aspect ratio must be smaller than 200, got 300",
    )


@pytest.mark.parametrize("size", [(2000, 10), (2001, 10), (10, 2001), (200, 1), (201, 1), (1920, 1080)])
def test_the_aspect_ratio_check_refuses_what_the_image_processor_refuses(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width, height = size
    try:
        smart_resize(height, width)
        refused = False
    except ValueError:
        refused = True
    assert (aspect_ratio_problem(width, height) is not None) == refused


def test_malformed_line(split):
    lines = split.read_text().splitlines()
    lines[1] = lines[1][:-5]
    split.write_text("\n".join(lines) + "\n")
    assert_one_error(*prepare(split), f"{split}:2", "not valid JSON")


def test_a_split_with_a_byte_order_mark_and_crlf_lines_is_read_as_the_plain_file(split):
    """As Windows tools save JSONL: the same prepared records, byte for byte."""
    plain_result, plain_output = prepare(split)
    assert plain_result.returncode == 0, plain_result.stderr
    plain = plain_output.read_bytes()
    plain_output.unlink()  # the same output path: this run writes it anew
    windows = split.parent / "windows.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + split.read_bytes().replace(b"\n", b"\r\n"))
    result, output = prepare(windows)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes() == plain


def test_a_split_that_is_not_utf8_is_one_sentence_naming_the_line(split):
    lines = split.read_text().splitlines()
    lines[1] = lines[1].replace("What color?", "Qu\u00e9 color?")
    split.write_bytes("\n".join(lines).encode("latin-1"))
    column = lines[1].encode("latin-1").index(b"\xe9") + 1
    assert_one_error(*prepare(split), f"{split}:2: not UTF-8 text (byte 0xe9 at column {column})")


@pytest.mark.parametrize("field", ["question", "answer"])
def test_record_without_question_or_answer(split, field):
    rows = [record(i) for i in range(3)]
    del rows[2][field]
    split.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_one_error(*prepare(split), f"{split}:3", f"field '{field}'", "missing")


@pytest.mark.parametrize("where", ["absolute", "climbing out"])
def test_an_image_outside_the_image_root_is_refused(split, where):
    """Its thumbnail would go into the shareable report: an image the dataset's owner never put under
    its root (here a real image beside the root) is one sentence naming the line and the field."""
    outside = split.parent.parent / f"outside-{split.parent.name}.png"
    Image.new("RGB", (40, 30), (0, 0, 200)).save(outside)
    rows = [json.loads(line) for line in split.read_text().splitlines()]
    rows[1]["image"] = str(outside) if where == "absolute" else f"../{outside.name}"
    split.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = prepare(split)
    assert_one_error(*result, f"{split}:2", "field 'image'", f"lies outside the dataset's image_root {split.parent}")


def test_an_image_root_of_links_to_a_shared_store_is_a_root_like_any_other(split, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    (split.parent / "2.png").rename(store / "2.png")
    (split.parent / "2.png").symlink_to(store / "2.png")
    result, output = prepare(split)
    assert result.returncode == 0, result.stderr


def test_a_line_of_absurd_length_is_one_sentence_not_an_allocation(split):
    """A line past 16 MiB (a file of another kind, line breaks lost) stops at its line number; the
    reader holds at most the limit of it."""
    from vlft.files import MAX_LINE_BYTES

    with open(split, "a") as out:
        out.write(json.dumps(record(3, answer="x" * (MAX_LINE_BYTES + 10))) + "\n")
    result, output = prepare(split)
    assert_one_error(result, output, f"{split}:4: longer than 16 MiB: no record is this long")


def test_a_duplicate_id_names_the_line_that_repeats_it_and_the_first(split):
    with open(split, "a") as out:
        out.write(json.dumps(record(3)) + "\n" + json.dumps(record(1)) + "\n")
    (split.parent / "3.png").write_bytes((split.parent / "0.png").read_bytes())
    result, output = prepare(split)
    assert_one_error(result, output, f"{split}:5: field 'id': duplicate id (first seen on line 2)")


def peak_memory_mib(split, records: int) -> float:
    """prepare_split's peak resident memory on a split of `records` records on its three images."""
    split.write_text("".join(json.dumps(record(i, image=f"{i % 3}.png")) + "\n" for i in range(records)))
    # VmHWM, the high-water mark of this program's own memory: ru_maxrss would count the pages of
    # the test's process that the child shared between fork and exec.
    probe = (
        "import sys; from vlft.data.records import prepare_split; "
        "prepare_split(sys.argv[1], sys.argv[2], sys.argv[3]); "
        "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(split), str(split.parent), str(split.parent / "out.jsonl")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1]) / 1024


def test_prepare_split_streams_its_records(split):
    """Ten times the records, and its memory grows by the 8 bytes a record its check of repeated ids
    keeps (2 MB here), not by the records: held whole, 300,000 records took some 900 MB more."""
    small, large = peak_memory_mib(split, 30_000), peak_memory_mib(split, 300_000)
    assert large - small < 20, (small, large)
