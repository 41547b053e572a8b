"""The pixel cache: every distinct image of a split decoded and resized once, stored as uint8
safetensors shards (one entry per image file, however many records ask about it: vlft.caches.shards).

Training and evaluation read these tensors and never decode a JPEG. Pixels are stored resized
but not normalized (uint8 is 4x smaller than float32 patches); `to_patches` turns them into
exactly the flat patches the model's image processor would have produced, on whatever device
the model runs on. Shards and index as vlft.caches.shards writes them: a cache that exists is complete.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from vlft.files import atomic_path, read_jsonl
from vlft.jobs.progress import progress_line
from vlft.caches.shards import ShardedCache, ShardWriter, finish_cache


@dataclass(frozen=True)
class PixelSettings:
    """How the model's image processor cuts an image into patches, and the resolution range."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resample: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_processor(cls, processor, min_pixels: int, max_pixels: int) -> "PixelSettings":
        return cls(
            patch_size=processor.patch_size,
            merge_size=processor.merge_size,
            temporal_patch_size=processor.temporal_patch_size,
            image_mean=tuple(processor.image_mean),
            image_std=tuple(processor.image_std),
            resample=int(processor.resample),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's resize: multiples of patch x merge, within the pixel range."""
        h, w = smart_resize(
            height,
            width,
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        return w, h


# PIL's modes of one channel of more than 8 bits: 16-bit grayscale PNGs and TIFFs (as medical images
# often are) open as one of these.
WIDE_GRAYSCALE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def load_resized(path: str | Path, settings: PixelSettings) -> np.ndarray:
    # transformers' own loading, as an inference server would feed the processor: the EXIF
    # orientation applied (the image as a person sees it), then any mode converted to RGB.
    with Image.open(path) as opened:
        image = load_image(eight_bit(opened))
    size = settings.target_size(*image.size)
    if size != image.size:
        image = image.resize(size, resample=settings.resample)
    return np.asarray(image, dtype=np.uint8)


def eight_bit(image: Image.Image) -> Image.Image:
    """`image` as it is, or a 16-bit grayscale one scaled to 8 bits (0-65535 to 0-255, as every viewer
    shows it), its EXIF orientation applied first (the scaled copy has none): PIL's own conversion
    to RGB, which transformers' load_image makes, clips such values at 255, so that nearly every
    pixel of a 16-bit image would be white."""
    if image.mode not in WIDE_GRAYSCALE_MODES:
        return image
    values = np.asarray(ImageOps.exif_transpose(image)).astype(np.float64)
    return Image.fromarray(np.rint(values / 257).clip(0, 255).astype(np.uint8))


def build_image_cache(
    prepared_jsonl: str | Path,
    image_root: str | Path,
    output_dir: str | Path,
    settings: PixelSettings,
    threads: int = 4,
    shard_bytes: int = 1 << 30,
) -> int:
    """Resize every distinct image of a prepared split (its images under `image_root`; many threads:
    PIL releases the GIL) into shards; returns the number of images. An image's identity in the
    cache is the sha256 of its bytes (prepare_split's `image_sha256`): records naming one file
    through different paths or links share its entry, and the cache says nothing of where the
    dataset lies."""
    records = read_jsonl(prepared_jsonl)
    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        writer = ShardWriter(tmp, shard_bytes)
        writer.records = {record["id"]: record["image_sha256"] for record in records}
        # Each image once, in the order of the first record asking about it.
        files = {}
        for record in records:
            files.setdefault(record["image_sha256"], Path(image_root) / record["image"])
        with ThreadPoolExecutor(max_workers=threads) as pool:
            # map() keeps the input order, so shards are written in that order.
            resized = pool.map(lambda path: load_resized(path, settings), files.values())
            with progress_line(len(files), "images") as progress:
                for image, pixels in zip(files, resized):
                    height, width = pixels.shape[:2]
                    grid = [1, height // settings.patch_size, width // settings.patch_size]
                    writer.add({"id": image, "grid_thw": grid}, torch.from_numpy(pixels.copy()))
                    progress.update(1)
        return finish_cache(tmp, writer, ImageCache.KIND, settings=asdict(settings))


class ImageCache(ShardedCache):
    """The pixel cache of one split: resized uint8 pixels and grid sizes by record id."""

    KIND = "pixels"

    def __init__(self, directory: str | Path):
        super().__init__(directory)
        settings = self.index["settings"]
        self.settings = PixelSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
        self.merge_size = self.settings.merge_size

    def device_input(self, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The image as the vision tower takes it: flat patches, made wherever the pixels are."""
        return to_patches(pixels, self.settings, dtype)


def to_patches(pixels: torch.Tensor, settings: PixelSettings, dtype=torch.float32) -> torch.Tensor:
    """uint8 (H, W, 3) -> the processor's flat patches (grid_h * grid_w, 3 * T * P * P).

    The same rescale, normalization and patch order as the Qwen2-VL image processor that every
    Qwen-VL family shares; a test checks equality against the processor itself.
    """
    p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    mean = torch.tensor(settings.image_mean, device=pixels.device).view(3, 1, 1)
    std = torch.tensor(settings.image_std, device=pixels.device).view(3, 1, 1)
    image = (pixels.permute(2, 0, 1).float() / 255.0 - mean) / std
    channels, height, width = image.shape
    gh, gw = height // p, width // p
    patches = image.reshape(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], t, p, p)
    return patches.reshape(gh * gw, channels * t * p * p).to(dtype)
