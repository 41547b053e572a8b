"""An image as a small JPEG, a click's target and prediction drawn on it: for the report's examples
and for a prediction on one image (vlft.generation.predict)."""

from __future__ import annotations

import io

# A thumbnail's long side, in pixels.
THUMBNAIL_PX = 160


def thumbnail_jpeg(
    path: str, box: list[float] | None = None, point: list[float] | None = None, size: int | None = THUMBNAIL_PX
) -> bytes:
    """The image shrunk to a thumbnail (`size` pixels on its long side; None: as it is), as a JPEG;
    for a click, the target box (green) and the predicted point (red) drawn on it, both given in
    pixels of the original image."""
    from PIL import Image, ImageDraw, ImageOps

    with Image.open(path) as image:
        small = ImageOps.exif_transpose(image).convert("RGB")
        size = size or max(small.size)
        scale = size / max(small.size)
        small.thumbnail((size, size))
    scale = min(scale, 1.0)  # thumbnail() never enlarges
    pen = ImageDraw.Draw(small)
    if box is not None:
        pen.rectangle([round(v * scale) for v in box], outline=(0, 200, 60), width=2)
    if point is not None:
        x, y = point[0] * scale, point[1] * scale
        pen.ellipse((x - 4, y - 4, x + 4, y + 4), outline=(230, 20, 20), width=2)
        pen.line((x - 7, y, x + 7, y), fill=(230, 20, 20))
        pen.line((x, y - 7, x, y + 7), fill=(230, 20, 20))
    buffer = io.BytesIO()
    small.save(buffer, format="JPEG", quality=80)
    return buffer.getvalue()
