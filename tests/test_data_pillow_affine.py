"""Pillow's bicubic affine transform on batches, value for value: the numba form (CPU) and the torch form
(every other device, checked here on the CPU)."""
import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.pillow_affine import affine_bicubic, affine_bicubic_cpu, affine_bicubic_torch

FILL = (124, 116, 104)


def _matrices(width: int, height: int) -> list[tuple[float, ...]]:
    """Identity, whole-pixel and just-under-whole-pixel shifts, shears, rotations, scalings and random maps."""
    rng = np.random.default_rng(0)
    matrices = [(1, 0, 0, 0, 1, 0), (1, 0, 3, 0, 1, -2), (1, 0, np.nextafter(7.0, 0.0), 0, 1, np.nextafter(-3.0, -4.0)),
                (1, 0.3, 0, 0, 1, 0), (1, 0, 0, -0.27, 1, 0), (0.5, 0, 0, 0, 2, -height / 2)]
    for angle in np.radians([13.0, -29.5, 90.0, 180.0]):
        cos, sin = np.cos(angle), np.sin(angle)
        matrices.append((cos, sin, width / 2 * (1 - cos) - sin * height / 2, -sin, cos, height / 2 * (1 - cos) + sin * width / 2))
    for _ in range(6):
        a0, a1, a3, a4 = rng.uniform(-1.5, 1.5, 4)
        matrices.append((a0, a1, rng.uniform(-width, 2 * width), a3, a4, rng.uniform(-height, 2 * height)))
    return [tuple(float(value) for value in matrix) for matrix in matrices]


@pytest.mark.parametrize("transform", [affine_bicubic_cpu, affine_bicubic_torch], ids=["numba", "torch"])
@pytest.mark.parametrize("height, width", [(32, 32), (20, 31)])
def test_each_form_equals_pillows_bicubic_affine_transform(transform, height, width):
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    flat = np.repeat(np.repeat(rng.integers(0, 256, (2, 2, 3), dtype=np.uint8), 16, 0), 16, 1)[:height, :width]
    matrices = _matrices(width, height)
    cases = [(image, matrix) for image in (noise, flat) for matrix in matrices]
    expected = np.stack([np.asarray(Image.fromarray(image).transform(
        (width, height), Image.AFFINE, matrix, Image.BICUBIC, fillcolor=FILL)) for image, matrix in cases])
    images = torch.from_numpy(np.stack([image for image, _ in cases])).permute(0, 3, 1, 2).float()
    out = transform(images, torch.tensor([matrix for _, matrix in cases], dtype=torch.float64), torch.tensor(FILL))
    np.testing.assert_array_equal(out.permute(0, 2, 3, 1).numpy(), expected)


def test_affine_bicubic_keeps_dtype_shape_and_device_and_leaves_the_input_alone():
    images = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).remainder(256).view(2, 3, 5, 6)
    before = images.clone()
    out = affine_bicubic(images, torch.tensor([[1, 0.2, 0, 0, 1, 0]] * 2, dtype=torch.float64), torch.tensor(FILL))
    assert out.dtype == images.dtype and out.shape == images.shape and out.device == images.device
    assert torch.equal(images, before)
