"""Validate a raw split (every record, every image) and write its normalized JSONL."""

import argparse

from vlft.jobs.cli import run
from vlft.data.records import prepare_split


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", required=True, help="raw JSONL, one record a line")
    parser.add_argument("--image-root", required=True, help="directory the records' image paths are relative to")
    parser.add_argument("--output", required=True, help="normalized JSONL to write")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    count = prepare_split(raw_jsonl=args.records, image_root=args.image_root, output=args.output, threads=args.threads)
    print(f"{args.records}: {count} records and their images are valid")


if __name__ == "__main__":
    run(main)
