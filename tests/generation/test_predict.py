"""predict.py on what it cannot use: one sentence naming the file and row."""

import subprocess
import sys
import pytest
from PIL import Image
from tests.helpers import REPO
from vlft.errors import InputError


def test_predict_on_what_is_no_trained_stage_is_one_sentence(tmp_path):
    command = [sys.executable, str(REPO / "scripts/predict.py"), str(tmp_path), "--image", "x.png", "--question", "?"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == (
        f"error: {tmp_path}: not a trained stage (no summary.json): give results/train/<experiment>/<stage>\n"
    )
    (tmp_path / "summary.json").write_text('{"steps": 3}')
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == (
        f"error: {tmp_path / 'summary.json'}: records no base model or answer settings (an earlier version): "
        "train it again\n"
    )
    result = subprocess.run(command[:3], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr == "error: arguments: give --image and --question, or --questions\n"


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"image": "a.png", "question": "How many?"'], ":1: not valid JSON (Expecting ',' delimiter at column 43)"),
        (['{"image": "a.png", "question": "?"}', '{"image": "a.png"}'], ":2: field 'question': missing or empty"),
        (['["a.png", "How many?"]'], ":1: each row must be a JSON object"),
        (['{"image": "b.png", "question": "How many?"}'], ":1: field 'image': file not found: {root}/b.png"),
        ([], ": no questions"),
    ],
    ids=["malformed", "no-question", "not-an-object", "missing-image", "empty"],
)
def test_predicts_questions_file_is_checked_with_its_row_named(tmp_path, lines, message):
    """scripts/predict.py --questions: a bad row, or an image it names that cannot be used, is one
    InputError naming the user's file and row, not a traceback or the temporary split predict makes."""
    from vlft.generation.predict import check_images, read_questions

    Image.new("RGB", (40, 30)).save(tmp_path / "a.png")
    asked = tmp_path / "asked.jsonl"
    asked.write_text("\n".join(lines))
    with pytest.raises(InputError) as refused:
        check_images(read_questions(asked))
    assert str(refused.value) == f"{asked}{message.format(root=tmp_path)}"


def test_predicts_one_image_that_cannot_be_used_is_named(tmp_path):
    from vlft.generation.predict import check_images

    with pytest.raises(InputError) as refused:
        check_images([{"image": str(tmp_path / "x.png"), "question": "?"}])
    assert str(refused.value) == f"{tmp_path / 'x.png'}: file not found"
