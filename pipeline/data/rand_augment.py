"""timm's RandAugment, batched with torch ops on the training device: per-sample ops and magnitudes.

timm applies RandAugment per image with PIL in DataLoader processes; vitsweep's FFCV loader has
one iterator thread per process, where PIL ran at ~500 images/s at 224 px whatever the node's
cores. ``BatchRandAugment`` keeps timm's semantics -- the spec string is parsed by timm's own
``rand_augment_transform``; each sample draws its own ``num_layers`` ops (uniformly with
replacement, or timm's weighted choice without), applies each with probability ``p``, at its own
magnitude ``N(m, mstd)`` clipped to ``[0, mmax or 10]``, and a random sign where timm negates --
and runs each op once per layer on the samples that drew it, on a uint8 ``[B, 3, H, W]`` batch.

Every op returns exactly what its PIL counterpart (``timm.data.auto_augment``) returns: the colour
ops with the same integer formulas and truncation (float32 blends as Pillow computes them); rotate,
shear and translate with Pillow's bicubic resampler (the interpolation DeiT's hparams give timm;
without one timm picks bilinear or bicubic at random), its double arithmetic repeated operation by
operation in float64. The one deliberate difference: posterize to 0 bits is black where Pillow >= 10
raises (see ``posterize``).

Random draws come from a CPU ``torch.Generator`` seeded at construction: they are the same for a
given seed and sequence of batch sizes, and never wait for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from timm.data import auto_augment

_LEVEL_DENOM = 10.0  # timm's magnitude scale: level = magnitude / 10

Level = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]  # (magnitudes, signs, hparams) -> argument
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (images, arguments, fill) -> images


# -- the ops: float [k, 3, H, W] images holding uint8 values, one argument per image -----------------

def _per_image(values: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    return _to_device(values.to(images.dtype), images.device).view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # PIL's Image.blend (ImageEnhance): float32 `in1 + alpha * (in2 - in1)`, truncated into 0..255.
    return (degenerate + _per_image(factor, images) * (images - degenerate)).clamp_(0, 255).floor_()


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    # PIL's RGB -> L: (R*19595 + G*38470 + B*7471 + 0x8000) >> 16, exact in float32 (< 2**24).
    red, green, blue = images.unbind(1)
    return ((red * 19595 + green * 38470 + blue * 7471 + 32768) / 65536).floor_().unsqueeze(1)


def _lookup(images: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Per-channel lookup tables ``[k, 3, 256]`` applied to ``images`` (PIL's ``Image.point``)."""
    k, channels, height, width = images.shape
    indices = images.reshape(k * channels, height * width).long()
    return tables.reshape(k * channels, 256).to(images.dtype).gather(1, indices).view(k, channels, height, width)


def _histograms(images: torch.Tensor) -> torch.Tensor:
    """Per-channel 256-bin histograms ``[k, 3, 256]`` (PIL's ``Image.histogram``)."""
    k, channels = images.shape[:2]
    offsets = torch.arange(k * channels, device=images.device).view(k, channels, 1, 1) * 256
    counts = torch.bincount((images.long() + offsets).flatten(), minlength=k * channels * 256)
    return counts.view(k, channels, 256)


