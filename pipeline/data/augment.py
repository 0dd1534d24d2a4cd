"""DeiT's training recipe (Touvron et al. 2021, Table 9): RandAugment, random erasing, Mixup/CutMix,
label smoothing -- all timm's own implementations, placed where they cost least.

- ``RandAugment`` is an FFCV pipeline operation: timm's ``rand_augment_transform`` applied per
  sample to the cropped, flipped uint8 image, exactly where timm/DeiT apply it (before ToTensor).
  It runs in Python (PIL) in the loader's background thread, one sample at a time: about 0.45 ms
  per 32 px image and 2 ms per 224 px image on this repo's 2-core CPU, so one process tops out
  near 500 images/s at 224 px -- enough for small GPUs, the bottleneck on large ones (there, give
  each worker more CPU cores or switch it off). PIL holds the GIL for much of it, so it also
  slows the training loop's Python thread somewhat.
- ``BatchAugment`` runs on the batch on the training device: timm's ``RandomErasing`` (per sample,
  on the normalised image, as DeiT does) then ``Mixup`` (Mixup or CutMix on the whole batch,
  producing smoothed soft targets); ``loss()`` is the matching criterion.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup
from timm.data import auto_augment
from timm.data.random_erasing import RandomErasing
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from pipeline.config import AugmentConfig
import pipeline.data.runtime  # noqa: F401  (first: imports ffcv keeping torch's thread count)

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.operation import Operation
from ffcv.pipeline.state import State


def _posterize(image: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    # timm's PosterizeIncreasing keeps 0 bits at magnitude 10, which m9 + mstd0.5 reaches in ~2% of
    # draws; Pillow 13 (installed here) rejects 0 bits where older Pillow returned black, as timm intends.
    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return auto_augment.posterize(image, bits_to_keep)


def timm_rand_augment(spec: str, img_size: int, mean: tuple[float, float, float]) -> Callable[[Image.Image], Image.Image]:
    """timm's RandAugment with timm's ImageNet hparams (as ``create_transform`` builds them for DeiT)."""
    hparams = {
        "translate_const": int(img_size * 0.45),
        "img_mean": tuple(min(255, round(255 * m)) for m in mean),
        "interpolation": Image.BICUBIC,  # DeiT trains with bicubic interpolation
    }
    transform = auto_augment.rand_augment_transform(spec, hparams)
    for op in transform.ops:
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = _posterize
    return transform


class RandAugment(Operation):
    """FFCV operation: timm's RandAugment on each uint8 HxWx3 image of the batch (CPU, Python)."""

    def __init__(self, spec: str, img_size: int, mean: tuple[float, float, float]):
        super().__init__()
        self.transform = timm_rand_augment(spec, img_size, mean)

    def generate_code(self) -> Callable:
        transform = self.transform

        def rand_augment(images: np.ndarray, destination: np.ndarray) -> np.ndarray:
            for i in range(len(images)):
                destination[i] = np.asarray(transform(Image.fromarray(images[i])))
            return destination[: len(images)]

        return rand_augment

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery]:
        # Not JIT-compiled (PIL); same shape and dtype, written into a buffer of its own.
        return replace(previous_state, jit_mode=False), AllocationQuery(previous_state.shape, previous_state.dtype)


class BatchAugment:
    """Random erasing then Mixup/CutMix on a normalised batch; ``loss()`` matches the targets it returns.

    With Mixup/CutMix on, targets are soft (``[B, num_classes]``, label smoothing folded in) and the
    loss is ``SoftTargetCrossEntropy``; with it off, targets stay class indices and the loss is
    ``LabelSmoothingCrossEntropy`` (or plain cross-entropy at smoothing 0) -- DeiT's choice.
    """

    def __init__(self, augment: AugmentConfig, num_classes: int, device: torch.device | str = "cpu"):
        self.label_smoothing = augment.label_smoothing
        mixing = (augment.mixup_alpha > 0 or augment.cutmix_alpha > 0) and augment.mixup_prob > 0
        self.mixup = Mixup(
            mixup_alpha=augment.mixup_alpha, cutmix_alpha=augment.cutmix_alpha, prob=augment.mixup_prob,
            switch_prob=augment.mixup_switch_prob, mode="batch", label_smoothing=augment.label_smoothing,
            num_classes=num_classes,
        ) if mixing else None
        self.erasing = RandomErasing(
            probability=augment.random_erasing, mode="pixel", max_count=1, num_splits=0, device=str(device),
        ) if augment.random_erasing > 0 else None

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, targets); both are modified in place, so pass tensors the loader may reuse."""
        if self.erasing is not None:
            images = self.erasing(images)
        if self.mixup is not None:
            if len(images) % 2:
                raise ValueError(
                    f"Mixup/CutMix mix each sample with its mirror in the batch: the batch size must be even, "
                    f"got {len(images)} (use an even micro_batch_size and data.drop_last=true)"
                )
            images, labels = self.mixup(images, labels)
        return images, labels

    def loss(self) -> nn.Module:
        if self.mixup is not None:
            return SoftTargetCrossEntropy()
        if self.label_smoothing > 0:
            return LabelSmoothingCrossEntropy(smoothing=self.label_smoothing)
        return nn.CrossEntropyLoss()
