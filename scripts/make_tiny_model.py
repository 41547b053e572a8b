"""Make the demo's tiny model (a Qwen3-VL, or another family's): random weights, a locally trained tokenizer, an image processor."""

import argparse

from vlft.jobs.cli import run
from vlft.demo.tiny_model import FAMILIES, HYBRID_FAMILIES, make_tiny_model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--family", choices=FAMILIES + HYBRID_FAMILIES, default="qwen3_vl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    make_tiny_model(args.output, args.seed, args.hidden_size, args.layers, args.family)
    print(f"made a tiny {args.family} model in {args.output}")


if __name__ == "__main__":
    run(main)
