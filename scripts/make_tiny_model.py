"""Make the demo's tiny Qwen3-VL: random weights, a locally trained tokenizer, an image processor."""

import argparse

from vlft.jobs.cli import run
from vlft.demo.tiny_model import make_tiny_model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    make_tiny_model(output_dir=args.output, seed=args.seed, hidden_size=args.hidden_size, layers=args.layers)
    print(f"made a tiny Qwen3-VL in {args.output}")


if __name__ == "__main__":
    run(main)
