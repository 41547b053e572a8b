"""What the Kvasir-VQA importer holds in memory: a file of Kvasir-VQA's published shape and size
(58,849 rows on 6,500 images, each row carrying its image's bytes, row groups of 100 rows as
Hugging Face datasets writes image parquet), imported in a child process whose peak resident
memory is read from the kernel (ru_maxrss).

    python benchmarks/importer_memory.py --work /tmp/kvasir-memory

The images are smooth JPEGs of the originals' 1036 x 1288 pixels (some 60 KB each); the peak
depends on one row group's bytes and the records' text, not on the file's size."""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

QUESTIONS = [
    ("Are there any abnormalities in the image? Check all that are present.", "polyp"),
    ("How many findings are present?", "1"),
    ("What color is the abnormality?", "pink; red"),
    ("Where in the image is the abnormality?", "center; lower-left"),
    ("Is there a green/black box artefact?", "no"),
    ("What type of procedure is the image taken from?", "colonoscopy"),
    ("Is this finding easy to detect?", "yes"),
    ("Have all polyps been removed?", "not relevant"),
    ("Are there any anatomical landmarks in the image?", "none"),
    ("Are there any instruments in the image? Check all that are present.", "none"),
]


def jpeg(seed: int, size=(1036, 1288)) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : size[1], 0 : size[0]]
    base = (np.sin(x / (40 + seed % 17)) + np.cos(y / (30 + seed % 13))) * 60 + 120
    pixels = np.stack([base, base * 0.8 + 20, base * 0.6 + 40], axis=-1) + rng.normal(0, 3, (size[1], size[0], 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_published_file(path: Path, rows: int, images: int) -> None:
    """Kvasir-VQA's shape, one row group of 100 rows at a time (this writer holds one, too)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("question", pa.string()),
            ("answer", pa.string()),
            ("source", pa.string()),
            ("img_id", pa.string()),
        ]
    )
    per_image = [rows // images + (i < rows % images) for i in range(images)]
    with pq.ParquetWriter(path, schema) as writer:
        batch = []
        for image, count in enumerate(per_image):
            data = jpeg(image)
            for q in range(count):
                question, answer = QUESTIONS[q % len(QUESTIONS)]
                batch.append(
                    {
                        "image": {"bytes": data, "path": None},
                        "question": question,
                        "answer": answer,
                        "source": "hyperkvasir",
                        "img_id": f"cl8k{image:05d}",
                    }
                )
                if len(batch) == 100:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=100)
                    batch = []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="a directory with room for the file (about 4 GB)")
    parser.add_argument("--rows", type=int, default=58_849)
    parser.add_argument("--images", type=int, default=6_500)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.work / f"kvasir-vqa-{args.rows}.parquet"
    if not source.exists():
        started = time.time()
        write_published_file(source, args.rows, args.images)
        print(f"wrote {source} ({source.stat().st_size / 2**30:.2f} GiB) in {time.time() - started:.0f} s")
    out = args.work / "imported"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    started = time.time()
    done = subprocess.run(
        [sys.executable, "scripts/import_dataset.py", "kvasir-vqa", "--parquet", str(source), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(done.stderr)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    summary = json.loads(done.stdout.splitlines()[-1])
    result = {
        "rows": args.rows,
        "file_gib": round(source.stat().st_size / 2**30, 2),
        "records": summary["records"],
        "images": summary["images"],
        "peak_rss_mib": round(peak_mib),
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
