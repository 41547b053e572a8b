"""Talk with a trained stage about an image: each line you type is a question, answered as the
stage's evaluation would answer it, with the conversation so far as its history (the stage's prompt
format for earlier rounds). The model is loaded once.

    python scripts/chat.py results/train/exp4/stage2 --image x.png

Lines starting with `/`: `/image PATH` talks about another image (a new conversation), `/clear`
starts the conversation again, `/quit` (or end of input) ends it. A click stage's answers give the
point, in pixels of the image."""

import argparse
import sys

from vlft.config import load_schema
from vlft.jobs.cli import run, set_cpu_threads


def main():
    evaluation = load_schema()["properties"]["evaluation"]["properties"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", help="a trained stage: results/train/<experiment>/<stage>")
    parser.add_argument("--image", required=True, help="the image to talk about")
    parser.add_argument("--max-new-tokens", type=int, default=evaluation["max_new_tokens"]["default"])
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    from vlft.generation.predict import Predictor
    from vlft.jobs import progress

    progress.hidden = True  # a turn's progress lines would come between the question and its answer

    predictor = Predictor(args.stage, threads=args.threads)
    image, history = args.image, []
    interactive = sys.stdin.isatty()
    print(f"{args.stage}: ask about {image} (/image PATH, /clear, /quit)", file=sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            break
        question = line.strip()
        if not question:
            continue
        if question.startswith("/image "):
            image, history = question[len("/image ") :].strip(), []
            print(f"now about {image}", file=sys.stderr)
            continue
        if question == "/clear":
            history = []
            continue
        [answer] = predictor.answer([{"image": image, "question": question, "history": history}], args.max_new_tokens)
        point = f"  (point: {answer['point']})" if answer.get("point") else ""
        print(f"{answer['answer']}{point}", flush=True)
        history = history + [{"question": question, "answer": answer["answer"]}]


if __name__ == "__main__":
    run(main)
