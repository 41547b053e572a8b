"""Run the frozen vision tower once over a split's pixel cache and store its outputs (the vision cache)."""

import argparse

from vlft.jobs.cli import add_cpu_fallback_argument, run
from vlft.modeling import load_base_model, pick_device, require_gpus
from vlft.caches.vision_cache import build_vision_cache


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pixels", required=True, help="the split's pixel cache")
    parser.add_argument("--model", required=True)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--max-gb", type=float, required=True, help="refuse a cache larger than this")
    parser.add_argument("--output", required=True)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the job asked for; 0 runs it on the CPU")
    add_cpu_fallback_argument(parser)
    args = parser.parse_args()
    require_gpus(args.gpus, args.cpu_fallback)
    device, dtype = pick_device()
    model = load_base_model(args.model, device, dtype, trust_remote_code=args.trust_remote_code)
    count = build_vision_cache(
        pixel_cache_dir=args.pixels, model=model, output_dir=args.output, max_gb=args.max_gb, device=device
    )
    print(f"cached the vision outputs of {count} images in {args.output}")


if __name__ == "__main__":
    run(main)