def auto_contrast(images: torch.Tensor, _arguments: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # PIL's ImageOps.autocontrast: per channel, lut[i] = int(i * scale + offset) in float64, clipped.
    low = images.amin(dim=(2, 3)).double()
    high = images.amax(dim=(2, 3)).double()
    # tensor / tensor: torch computes `scalar / tensor` as a product with the reciprocal, which can
    # land one ulp off Python's division and truncate one level lower.
    scale = torch.full_like(high, 255.0) / (high - low).clamp_min(1)
    offset = -low * scale
    levels = torch.arange(256, dtype=torch.float64, device=images.device)
    tables = (levels * scale.unsqueeze(-1) + offset.unsqueeze(-1)).trunc().clamp(0, 255)
    tables = torch.where((high > low).unsqueeze(-1), tables, levels)  # a flat channel is left alone
    return _lookup(images, tables)


def equalize(images: torch.Tensor, _arguments: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # PIL's ImageOps.equalize: step = (N - count of the last used level) // 255,
    # lut[i] = (step // 2 + pixels below level i) // step; identity for one level or step 0.
    histograms = _histograms(images)
    levels = torch.arange(256, device=images.device)
    last_used = torch.where(histograms > 0, levels, -1).amax(-1, keepdim=True)
    step = (histograms.sum(-1, keepdim=True) - histograms.gather(-1, last_used)) // 255
    below = histograms.cumsum(-1) - histograms
    tables = ((step // 2 + below) // step.clamp_min(1)).clamp_max(255)
    keep = ((histograms > 0).sum(-1, keepdim=True) <= 1) | (step == 0)
    return _lookup(images, torch.where(keep, levels, tables))


def invert(images: torch.Tensor, _arguments: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    return 255 - images


def posterize(images: torch.Tensor, bits: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # Keep the top `bits` bits; 8 is identity. 0 bits is black, as timm intends and Pillow < 10 did:
    # Pillow >= 10 refuses bits=0, so timm's own PosterizeIncreasing raises in a DataLoader worker at
    # magnitude 10 (2.3 % of its layers under DeiT's m9 std 0.5); returning black keeps timm's meaning.
    quantum = _per_image(2 ** (8 - bits.clamp(0, 8)), images)
    return (images / quantum).floor_() * quantum


def solarize(images: torch.Tensor, threshold: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    return torch.where(images < _per_image(threshold, images), images, 255 - images)


def solarize_add(images: torch.Tensor, addition: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # timm's solarize_add: levels below 128 get `addition`, capped at 255.
    return torch.where(images < 128, (images + _per_image(addition, images)).clamp_max(255), images)


def color(images: torch.Tensor, factor: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    return _blend(_grayscale(images).expand_as(images), images, factor)


def contrast(images: torch.Tensor, factor: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # PIL's ImageEnhance.Contrast: blend with the grey level int(mean of L + 0.5).
    mean = _grayscale(images).double().mean(dim=(1, 2, 3)).add(0.5).floor()
    return _blend(_per_image(mean, images).expand_as(images), images, factor)


def brightness(images: torch.Tensor, factor: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros_like(images), images, factor)


def sharpness(images: torch.Tensor, factor: torch.Tensor, _fill: torch.Tensor) -> torch.Tensor:
    # PIL's ImageEnhance.Sharpness: blend with ImageFilter.SMOOTH (3x3 kernel 1 1 1 / 1 5 1 / 1 1 1
    # over 13, rounded; the border rows and columns copied unchanged).
    # 3x3 sums of integers from slices: exact in float32, and faster than a grouped conv on CPU.
    rows = images[:, :, :-2] + images[:, :, 1:-1] + images[:, :, 2:]
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]
    smooth = images.clone()
    smooth[:, :, 1:-1, 1:-1] = ((box + 4 * images[:, :, 1:-1, 1:-1]) / 13).add_(0.5).floor_().clamp_(0, 255)
    return _blend(smooth, images, factor)


def _affine(images: torch.Tensor, matrices: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    # Imported here: numba loads when an image is first transformed, not when a config's spec is checked.
    from pipeline.data.pillow_affine import affine_bicubic

    return affine_bicubic(images, matrices, fill)


def _identity_but(index: int, values: torch.Tensor) -> torch.Tensor:
    """Pillow affine ``data`` rows ``[k, 6]``: the identity (1, 0, 0, 0, 1, 0) with entry ``index`` set to ``values``."""
    matrices = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64).repeat(len(values), 1)
    matrices[:, index] = values
    return matrices


def _rotation_matrix(degrees: float, width: int, height: int) -> tuple[float, ...]:
    """``Image.rotate``'s matrix, computed as Pillow computes it: Python floats, the angle mod 360, the
    trigonometry rounded to 15 decimals, about the image centre."""
    angle = -math.radians(degrees % 360.0)
    a0, a1 = round(math.cos(angle), 15), round(math.sin(angle), 15)
    a3, a4 = round(-math.sin(angle), 15), round(math.cos(angle), 15)
    centre_x, centre_y = width / 2, height / 2
    return (a0, a1, a0 * -centre_x + a1 * -centre_y + 0.0 + centre_x,
            a3, a4, a3 * -centre_x + a4 * -centre_y + 0.0 + centre_y)


def rotate(images: torch.Tensor, degrees: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    # PIL's Image.rotate: counter-clockwise for positive degrees. At 0 degrees (and quarter turns of a
    # square image) every pixel centre maps onto a pixel centre and the cubic returns that pixel, as
    # Pillow's copy and transpose fast paths do.
    height, width = images.shape[2:]
    matrices = torch.tensor([_rotation_matrix(angle, width, height) for angle in degrees.tolist()], dtype=torch.float64)
    return _affine(images, matrices, fill)


def shear_x(images: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    # timm: transform(AFFINE, (1, factor, 0, 0, 1, 0)): source x = x + factor * y.
    return _affine(images, _identity_but(1, factor), fill)


def shear_y(images: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return _affine(images, _identity_but(3, factor), fill)


def translate_x_rel(images: torch.Tensor, fraction: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    # timm: transform(AFFINE, (1, 0, pixels, 0, 1, 0)), pixels = fraction x width.
    return _affine(images, _identity_but(2, fraction * images.shape[3]), fill)


def translate_y_rel(images: torch.Tensor, fraction: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return _affine(images, _identity_but(5, fraction * images.shape[2]), fill)


# -- timm's level -> argument mappings (timm.data.auto_augment.*_level_to_arg), vectorised ----------

def _fraction(magnitudes: torch.Tensor) -> torch.Tensor:
    return magnitudes / _LEVEL_DENOM


def _no_argument(magnitudes: torch.Tensor, _signs: torch.Tensor, _hparams: dict) -> torch.Tensor:
    return torch.zeros_like(magnitudes)


def _rotate_level(magnitudes, signs, _hparams):
    return _fraction(magnitudes) * 30.0 * signs


def _enhance_level(magnitudes, _signs, _hparams):
    return _fraction(magnitudes) * 1.8 + 0.1


def _enhance_increasing_level(magnitudes, signs, _hparams):
    return (1.0 + _fraction(magnitudes) * 0.9 * signs).clamp_min(0.1)


def _shear_level(magnitudes, signs, _hparams):
    return _fraction(magnitudes) * 0.3 * signs


def _translate_rel_level(magnitudes, signs, hparams):
    return _fraction(magnitudes) * hparams.get("translate_pct", 0.45) * signs


def _posterize_level(magnitudes, _signs, _hparams):
    return (_fraction(magnitudes) * 4).trunc()


def _posterize_increasing_level(magnitudes, signs, hparams):
    return 4 - _posterize_level(magnitudes, signs, hparams)


def _posterize_original_level(magnitudes, signs, hparams):
    return _posterize_level(magnitudes, signs, hparams) + 4


def _solarize_level(magnitudes, _signs, _hparams):
    return (_fraction(magnitudes) * 256).trunc().clamp_max(256)


def _solarize_increasing_level(magnitudes, signs, hparams):
    return 256 - _solarize_level(magnitudes, signs, hparams)


def _solarize_add_level(magnitudes, _signs, _hparams):
    return (_fraction(magnitudes) * 110).trunc().clamp_max(128)


OPS: dict[str, tuple[Op, Level]] = {
    "AutoContrast": (auto_contrast, _no_argument),
    "Equalize": (equalize, _no_argument),
    "Invert": (invert, _no_argument),
    "Rotate": (rotate, _rotate_level),
    "Posterize": (posterize, _posterize_level),
    "PosterizeIncreasing": (posterize, _posterize_increasing_level),
    "PosterizeOriginal": (posterize, _posterize_original_level),
    "Solarize": (solarize, _solarize_level),
    "SolarizeIncreasing": (solarize, _solarize_increasing_level),
    "SolarizeAdd": (solarize_add, _solarize_add_level),
    "Color": (color, _enhance_level),
    "ColorIncreasing": (color, _enhance_increasing_level),
    "Contrast": (contrast, _enhance_level),
    "ContrastIncreasing": (contrast, _enhance_increasing_level),
    "Brightness": (brightness, _enhance_level),
    "BrightnessIncreasing": (brightness, _enhance_increasing_level),
    "Sharpness": (sharpness, _enhance_level),
    "SharpnessIncreasing": (sharpness, _enhance_increasing_level),
    "ShearX": (shear_x, _shear_level),
    "ShearY": (shear_y, _shear_level),
    "TranslateXRel": (translate_x_rel, _translate_rel_level),
    "TranslateYRel": (translate_y_rel, _translate_rel_level),
}


# -- the policy, parsed by timm, and the batched transform ------------------------------------------

@dataclass(frozen=True)
class RandAugmentPolicy:
    """What a timm RandAugment spec means, read off the transform timm's own parser builds."""

    ops: tuple[str, ...]
    num_layers: int
    prob: float
    magnitude: float
    magnitude_std: float  # inf: uniform in [0, magnitude], as timm
    magnitude_max: float
    choice_weights: tuple[float, ...] | None  # timm's weighted choice (without replacement), or uniform
    hparams: dict


def timm_hparams(img_size: int, mean: tuple[float, float, float]) -> dict:
    """The hparams timm's ``create_transform`` passes RandAugment for DeiT (bicubic, fill = mean)."""
    from PIL import Image

    return {
        "translate_const": int(img_size * 0.45),
        "img_mean": tuple(min(255, round(255 * m)) for m in mean),
        "interpolation": Image.BICUBIC,
    }


def use_timms_posterize_as_intended() -> None:
    """For timm's own RandAugment beside ours (benchmarks): its posterize makes 0 bits black, as Pillow < 10
    did. timm's PosterizeIncreasing reaches 0 bits at magnitude 10 (~0.2 % of images under DeiT's m9
    mstd0.5), which Pillow 13 rejects, ending a DataLoader worker or a benchmark mid-run."""
    from timm.data import auto_augment

    for name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
        auto_augment.NAME_TO_OP[name] = _timm_posterize_black_at_zero_bits


def _timm_posterize_black_at_zero_bits(img, bits_to_keep, **_):
    from PIL import Image
    from timm.data import auto_augment

    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return auto_augment.posterize(img, bits_to_keep)


def parse_policy(
    spec: str, img_size: int = 224, mean: tuple[float, float, float] = (0.485, 0.456, 0.406),
) -> RandAugmentPolicy:
    """Parse ``spec`` with timm's ``rand_augment_transform``; a ValueError names ops not batched here."""
    if not spec.startswith("rand"):
        raise ValueError(f"not a timm RandAugment spec: {spec!r} (it starts with 'rand', e.g. 'rand-m9-mstd0.5-inc1')")
    transform = auto_augment.rand_augment_transform(spec, timm_hparams(img_size, mean))
    names = tuple(op.name for op in transform.ops)
    unsupported = sorted(set(names) - set(OPS))
    if unsupported:
        raise ValueError(
            f"RandAugment spec {spec!r} selects {unsupported}, which the batched RandAugment does not implement; "
            f"it implements {sorted(OPS)} (timm's default and 'inc1' sets, and 'tweights')"
        )
    first = transform.ops[0]
    weights = transform.choice_weights
    return RandAugmentPolicy(
        ops=names, num_layers=transform.num_layers, prob=first.prob, magnitude=float(first.magnitude),
        magnitude_std=float(first.magnitude_std), magnitude_max=float(first.magnitude_max or _LEVEL_DENOM),
        choice_weights=None if weights is None else tuple(float(w) for w in weights), hparams=first.hparams,
    )


@dataclass(frozen=True)
class Draws:
    """One batch's random choices, per sample and layer: ``[B, num_layers]`` each (CPU tensors)."""

    ops: torch.Tensor  # index into the policy's ops
    applied: torch.Tensor  # bool: the op runs (probability p)
    magnitudes: torch.Tensor  # float64, clipped to [0, magnitude_max]
    signs: torch.Tensor  # float64, +1 or -1 (used by the ops timm negates)


class BatchRandAugment:
    """timm's RandAugment ``spec`` on uint8 ``[B, 3, H, W]`` batches, on the batch's device.

    ``fill`` is the colour exposed by rotate/shear/translate: timm's ``img_mean`` (``mean`` x 255).
    """

    def __init__(self, spec: str, img_size: int, mean: tuple[float, float, float], seed: int = 0):
        self.spec = spec
        self.policy = parse_policy(spec, img_size, mean)
        self.fill = torch.tensor(self.policy.hparams["img_mean"], dtype=torch.float32)
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, batch_size: int) -> Draws:
        policy, generator = self.policy, self.generator
        shape = (batch_size, policy.num_layers)
        if policy.choice_weights is None:
            ops = torch.randint(len(policy.ops), shape, generator=generator)
        else:
            weights = torch.tensor(policy.choice_weights).expand(batch_size, -1)
            ops = torch.multinomial(weights, policy.num_layers, replacement=False, generator=generator)
        applied = torch.rand(shape, generator=generator, dtype=torch.float64) < policy.prob
        if math.isinf(policy.magnitude_std):
            magnitudes = torch.rand(shape, generator=generator, dtype=torch.float64) * policy.magnitude
        else:
            noise = torch.randn(shape, generator=generator, dtype=torch.float64)
            magnitudes = policy.magnitude + policy.magnitude_std * noise
        magnitudes = magnitudes.clamp(0.0, policy.magnitude_max)
        signs = torch.where(torch.rand(shape, generator=generator, dtype=torch.float64) > 0.5, -1.0, 1.0)
        return Draws(ops, applied, magnitudes, signs)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """A new augmented uint8 batch; ``images`` is left as it was."""
        return self.augment_(images.clone())

    def augment_(self, images: torch.Tensor, draws: Draws | None = None) -> torch.Tensor:
        """Augment the uint8 batch ``images`` in place (and return it)."""
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"RandAugment takes a uint8 [B, 3, H, W] batch, got {images.dtype} {tuple(images.shape)}")
        draws = draws or self.draw(len(images))
        fill = _to_device(self.fill, images.device)
        for layer in range(self.policy.num_layers):
            chosen = torch.where(draws.applied[:, layer], draws.ops[:, layer], -1)
            for op_index in chosen.unique().tolist():
                if op_index < 0:
                    continue
                name = self.policy.ops[op_index]
                op, level = OPS[name]
                rows = torch.nonzero(chosen == op_index).flatten()
                arguments = level(draws.magnitudes[rows, layer], draws.signs[rows, layer], self.policy.hparams)
                on_device = _to_device(rows, images.device)
                # Every op returns whole numbers in 0..255 (as PIL's uint8 results): no rounding pass.
                images[on_device] = op(images[on_device].float(), arguments, fill).to(torch.uint8)
        return images


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    # The draws live on the CPU; pinned and non-blocking, their copies never make the loader
    # thread wait for the GPU (a pageable copy synchronises the stream).
    if values.device.type == "cpu" and device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)
