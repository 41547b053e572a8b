"""What checking the caches' checksums costs (vlft.integrity): the CRC-32 of one image's cached tensor,
as a reader checks it the first time it reads it, for the 8B's Kvasir-sized entries (sha256 beside it,
for the choice), and that time as a share of the jobs at the speeds measured in benchmarks/README.md:
of one CPU core in training (the loader thread, beside the GPU), of the wall time in evaluation
(which reads images in its main thread; pixel caches only). CPU only.

    python benchmarks/checksum_cost.py
"""

import hashlib
import json
import platform
import time

import torch

from vlft.integrity import tensor_checksum

# One Kvasir image at the researchers' resolution: about 1,300 tokens, 2x2 patches of 16x16 each.
TOKENS = 1300
PIXEL_ENTRY = torch.randint(0, 256, (TOKENS * 4 * 16 * 16, 3), dtype=torch.uint8)  # its resized RGB pixels, ~4 MB
# Its vision-cache entry on Qwen3-VL-8B: the merged tokens and 3 deepstack levels, 4,096 wide, bf16.
VISION_ENTRY = torch.randn(TOKENS * 4, 4096, dtype=torch.bfloat16)
# Images a second on an H200, 8B, 9 questions an image (benchmarks/README.md): image-grouped
# training, and evaluation sharing each image; long answers and short.
IMAGES_PER_S = {
    "train long": 38.85 / 9,
    "train short": 69.65 / 9,
    "evaluate long": 19.49 / 9,
    "evaluate short": 45.37 / 9,
}


def seconds_per_call(check, tensor: torch.Tensor, repeats: int = 5) -> float:
    check(tensor)
    started = time.perf_counter()
    for _ in range(repeats):
        check(tensor)
    return (time.perf_counter() - started) / repeats


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()


def main() -> None:
    rows = []
    for name, tensor in (("pixels", PIXEL_ENTRY), ("vision", VISION_ENTRY)):
        for algorithm, check in (("crc32", tensor_checksum), ("sha256", sha256)):
            seconds = seconds_per_call(check, tensor)
            row = {"cache": name, "algorithm": algorithm, "entry_mb": tensor.nbytes / 1e6, "ms": seconds * 1e3}
            row["gb_per_s"] = tensor.nbytes / seconds / 1e9
            # Evaluation reads pixel caches only.
            row |= {k: seconds * rate for k, rate in IMAGES_PER_S.items() if name == "pixels" or "train" in k}
            rows.append(row)
            shares = "  ".join(f"{k} {100 * row[k]:.2f}%" for k in IMAGES_PER_S if k in row)
            print(
                f"{name:6s} {algorithm:6s} {row['entry_mb']:5.1f} MB {row['ms']:6.2f} ms {row['gb_per_s']:.2f} GB/s  {shares}"
            )
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows}))


if __name__ == "__main__":
    main()
