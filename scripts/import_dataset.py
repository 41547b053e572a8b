"""Bring a published dataset to our records: one JSONL per split (and, for Kvasir-VQA, its images),
ready to name under `datasets:` in a config.

    python scripts/import_dataset.py kvasir-vqa --parquet data/*.parquet --out data/kvasir
    python scripts/import_dataset.py kvasir-vqa-x1 --x1 x1/*.parquet --parquet data/*.parquet --out data/kvasir-x1
    python scripts/import_dataset.py chat --json train.json --image-root data/images --out data/chat
    python scripts/import_dataset.py screenspot --json screenspot_web.json --out data/screenspot
    python scripts/import_dataset.py screenspot --parquet ScreenSpot/data/test-*.parquet --out data/screenspot
    python scripts/import_dataset.py pairs --parquet rlaif-v/*.parquet --out data/rlaif-v
    python scripts/import_dataset.py vqa --files SLAKE/train.json SLAKE/validate.json SLAKE/test.json \
        --image-root SLAKE/imgs --category content_type --keep q_lang=en --out data/slake
"""

import argparse
import json

from vlft.data import importers
from vlft.jobs.cli import run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    formats = parser.add_subparsers(dest="format", required=True)
    kvasir = formats.add_parser("kvasir-vqa", help="Kvasir-VQA as published (parquet with the image bytes)")
    kvasir.add_argument("--parquet", nargs="+", required=True)
    x1 = formats.add_parser("kvasir-vqa-x1", help="Kvasir-VQA-x1, its images from Kvasir-VQA's parquet")
    x1.add_argument("--x1", nargs="+", required=True, help="Kvasir-VQA-x1's train-*.parquet and test-*.parquet files")
    x1.add_argument("--parquet", nargs="+", required=True, help="Kvasir-VQA's parquet files, for the images")
    chat = formats.add_parser("chat", help="LLaMA-Factory, ms-swift or LLaVA conversations (JSON / JSONL)")
    chat.add_argument("--json", nargs="+", required=True)
    chat.add_argument("--image-root", required=True, help="the directory the records' image paths are relative to")
    chat.add_argument("--split", default="train", help="the split the records form")
    chat.add_argument(
        "--answer-coordinates",
        choices=["qwen3-vl", "qwen2.5-vl", "qwen2-vl", "pixels"],
        help='what a box or point written in an answer ("bbox_2d", <|box_start|>) is measured in: a click record',
    )
    clicks = formats.add_parser("screenspot", help="ScreenSpot v1, v2 or Pro (JSON), or the Hub mirror (parquet)")
    clicks.add_argument("--json", nargs="+", default=[])
    clicks.add_argument("--parquet", nargs="+", default=[], help="the Hub mirror's files, screenshots inside")
    clicks.add_argument("--image-root", help="where the JSON files' images are: their sizes check (or scale) the boxes")
    clicks.add_argument(
        "--bbox",
        choices=["auto", "xywh", "xyxy"],
        default="auto",
        help="x, y, width, height; or corners; auto: corners for ScreenSpot-Pro and the Hub mirror, else x, y, w, h",
    )
    clicks.add_argument(
        "--bbox-units",
        choices=["auto", "pixels", "fractions"],
        default="auto",
        help="auto: fractions of the image where every box of a file lies within 0-1 (the Hub mirror), else pixels",
    )
    clicks.add_argument("--split", default="test", help="the split the records form")
    vqa = formats.add_parser("vqa", help="flat image / question / answer rows (JSON, JSONL, CSV, parquet)")
    vqa.add_argument("--files", nargs="+", required=True, help="the split files as published (train.json, ...)")
    vqa.add_argument("--image-root", help="where the images named by path are (embedded images need none)")
    for field in ("image", "question", "answer", "id"):
        vqa.add_argument(f"--{field}", help=f"the {field} field's name, where it is not one of the usual ones")
    vqa.add_argument("--category", help="the field the report's accuracy is broken down by")
    vqa.add_argument("--split-field", help="the field naming each row's split; else the file's name says it")
    vqa.add_argument("--split-map", nargs="+", default=[], metavar="VALUE=SPLIT", help="split-field values mapped")
    vqa.add_argument("--keep", nargs="+", default=[], metavar="FIELD=VALUE", help="import only these rows")
    vqa.add_argument("--split", help="the split of a file whose name says none (train, val or test)")
    pairs = formats.add_parser("pairs", help="flat preference pairs as RLAIF-V publishes them (parquet)")
    pairs.add_argument("--parquet", nargs="+", required=True, help="rows of image, question, chosen, rejected")
    pairs.add_argument("--split", default="train", help="the split the records form")
    sample = formats.add_parser(
        "sample", help="the first N images of each split of an imported dataset (a smoke study)"
    )
    sample.add_argument("--from", dest="source", required=True, help="an importer's output directory")
    sample.add_argument("--images", nargs="+", required=True, metavar="SPLIT=N", help="images kept of each split")
    sample.add_argument("--out", required=True, help="a new directory for the sampled split JSONL files")
    for sub in (kvasir, x1, chat, clicks, vqa, pairs):
        sub.add_argument("--out", required=True, help="a new directory for the split JSONL files (and images)")
        sub.add_argument(
            "--skip-bad-rows",
            action="store_true",
            help="import the rows that fit; every refused row is listed in <out>.refused.jsonl either way",
        )
    args = parser.parse_args()

    if args.format == "kvasir-vqa":
        summary = importers.import_kvasir_vqa(args.parquet, args.out, args.skip_bad_rows)
    elif args.format == "kvasir-vqa-x1":
        summary = importers.import_kvasir_vqa_x1(args.x1, args.parquet, args.out, args.skip_bad_rows)
    elif args.format == "chat":
        summary = importers.import_chat(
            args.json, args.image_root, args.out, args.split, args.skip_bad_rows, args.answer_coordinates
        )
    elif args.format == "vqa":
        summary = importers.import_flat_vqa(
            args.files,
            args.out,
            args.image_root,
            {f: getattr(args, f) for f in ("image", "question", "answer", "id") if getattr(args, f)},
            args.category,
            args.split_field,
            args.split,
            pairs_of(parser, args.keep, "--keep"),
            pairs_of(parser, args.split_map, "--split-map"),
            args.skip_bad_rows,
        )
    elif args.format == "sample":
        from vlft.data.importers.sample import sample_splits

        counts = pairs_of(parser, args.images, "--images")
        if bad := [n for n in counts.values() if not n.isdigit() or int(n) < 1]:
            parser.error(f"--images takes SPLIT=N with N a positive whole number, not {' '.join(bad)}")
        summary = sample_splits(args.source, args.out, {k: int(v) for k, v in counts.items()})
    elif args.format == "pairs":
        summary = importers.import_pairs(args.parquet, args.out, args.split, args.skip_bad_rows)
    else:
        if not args.json and not args.parquet:
            parser.error("screenspot: give --json or --parquet files")
        files = args.json + args.parquet
        summary = importers.import_screenspot(
            files, args.out, args.bbox, args.split, args.image_root, args.bbox_units, args.skip_bad_rows
        )
    print(json.dumps(summary))


def pairs_of(parser, words: list[str], option: str) -> dict[str, str]:
    """KEY=VALUE words as a dict; a word without '=' is a usage error naming the option."""
    bad = [w for w in words if "=" not in w]
    if bad:
        parser.error(f"{option} takes KEY=VALUE, not {' '.join(bad)}")
    return dict(w.split("=", 1) for w in words)


if __name__ == "__main__":
    run(main)
