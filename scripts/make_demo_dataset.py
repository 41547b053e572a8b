"""Make one of the demo's synthetic datasets: shapes (VQA with four question categories and chain-of-thought
answers) or screens (click prediction: one button or icon among text labels)."""

import argparse

from vlft.jobs.cli import run
from vlft.demo import screens, shapes

KINDS = {"shapes": shapes, "screens": screens}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=sorted(KINDS), default="shapes")
    parser.add_argument("--image-root", required=True, help="directory to make the images in")
    parser.add_argument("--records", nargs="+", required=True, help="split=path of each split's JSONL")
    parser.add_argument("--sizes", nargs="+", required=True, help="split=count, e.g. train=800 test=200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions-per-image", type=int, default=1, help="shapes: up to this many questions an image")
    args = parser.parse_args()
    sizes = {name: int(count) for name, count in (item.split("=") for item in args.sizes)}
    records = dict(item.split("=", 1) for item in args.records)
    several = {"questions_per_image": args.questions_per_image} if args.questions_per_image > 1 else {}
    KINDS[args.kind].make_dataset(splits=records, image_root=args.image_root, sizes=sizes, seed=args.seed, **several)
    print(f"made {sizes} records, images in {args.image_root}")


if __name__ == "__main__":
    run(main)
