"""Answer questions about images with a trained stage, the way its evaluation would: the same
base model, adapter, pixel settings, answer format, image path and generation (vlft.generation.evaluate), run
on a split made of the questions asked. The answer to a record is the evaluation's answer to it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from vlft.data.answers import AnswerFormat
from vlft.errors import InputError
from vlft.generation.evaluate import evaluate_split, load_answering_model
from vlft.files import read_jsonl, write_jsonl
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_image_processor
from vlft.data.importers.common import json_rows, required_text
from vlft.data.records import check_image, prepare_split
from vlft.thumbnails import thumbnail_jpeg
from vlft.trained_stage import TrainedStage

# Asked questions have no reference: the evaluation path needs one, and its judgement is dropped.
# A click's is a point at the image's corner (inside every image, as prepare_split requires).
NO_REFERENCE = {"answer": "unknown", "point": [0, 0]}


def stage_settings(stage: TrainedStage) -> dict:
    """The base model and answering settings a stage's summary records."""
    if not stage.summary.is_file():
        raise InputError(
            stage.summary.parent, "not a trained stage (no summary.json): give results/train/<experiment>/<stage>"
        )
    summary = stage.read_summary()
    if "answering" not in summary:
        raise InputError(stage.summary, "records no base model or answer settings (an earlier version): train it again")
    return summary


def base_model_dir(model: dict, summary_path: Path) -> str:
    """The base model's directory: as the config named it, from the workflow's directory, or where
    that was when the stage trained."""
    for path in (model["path"], model["resolved"]):
        if Path(path).is_dir():
            return path
    raise InputError(
        summary_path,
        f"its base model is at neither {model['path']} (from here) nor {model['resolved']}: run from the workflow's directory",
    )


def read_questions(path: str | Path) -> list[dict]:
    """A questions file, JSONL or a JSON array of {"image": path relative to it, "question": text}:
    a row that does not parse or lacks a field is one InputError naming the file, row and field;
    each question keeps its place, so that an image it names that cannot be used is named there too."""
    questions = []
    for where, row in json_rows(path):
        if not isinstance(row, dict):
            raise InputError(where[0], "each row must be a JSON object", where[1])
        image = Path(path).parent / required_text(row, "image", where)
        questions.append({"image": str(image), "question": required_text(row, "question", where), "where": where})
    if not questions:
        raise InputError(path, "no questions")
    return questions


def check_images(questions: list[dict]) -> None:
    """Each question's image readable, or one InputError naming it (where the question came from:
    its file and row, or the image given alone)."""
    for question in questions:
        problem = check_image(Path(question["image"]))
        if isinstance(problem, str):
            path, line = question.get("where", (question["image"], None))
            raise InputError(
                path, f"{problem}: {question['image']}" if line else problem, line, "image" if line else None
            )


class Predictor:
    """A trained stage answering questions, its model loaded once (the first time it is asked) and
    kept for the questions after: `vlft chat` asks one at a time."""

    def __init__(self, stage_dir: str | Path, threads: int = 4):
        self.stage = TrainedStage.at(stage_dir)
        self.summary = stage_settings(self.stage)
        self.model_dir = base_model_dir(self.summary["model"], self.stage.summary)
        answering, model = self.summary["answering"], self.summary["model"]
        self.clicks = answering["answer_format"] == AnswerFormat.CLICK
        processor = load_image_processor(self.model_dir, model["trust_remote_code"])
        self.pixels = PixelSettings.from_processor(processor, answering["min_pixels"], answering["max_pixels"])
        self.threads, self.loaded = threads, None

    def answer(self, questions: list[dict], max_new_tokens: int, batch_size: int = 16) -> list[dict]:
        """Each question ({image: path, question: text, and its conversation's earlier rounds as
        `history` where it has any}) with the stage's answer, and for a click stage the point answered,
        in pixels of the image."""
        from vlft.modeling import pick_device

        answering, model = self.summary["answering"], self.summary["model"]
        check_images(questions)
        if self.loaded is None:
            device, dtype = pick_device()
            self.loaded = load_answering_model(
                self.model_dir, str(self.stage.adapter), model["trust_remote_code"], device, dtype
            )
        with tempfile.TemporaryDirectory(prefix="vlft-predict-") as work:
            work = Path(work)
            records = [
                {"id": str(i), "image": str(Path(q["image"]).resolve()), "question": q["question"]}
                | ({"history": q["history"]} if q.get("history") else {})
                | ({"answer": NO_REFERENCE["answer"]} | ({"point": NO_REFERENCE["point"]} if self.clicks else {}))
                for i, q in enumerate(questions)
            ]
            write_jsonl(work / "asked.jsonl", records)
            # The images where the questions name them: absolute paths, under the root of the file system.
            prepare_split(work / "asked.jsonl", "/", work / "prepared.jsonl", self.threads)
            build_image_cache(work / "prepared.jsonl", "/", work / "cache", self.pixels, self.threads)
            settings = answering | {"max_new_tokens": max_new_tokens, "batch_size": batch_size}
            evaluate_split(
                self.model_dir,
                str(self.stage.adapter),
                str(work / "prepared.jsonl"),
                str(work / "cache"),
                settings,
                work / "predictions.jsonl",
                work / "metrics.json",
                model["trust_remote_code"],
                loaded=self.loaded,
            )
            answers = read_jsonl(work / "predictions.jsonl")
        return [
            {"image": q["image"], "question": q["question"], "answer": a["prediction"]}
            | ({"point": a["point"]} if self.clicks else {})
            for q, a in zip(questions, answers)
        ]


def predict(
    stage_dir: str | Path, questions: list[dict], max_new_tokens: int, batch_size: int = 16, threads: int = 4
) -> list[dict]:
    """Each question answered by the stage (Predictor.answer)."""
    return Predictor(stage_dir, threads).answer(questions, max_new_tokens, batch_size)


def draw_click(image: str | Path, point: list[float] | None, output: str | Path) -> None:
    """The image with the point answered drawn on it (a red cross in a circle), as a JPEG."""
    Path(output).write_bytes(thumbnail_jpeg(str(image), point=point, size=None))
