"""The shard store both caches use: one tensor per distinct image, in safetensors shards of about a
set size, and a JSON index naming each image's shard and key and its grid, which image each record
asks about, and the cache's kind.

An image is identified by its resolved path (symbolic links followed): the records of a split that
ask several questions about one image file point to one entry, so an image is decoded, resized,
stored and run through the vision tower once however many questions it has (vlft.forward.image_groups).

A cache is complete when its index exists: builders write into a temporary directory
(vlft.files.atomic_path), end through `finish_cache`, which writes the index last, and the directory
is renamed into place. Readers open a directory as the kind its index names. The index holds each
image's CRC-32 and each shard's size; a reader checks them as it reads (vlft.integrity).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from vlft.errors import InputError
from vlft.integrity import damaged, tensor_checksum

INDEX = "index.json"
# 2: the index names the cache's kind; 3: one entry per image, records point to it; 4: checksums
FORMAT = 4


class ShardWriter:
    """Image tensors, in order, into safetensors shards of about `shard_bytes`; each entry notes its
    shard and key; `records` maps each record id to the id of its image."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.shards, self.entries, self.sizes = [], [], {}
        self.records: dict[str, str] = {}
        self._shard, self._size = {}, 0

    def add(self, entry: dict, tensor: torch.Tensor) -> None:
        key = str(len(self.entries))
        self._shard[key] = tensor
        self._size += tensor.nbytes
        shard = f"shard-{len(self.shards):05d}.safetensors"
        self.entries.append(dict(entry, shard=shard, key=key, crc32=tensor_checksum(tensor)))
        if self._size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if self._shard:
            name = f"shard-{len(self.shards):05d}.safetensors"
            save_file(self._shard, self.directory / name)
            self.shards.append(name)
            self.sizes[name] = (self.directory / name).stat().st_size
            self._shard, self._size = {}, 0


def finish_cache(directory: Path, writer: ShardWriter, kind: str, **metadata) -> int:
    """Write the last shard, then the index: last, since its presence marks the cache complete."""
    writer.flush()
    index = {
        "format": FORMAT,
        "kind": kind,
        **metadata,
        "shards": writer.shards,
        "shard_sizes": writer.sizes,
        "images": writer.entries,
        "records": writer.records,
    }
    (directory / INDEX).write_text(json.dumps(index))
    return len(writer.entries)


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:  # cut short or overwritten: its shards cannot be found
        raise damaged(Path(directory), path, f"not the JSON the cache wrote ({error})", "rebuilds the cache") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise InputError(directory, "a cache written by an older version of this workflow; delete it and run again")
    return index


class ShardedCache:
    """Read access to a cache directory of one kind: per image id, a tensor in a shard and the
    image's grid; per record id, the id of its image. Subclasses say what the model takes from the
    tensor."""

    KIND = ""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.index = read_index(directory)
        if self.index["kind"] != self.KIND:
            raise InputError(directory, f"a {self.index['kind']} cache, where a {self.KIND} cache was expected")
        self.entries = {entry["id"]: entry for entry in self.index["images"]}
        self.records: dict[str, str] = self.index["records"]
        self._shards, self._verified = {}, set()

    def image_of(self, record_id: str) -> str:
        """The id of the image a record asks about (KeyError for a record the cache does not hold)."""
        return self.records[record_id]

    def grid_thw(self, image_id: str) -> list[int]:
        return self.entries[image_id]["grid_thw"]

    def num_image_tokens(self, image_id: str) -> int:
        t, h, w = self.grid_thw(image_id)
        return t * h * w // self.merge_size**2

    def tensor(self, image_id: str) -> torch.Tensor:
        """An image's tensor, checked against its checksum the first time this reader reads it."""
        entry = self.entries[image_id]
        shard = self.directory / entry["shard"]
        try:
            if entry["shard"] not in self._shards:
                size, expected = shard.stat().st_size, self.index["shard_sizes"][entry["shard"]]
                if size != expected:
                    raise self._damaged(shard, f"{size} bytes where the cache wrote {expected}")
                self._shards[entry["shard"]] = safe_open(shard, framework="pt")
            tensor = self._shards[entry["shard"]].get_tensor(entry["key"])
        except (OSError, SafetensorError) as err:
            raise self._damaged(shard, f"unreadable ({err})") from None
        if image_id not in self._verified:
            if tensor_checksum(tensor) != entry["crc32"]:
                raise self._damaged(shard, f"image {image_id}'s bytes differ from the checksum written with them")
            self._verified.add(image_id)
        return tensor

    def _damaged(self, shard: Path, what: str) -> InputError:
        return damaged(self.directory, shard, what, f"rebuilds this {self.KIND} cache")

    def device_input(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What the model takes for an image, from its cached tensor already on the device."""
        raise NotImplementedError

    def model_input(self, image_id: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.device_input(self.tensor(image_id).to(device), dtype)
