"""Answer a question about an image (or a JSONL of them) with a trained stage, as its evaluation would:
its base model, adapter, pixel settings and answer format, read from the stage.

    python scripts/predict.py results/train/exp4/stage2 --image x.png --question "What color is the shape?"
    python scripts/predict.py results/train/exp4/stage2 --questions asked.jsonl   # {"image", "question"} a line

One JSON line an answer on stdout. For a click stage, each answer's point (in pixels of the image)
is drawn on a copy of the image, written beside --drawn's path."""

import argparse
import json
from pathlib import Path

from vlft.jobs.cli import run, set_cpu_threads
from vlft.config import load_schema
from vlft.errors import InputError


def main():
    evaluation = load_schema()["properties"]["evaluation"]["properties"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", help="a trained stage: results/train/<experiment>/<stage>")
    parser.add_argument("--image", help="an image file")
    parser.add_argument("--question", help="the question about it")
    parser.add_argument("--questions", help='a JSONL file of {"image": path, "question": text}, images relative to it')
    parser.add_argument("--max-new-tokens", type=int, default=evaluation["max_new_tokens"]["default"])
    parser.add_argument("--drawn", default="clicks", help="folder for a click stage's images with the point drawn")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    if bool(args.questions) == bool(args.image and args.question):
        raise InputError("arguments", "give --image and --question, or --questions")
    set_cpu_threads(args.threads)
    # torch and transformers: after the arguments are checked
    from vlft.generation.predict import draw_click, predict, read_questions

    if args.questions:
        questions = read_questions(args.questions)
    else:
        questions = [{"image": args.image, "question": args.question}]

    for number, answer in enumerate(predict(args.stage, questions, args.max_new_tokens, threads=args.threads)):
        if "point" in answer:
            drawn = Path(args.drawn) / f"{number:04d}-{Path(answer['image']).stem}.jpg"
            drawn.parent.mkdir(parents=True, exist_ok=True)
            draw_click(answer["image"], answer["point"], drawn)
            answer["drawn"] = str(drawn)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    run(main)
