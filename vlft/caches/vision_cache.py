"""The frozen-vision cache: the vision tower's outputs for every distinct image of a split, computed once.

LoRA trains the language model only, so the vision tower's output for an image is the same at every
step of every epoch and every stage. Stored here per image, in safetensors shards in the model's
dtype (bf16 on a GPU, so nothing is lost against computing them each step): the merged
embeddings that take the image tokens' place and, for Qwen3-VL, the deepstack features that early
decoder layers add; the grid sizes come with them. Training then hands these to the model in place
of pixels (CachedVision) and never runs the tower. The index is written last and the directory
renamed into place, so a cache is complete or absent.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlft.errors import ConfigError
from vlft.files import atomic_path
from vlft.caches.image_cache import ImageCache
from vlft.modeling import unwrapped
from vlft.caches.shards import ShardedCache, ShardWriter, finish_cache


def feature_layout(model_config) -> tuple[int, int]:
    """(width of one image token's features, number of deepstack levels) of a Qwen-VL config."""
    text = getattr(model_config, "text_config", model_config)
    levels = len(getattr(model_config.vision_config, "deepstack_visual_indexes", None) or [])
    return text.hidden_size, levels


def estimate_bytes(pixel_cache: ImageCache, model_config, dtype: torch.dtype) -> int:
    """Size of the vision cache of a split, known from the pixel cache's grids before anything runs."""
    width, levels = feature_layout(model_config)
    tokens = sum(pixel_cache.num_image_tokens(image_id) for image_id in pixel_cache.entries)
    return tokens * width * (1 + levels) * dtype.itemsize


def check_budget(estimated: int, max_gb: float, output_dir) -> None:
    if estimated > max_gb * 1e9:
        raise ConfigError(
            f"vision_cache_max_gb: the vision cache {output_dir} would take {estimated / 1e9:.3g} GB, more than the "
            f"{max_gb:g} GB it allows; raise vision_cache_max_gb or set vision_cache: false for the experiments "
            "that use it"
        )


@torch.no_grad()
def build_vision_cache(
    pixel_cache_dir: str | Path,
    model,
    output_dir: str | Path,
    max_gb: float,
    device: torch.device,
    batch_tokens: int = 32768,
    shard_bytes: int = 1 << 30,
) -> int:
    """Run the model's vision tower over every image of a pixel cache, batched by patch count."""
    pixels = ImageCache(pixel_cache_dir)
    backbone = model.model
    dtype = backbone.visual.dtype
    check_budget(estimate_bytes(pixels, model.config, dtype), max_gb, output_dir)
    ids = list(pixels.entries)
    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        writer = ShardWriter(tmp, shard_bytes)
        writer.records = pixels.records
        start, levels = 0, []
        while start < len(ids):
            batch, patches = [], 0
            while start + len(batch) < len(ids) and (not batch or patches < batch_tokens):
                image_id = ids[start + len(batch)]
                batch.append(image_id)
                patches += pixels.num_image_tokens(image_id) * pixels.settings.merge_size**2
            start += len(batch)
            patch_rows = torch.cat([pixels.model_input(i, device, dtype) for i in batch])
            grids = torch.tensor([pixels.grid_thw(i) for i in batch], device=device)
            out = backbone.get_image_features(patch_rows, grids, return_dict=True)
            sizes = [pixels.num_image_tokens(i) for i in batch]

            def per_image(features):  # some transformers versions split per image, others do not
                return list(features) if isinstance(features, (list, tuple)) else list(torch.split(features, sizes))

            embeds = per_image(out.pooler_output)
            levels = [per_image(level) for level in getattr(out, "deepstack_features", None) or []]
            for n, image_id in enumerate(batch):
                features = [embeds[n]] + [level[n] for level in levels]
                writer.add(
                    {"id": image_id, "grid_thw": pixels.grid_thw(image_id)},
                    torch.stack(features, dim=1).cpu().contiguous(),
                )
        return finish_cache(tmp, writer, VisionCache.KIND, merge_size=pixels.settings.merge_size, levels=len(levels))


class VisionCache(ShardedCache):
    """The vision cache of one split; the same questions as ImageCache, other answers."""

    KIND = "vision"

    def __init__(self, directory: str | Path):
        super().__init__(directory)
        self.merge_size = self.index["merge_size"]

    def device_input(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(image tokens, 1 + deepstack levels, width): what CachedVision turns back into tower outputs."""
        return features.to(dtype)


class CachedVision(torch.nn.Module):
    """Stands in for a Qwen-VL vision tower: its "pixel values" are cached outputs, returned as they are.

    The model's own code around the tower (splitting per image, placing embeddings at the image
    tokens, M-RoPE positions from the grids, deepstack injection) runs unchanged.
    """

    def __init__(self, tower):
        super().__init__()
        self.spatial_merge_size = tower.spatial_merge_size
        self.levels = len(getattr(tower, "deepstack_visual_indexes", None) or [])
        self.dtype = tower.dtype  # what the model casts the cached features to

    def forward(self, cached: torch.Tensor, grid_thw=None, **kwargs):
        if cached.dim() != 3:
            raise ValueError("CachedVision takes features from the vision cache, not pixel patches")
        out = BaseModelOutputWithPooling(last_hidden_state=cached[:, 0], pooler_output=cached[:, 0])
        if self.levels:
            out["deepstack_features"] = [cached[:, 1 + level] for level in range(self.levels)]
        return out


def use_vision_cache(model) -> None:
    """Replace the vision tower of a Qwen-VL model (or a PEFT model around one) by CachedVision, freeing its weights."""
    outer = unwrapped(model)
    outer.model.visual = CachedVision(outer.model.visual)
