"""Resize every image of a prepared split once, as the model's image processor would, into safetensors shards."""

import argparse

from vlft.jobs.cli import run
from vlft.caches.image_cache import PixelSettings, build_image_cache
from vlft.modeling import load_image_processor


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", required=True, help="prepared JSONL")
    parser.add_argument("--image-root", required=True, help="directory the records' image paths are relative to")
    parser.add_argument("--model", required=True, help="model directory, for its image processor settings")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--min-pixels", type=int, required=True)
    parser.add_argument("--max-pixels", type=int, required=True)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--output", required=True, help="cache directory to create")
    args = parser.parse_args()
    processor = load_image_processor(args.model, trust_remote_code=args.trust_remote_code)
    settings = PixelSettings.from_processor(processor, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    count = build_image_cache(
        prepared_jsonl=args.records,
        image_root=args.image_root,
        output_dir=args.output,
        settings=settings,
        threads=args.threads,
    )
    print(f"cached {count} images in {args.output}")


if __name__ == "__main__":
    run(main)
