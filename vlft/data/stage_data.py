"""The records and encoded samples of a stage or an evaluation: prepared splits joined to their pixel caches."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlft.data import clicks
from vlft.data.answers import AnswerFormat, target_text
from vlft.errors import InputError
from vlft.files import read_jsonl
from vlft.caches.image_cache import ImageCache
from vlft.caches.shards import read_index
from vlft.caches.vision_cache import VisionCache
from vlft.data.prompts import PromptBuilder, Sample
from vlft.data.records import select_records


@dataclass
class StageData:
    # Each with "key", unique across the splits joined here (`<prepared split>#<id>`), and "source_split",
    # the prepared split it came from: a field of its own, never parsed back out of the key.
    records: list[dict]
    images: dict[
        str, tuple[ImageCache | VisionCache, str]
    ]  # by record key: the cache holding its image, and its id there
    samples: dict[str, Sample]  # by record key
    frames: dict[str, clicks.Frame]  # by record key, for click answers: how the model sees the image
    # By record key, for preference pairs: the rejected answer's sample (its record_id the record's
    # key too: it asks the same question about the same image); `samples` holds the chosen one.
    rejected: dict[str, Sample] = field(default_factory=dict)


CACHE_KINDS = {cls.KIND: cls for cls in (ImageCache, VisionCache)}


def open_cache(directory: str) -> ImageCache | VisionCache:
    """A pixel or vision cache, as its index says it is."""
    return CACHE_KINDS[read_index(directory)["kind"]](directory)


def load_stage_data(
    prepared: list[str],
    cache_dirs: list[str],
    builder: PromptBuilder,
    filters: dict,
    answer_format: str,
    max_seq_len: int,
    convention: clicks.Convention | None = None,
    pairs: bool = False,
    only_pairs: bool = False,
) -> StageData:
    """The records of the prepared splits that pass `filters`, each encoded as a sample in
    `answer_format` of at most `max_seq_len` tokens, with the cache holding its image. Click answers
    are written in the model family's coordinates (`convention`). With `pairs` (a preference stage)
    every record must be a pair, and its rejected answer is encoded too; with `only_pairs` (held-out
    pairs of an eval split) the records without one are left out instead."""
    records, images = [], {}
    for split_path, cache_dir in zip(prepared, cache_dirs):
        cache = open_cache(cache_dir)
        split_records = select_records(read_jsonl(split_path), filters)  # some splits may have none
        if only_pairs:
            split_records = [r for r in split_records if "rejected" in r]
        for record in split_records:
            if record["id"] not in cache.records:
                raise InputError(cache_dir, f"record {record['id']} of {split_path} is not in the image cache")
            key = f"{split_path}#{record['id']}"
            records.append(dict(record, key=key, source_split=split_path))
            images[key] = (cache, cache.image_of(record["id"]))
    if not records:  # checked when the workflow starts too, where the raw splits exist by then
        raise InputError(", ".join(prepared), f"the stage's filter {filters} selects no record of its splits")
    frames = {}
    if answer_format == AnswerFormat.CLICK:
        frames = {r["key"]: convention.frame(r, grid_of(images, r["key"])) for r in records}

    def target(record: dict) -> str:
        if answer_format == AnswerFormat.CLICK:
            return clicks.target_text(record, frames[record["key"]], record["source_split"])
        return target_text(record["answer"], answer_format)

    samples = {
        r["key"]: builder.sample(r["key"], r, target(r), image_tokens_of(images, r["key"]), max_seq_len)
        for r in records
    }
    rejected = {}
    if pairs:
        for r in records:
            if "rejected" not in r:
                raise InputError(
                    r["source_split"], f"record {r['id']} has no 'rejected' answer: a dpo stage learns from pairs alone"
                )
            text = target_text(r["rejected"], answer_format)
            rejected[r["key"]] = builder.sample(r["key"], r, text, image_tokens_of(images, r["key"]), max_seq_len)
    return StageData(records, images, samples, frames, rejected)


def uses_vision_cache(data: StageData) -> bool:
    return any(isinstance(cache, VisionCache) for cache, _ in data.images.values())


def grid_of(images: dict, key: str) -> list[int]:
    cache, image_id = images[key]
    return cache.grid_thw(image_id)


def image_tokens_of(images: dict, key: str) -> int:
    cache, image_id = images[key]
    return cache.num_image_tokens(image_id)
