"""Pillow's affine transform with bicubic resampling, ``Image.transform(size, AFFINE, matrix, BICUBIC,
fillcolor=fill)``, on batches of images, value for value.

Pillow (``libImaging/Geometry.c``) maps each output pixel's centre (x + 0.5, y + 0.5) through the
matrix in C doubles, ``a0 xin + a1 yin + a2``; a source point outside the image keeps the fill colour.
Inside, ``xin - 0.5`` splits into a pixel ``x = floor`` and a fraction ``d``, and the a = -1 cubic
through pixels x-1 .. x+2 (edge pixels repeated) is evaluated in Horner form, p1 + d (p2 + d (p3 + d p4)),
along x on rows y-1 .. y+2 and then along y through the four results; the double is clipped into
0..255 and truncated. Both forms here repeat those double operations in the same order, so they
return Pillow's values exactly: float32, or the cubic written as four weights, truncates values that
land on an integer (every flat area) one level lower, and a fused multiply-add rounds differently.

- ``affine_bicubic_cpu``: a numba loop over pixels, as Pillow's (torch's per-element indexing costs
  ~10x Pillow's loop on a CPU);
- ``affine_bicubic_torch``: torch ops on any device, one operation per rounding step (no fused
  multiply-adds), 16 gathered taps per output pixel.

``affine_bicubic`` picks the form for the images' device. Images are float ``[k, 3, H, W]`` holding
uint8 values; ``matrices`` ``[k, 6]`` (float64, CPU) map output to source as Pillow's ``data``.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch


def affine_bicubic(images: torch.Tensor, matrices: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Pillow's bicubic affine transform of each image by its matrix; the result on the images' device."""
    if images.device.type == "cpu":
        return affine_bicubic_cpu(images, matrices, fill)
    return affine_bicubic_torch(images, matrices, fill)


def affine_bicubic_cpu(images: torch.Tensor, matrices: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    images = images.contiguous()
    out = torch.empty_like(images)
    _transform(images.numpy(), matrices.double().numpy(), fill.to(images.dtype).numpy(), out.numpy())
    return out


@numba.njit(nogil=True, cache=True)
def _cubic(v1, v2, v3, v4, d):
    # Geometry.c's BICUBIC macro, rounded in its order (no fastmath: LLVM keeps it).
    p2 = -v1 + v3
    p3 = 2 * (v1 - v2) + v3 - v4
    p4 = -v1 + v2 - v3 + v4
    return v2 + d * (p2 + d * (p3 + d * p4))


@numba.njit(nogil=True, cache=True)
def _row_cubic(plane, row, c0, c1, c2, c3, d):
    if d == 0.0:  # p1 + 0 * (...) is p1: Pillow's value, without the arithmetic
        return float(plane[row, c1])
    return _cubic(float(plane[row, c0]), float(plane[row, c1]), float(plane[row, c2]), float(plane[row, c3]), d)


@numba.njit(nogil=True, cache=True)
def _transform(images, matrices, fill, out):
    count, channels, height, width = images.shape
    for i in range(count):
        a0, a1, a2, a3, a4, a5 = matrices[i, 0], matrices[i, 1], matrices[i, 2], matrices[i, 3], matrices[i, 4], matrices[i, 5]
        for y in range(height):
            y_centre = y + 0.5
            for x in range(width):
                x_centre = x + 0.5
                source_x = a0 * x_centre + a1 * y_centre + a2
                source_y = a3 * x_centre + a4 * y_centre + a5
                if source_x < 0.0 or source_x >= width or source_y < 0.0 or source_y >= height:
                    for c in range(channels):
                        out[i, c, y, x] = fill[c]
                    continue
                source_x -= 0.5
                source_y -= 0.5
                column, row = math.floor(source_x), math.floor(source_y)
                dx, dy = source_x - column, source_y - row
                c0, c1 = max(column - 1, 0), min(max(column, 0), width - 1)
                c2, c3 = min(column + 1, width - 1), min(column + 2, width - 1)
                r0, r1 = max(row - 1, 0), min(max(row, 0), height - 1)
                r2, r3 = min(row + 1, height - 1), min(row + 2, height - 1)
                for c in range(channels):
                    plane = images[i, c]
                    if dy == 0.0:  # as above: the vertical cubic returns its second row
                        value = _row_cubic(plane, r1, c0, c1, c2, c3, dx)
                    else:
                        value = _cubic(
                            _row_cubic(plane, r0, c0, c1, c2, c3, dx), _row_cubic(plane, r1, c0, c1, c2, c3, dx),
                            _row_cubic(plane, r2, c0, c1, c2, c3, dx), _row_cubic(plane, r3, c0, c1, c2, c3, dx), dy,
                        )
                    out[i, c, y, x] = 0.0 if value <= 0.0 else 255.0 if value >= 255.0 else np.trunc(value)


def affine_bicubic_torch(images: torch.Tensor, matrices: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    count, channels, height, width = images.shape
    a0, a1, a2, a3, a4, a5 = matrices.to(images.device, torch.float64).view(count, 6, 1, 1).unbind(1)
    x = torch.arange(width, device=images.device, dtype=torch.float64).view(1, 1, width) + 0.5
    y = torch.arange(height, device=images.device, dtype=torch.float64).view(1, height, 1) + 0.5
    source_x, source_y = a0 * x + a1 * y + a2, a3 * x + a4 * y + a5  # [k, H, W], left to right as Pillow
    inside = (source_x >= 0) & (source_x < width) & (source_y >= 0) & (source_y < height)
    column, dx = _split(source_x - 0.5)
    row, dy = _split(source_y - 0.5)
    pixels = images.double().flatten(2)

    def taps(row_offset: int) -> list[torch.Tensor]:
        rows = (row + row_offset).clamp_(0, height - 1) * width
        return [pixels.gather(2, (rows + (column + offset).clamp_(0, width - 1)).view(count, 1, -1).expand(
            count, channels, -1)).view(count, channels, height, width) for offset in range(-1, 3)]

    dx, dy = dx.unsqueeze(1), dy.unsqueeze(1)
    rows = [_torch_cubic(*taps(offset), dx) for offset in range(-1, 3)]
    values = _torch_cubic(*rows, dy).clamp_(0, 255).floor_()  # Pillow clips, then truncates
    return torch.where(inside.unsqueeze(1), values.to(images.dtype), fill.to(images).view(1, channels, 1, 1))


def _split(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow's ``x = FLOOR(xin); d = xin - x``: the pixel and the fraction past it."""
    whole = shifted.floor()
    return whole.long(), shifted - whole


def _torch_cubic(v1, v2, v3, v4, d):
    p2 = v3 - v1  # -v1 + v3 exactly
    p3 = (v1 - v2).mul_(2).add_(v3).sub_(v4)
    p4 = (v2 - v1).sub_(v3).add_(v4)  # -v1 + v2 exactly, then in order
    return (p4 * d).add_(p3).mul_(d).add_(p2).mul_(d).add_(v2)
