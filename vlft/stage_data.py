"""The records and encoded samples of a stage or an evaluation: prepared splits joined to their pixel caches."""

from __future__ import annotations

from dataclasses import dataclass

from vlft.answers import target_text
from vlft.errors import InputError
from vlft.files import read_jsonl
from vlft.image_cache import ImageCache
from vlft.prompts import PromptBuilder, Sample
from vlft.records import select_records


@dataclass
class StageData:
    records: list[dict]  # each with "key": unique across the splits joined here
    images: dict[str, tuple[ImageCache, str]]  # by record key: the cache holding its image, and its id there
    samples: dict[str, Sample]  # by record key


def load_stage_data(prepared: list[str], cache_dirs: list[str], builder: PromptBuilder, settings: dict) -> StageData:
    records, images = [], {}
    for split_path, cache_dir in zip(prepared, cache_dirs):
        cache = ImageCache(cache_dir)
        split_records = read_jsonl(split_path)
        split_records = select_records(split_records, settings.get("filter") or {}, split_path)
        for record in split_records:
            if record["id"] not in cache:
                raise InputError(cache_dir, f"record {record['id']} of {split_path} is not in the image cache")
            key = f"{split_path}#{record['id']}"
            records.append(dict(record, key=key))
            images[key] = (cache, record["id"])
    samples = {
        r["key"]: builder.sample(
            r["key"],
            r["question"],
            target_text(r["answer"], settings["answer_format"]),
            cache_of(images, r["key"]).num_image_tokens(r["id"]),
            settings["max_seq_len"],
        )
        for r in records
    }
    return StageData(records, images, samples)


def cache_of(images: dict, key: str) -> ImageCache:
    return images[key][0]
