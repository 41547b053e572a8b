"""The pixel cache: the processor's own patches, for images of every awkward shape."""

import json
import numpy as np
import torch
from PIL import ExifTags, Image
from transformers.image_utils import load_image
from vlft.files import read_jsonl
from vlft.caches.image_cache import ImageCache, PixelSettings, build_image_cache, to_patches
from vlft.modeling import load_image_processor
from vlft.data.records import prepare_split


def awkward_images(directory) -> dict[str, tuple[int, int]]:
    """Images as researchers have them, saved in `directory`; each name with its size as a person
    sees it (width, height)."""
    rng = np.random.default_rng(0)

    def noise(w, h, channels=3):
        return rng.integers(0, 255, (h, w, channels), dtype=np.uint8)

    sizes = {}

    def save(name, image, seen=None, **options):
        image.save(directory / name, **options)
        sizes[name] = seen or image.size

    save("rgb.jpg", Image.fromarray(noise(157, 211)))
    save("wide.jpg", Image.fromarray(noise(300, 120)))
    save("square.jpg", Image.fromarray(noise(64, 64)))
    # Stored 400x200, EXIF orientation 6: a camera held upright, seen as 200x400.
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6
    save("exif-rotated.jpg", Image.fromarray(noise(400, 200)), seen=(200, 400), exif=exif)
    save("grayscale.png", Image.fromarray(noise(120, 90, 1)[:, :, 0], mode="L"))
    save("rgba.png", Image.fromarray(noise(100, 140, 4), mode="RGBA"))
    save("palette.png", Image.fromarray(noise(130, 70)).convert("P", palette=Image.Palette.ADAPTIVE))
    save("cmyk.jpg", Image.fromarray(noise(90, 110, 4), mode="CMYK"))
    save("16bit.png", Image.fromarray(rng.integers(0, 65535, (80, 120), dtype=np.uint16)))
    save("tiny.png", Image.fromarray(noise(3, 2)))
    # Aspect ratios just under the image processor's limit of 200, both ways.
    save("strip-wide.png", Image.fromarray(noise(1990, 10)))
    save("strip-tall.png", Image.fromarray(noise(10, 1990)))
    return sizes


def test_cached_pixels_give_exactly_the_processors_patches(tmp_path, tiny_model_dir):
    """For every kind of image, the cache holds what the model's own processor makes of the image
    as transformers loads it (EXIF orientation applied, any mode to RGB; a 16-bit grayscale one
    scaled to 8 bits, not clipped): the same grid, the same patches, bit for bit."""
    sizes = awkward_images(tmp_path)
    assert Image.open(tmp_path / "16bit.png").mode.startswith("I") and Image.open(tmp_path / "cmyk.jpg").mode == "CMYK"
    rows = [{"id": name, "image": name, "question": "q", "answer": "a"} for name in sizes]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_split(tmp_path / "raw.jsonl", tmp_path, tmp_path / "prepared.jsonl")
    prepared = {r["id"]: (r["width"], r["height"]) for r in read_jsonl(tmp_path / "prepared.jsonl")}
    assert prepared == sizes
    processor = load_image_processor(tiny_model_dir)
    settings = PixelSettings.from_processor(processor, 32 * 32, 128 * 128)
    build_image_cache(tmp_path / "prepared.jsonl", tmp_path, tmp_path / "cache", settings, shard_bytes=50_000)
    cache = ImageCache(tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("shard-*.safetensors"))) > 1

    def as_seen(name):
        """The image as transformers loads it; a 16-bit one as viewers show it (0-65535 to 0-255),
        where transformers' own conversion clips it at 255, nearly white."""
        if name != "16bit.png":
            return load_image(str(tmp_path / name))
        wide = np.asarray(Image.open(tmp_path / name)).astype(np.float64)
        assert np.asarray(load_image(str(tmp_path / name))).mean() > 250  # what clipping makes of it
        return load_image(Image.fromarray(np.rint(wide / 257).astype(np.uint8), mode="L"))

    for name in sizes:
        expected = processor(
            images=[as_seen(name)],
            size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
            return_tensors="pt",
        )
        image = cache.image_of(name)
        assert cache.grid_thw(image) == expected["image_grid_thw"][0].tolist(), name
        assert torch.equal(to_patches(cache.tensor(image), cache.settings), expected["pixel_values"]), name
    # The rotated photo is cached upright: taller than wide, as a person and the processor see it.
    _, grid_h, grid_w = cache.grid_thw(cache.image_of("exif-rotated.jpg"))
    assert grid_h > grid_w
