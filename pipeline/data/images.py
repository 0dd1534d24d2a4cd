"""Images from outside a ``.beton``, fed to a model exactly as the validation loader feeds it.

``build_val_loader`` decodes each stored image, takes ffcv's center crop (the central square of
``crop_ratio`` x the shorter side), resizes it to ``img_size`` with ffcv's own resize (OpenCV's
INTER_AREA, in ``libffcv``), and normalises with ``NormalizeToFloat``. Here an image file, its
encoded bytes or a uint8 array goes through the same steps: decoded as ``vitsweep data write``
reads images (Pillow, every mode to RGB: ``to_rgb_array``), cropped by ffcv's formula, resized by
the same ffcv function, normalised with the same float32 constants. An image stored raw in a
``.beton`` therefore gives the loader's input tensor bit for bit (``vitsweep predict`` agrees with
``vitsweep evaluate``); a JPEG-stored one differs by what re-encoding changed.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pipeline.data.loaders import normalization
from pipeline.data.sources import to_rgb_array
from pipeline.errors import InvalidInputError

# ffcv after pipeline.data.loaders, which imports it keeping torch's thread count
from ffcv.libffcv import resize_crop


class UnreadableImageError(InvalidInputError):
    """A file or a byte string that is not an image Pillow can decode."""


def decode_image(encoded: bytes, name: str = "image") -> np.ndarray:
    """Encoded bytes (PNG, JPEG, ... anything Pillow reads) as HxWx3 uint8 RGB."""
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            image.load()
            return to_rgb_array(image)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImageError(f"{name} is not a readable image ({type(err).__name__}: {err})") from None


def read_image(path: str | Path) -> np.ndarray:
    """An image file as HxWx3 uint8 RGB; UnreadableImageError naming the file if it is none."""
    try:
        encoded = Path(path).read_bytes()
    except OSError as err:
        raise UnreadableImageError(f"{str(path)!r} cannot be read ({err.strerror or err})") from None
    return decode_image(encoded, repr(str(path)))


def as_rgb_array(image: np.ndarray, name: str = "image") -> np.ndarray:
    """A uint8 array HxWx3 (RGB) or HxW (gray), C-contiguous; UnreadableImageError for any other shape or type."""
    array = np.asarray(image)
    if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] == 3)) \
            or 0 in array.shape:
        raise UnreadableImageError(f"{name} is a {array.dtype} array of shape {array.shape}; an image array is "
                                   "uint8 HxWx3 (RGB) or HxW (gray)")
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    return np.ascontiguousarray(array)


def center_crop_side(image: np.ndarray, crop_ratio: float, name: str = "image") -> int:
    """The side of ffcv's center crop of ``image`` (``get_center_crop``); UnreadableImageError if under a pixel."""
    height, width = image.shape[:2]
    side = int(crop_ratio * min(height, width))
    if side < 1:
        raise UnreadableImageError(f"{name} is {width}x{height} px: too small for a center crop at ratio {crop_ratio}")
    return side


def center_crop(image: np.ndarray, img_size: int, crop_ratio: float) -> np.ndarray:
    """ffcv's ``CenterCropRGBImageDecoder`` on a decoded image: its crop (``get_center_crop``), its resize."""
    height, width = image.shape[:2]
    side = center_crop_side(image, crop_ratio)
    top, left = (height - side) // 2, (width - side) // 2
    resized = np.empty((img_size, img_size, 3), dtype=np.uint8)
    resize_crop(np.ascontiguousarray(image), top, top + side, left, left + side, resized)
    return resized


def to_model_input(images: list[np.ndarray], img_size: int, crop_ratio: float, mean: tuple[float, float, float],
                   std: tuple[float, float, float]) -> torch.Tensor:
    """Decoded RGB images -> the validation loader's float32 batch [N, 3, img_size, img_size]."""
    crops = np.stack([center_crop(image, img_size, crop_ratio) for image in images])
    shift, scale = normalization(mean, std)
    return (torch.from_numpy(crops).permute(0, 3, 1, 2).float() - shift) * scale
