"""What a ``.beton`` holds, seen through ffcv's own decoders: sample thumbnails as a PNG grid."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline.data.runtime import ThreadCountPreservingLoader

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from ffcv.loader import OrderOption

_CAPTION_HEIGHT = 14


def spread_indices(num_samples: int, count: int) -> np.ndarray:
    """``count`` sample indices spread evenly over the file (so several classes show up)."""
    return np.unique(np.linspace(0, num_samples - 1, min(count, num_samples)).round().astype(np.int64))


def decode_samples(path: str | Path, indices: np.ndarray, size: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, size, size, 3] uint8 -- each image's central square, resized -- and labels [N])."""
    loader = ThreadCountPreservingLoader(
        str(path), batch_size=len(indices), num_workers=1, order=OrderOption.SEQUENTIAL, indices=indices,
        drop_last=False, pipelines={"image": [CenterCropRGBImageDecoder((size, size), ratio=1.0)],
                                    "label": [IntDecoder()]},
    )
    images, labels = next(iter(loader))
    return images.copy(), labels.reshape(-1).copy()  # ffcv reuses its buffers


def sample_grid(images: np.ndarray, captions: list[str]) -> Image.Image:
    """Thumbnails in a near-square grid, each captioned (its class)."""
    count, size = len(images), images.shape[1]
    columns = math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    grid = Image.new("RGB", (columns * size, rows * (size + _CAPTION_HEIGHT)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * size, (i // columns) * (size + _CAPTION_HEIGHT)
        grid.paste(Image.fromarray(image), (x, y))
        draw.text((x + 2, y + size + 1), caption[: max(1, size // 6)], fill="black")
    return grid
