"""What a ``.beton`` holds, seen through ffcv's own decoders: sample thumbnails as a PNG grid, and
samples exported as image files exactly as they are stored."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline.data.runtime import ThreadCountPreservingLoader

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from ffcv.libffcv import imdecode
from ffcv.loader import OrderOption
from ffcv.reader import Reader

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


_JPEG_MODE = 0  # RGBImageField's stored modes: 0 JPEG, 1 raw pixels


def stored_images(path: str | Path, indices: np.ndarray) -> Iterator[tuple[int, np.ndarray, int]]:
    """(index, image HxWx3 uint8, label) of each sample, at its stored size, decoded as ffcv's loaders
    decode it before they crop (raw pixels as stored; JPEG by libffcv's own ``imdecode``)."""
    reader = Reader(str(path))
    sizes = dict(zip(reader.alloc_table["ptr"].tolist(), reader.alloc_table["size"].tolist()))
    with open(path, "rb") as beton:
        for index in indices.tolist():
            image, label = reader.metadata[index]["f0"], int(reader.metadata[index]["f1"])
            height, width, pointer = int(image["height"]), int(image["width"]), int(image["data_ptr"])
            beton.seek(pointer)
            stored = np.frombuffer(beton.read(sizes[pointer]), dtype=np.uint8)
            if image["mode"] == _JPEG_MODE:
                decoded = np.empty((height, width, 3), dtype=np.uint8)
                imdecode(stored, decoded, height, width, height, width, 0, 0, 1, 1, False, False)
            else:
                decoded = stored.reshape(height, width, 3)
            yield index, decoded, label


def export_samples(path: str | Path, indices: np.ndarray, classes: list[str], directory: Path) -> list[Path]:
    """Each sample as a lossless PNG ``<index>_<class>.png`` in ``directory`` (index zero-padded: file
    order sorts as the .beton's), its pixels exactly as ffcv decodes them."""
    directory.mkdir(parents=True, exist_ok=True)
    digits = len(str(max(int(indices.max()), 0)))
    written = []
    for index, image, label in stored_images(path, indices):
        name = re.sub(r"[^\w.-]+", "-", classes[label])
        written.append(directory / f"{index:0{digits}d}_{name}.png")
        Image.fromarray(image).save(written[-1])
    return written
