"""DeiT's training recipe (Touvron et al. 2021, Table 9): RandAugment, random erasing, Mixup/CutMix,
label smoothing -- timm's semantics throughout, each placed where it costs least.

- RandAugment is an FFCV pipeline operation after ``ToDevice`` (``pipeline.data.rand_augment_operation``):
  timm's RandAugment, batched on the training device (``pipeline.data.rand_augment``: per-sample ops
  and magnitudes, torch ops on the uint8 batch, before normalisation -- where timm/DeiT apply it,
  before ToTensor). On a GPU it is a few kernels per batch; on CPU it runs on torch's intra-op
  threads, not in one PIL thread.
- ``BatchAugment`` (here: torch and timm only, no FFCV) runs on the batch on the training device: timm's ``RandomErasing`` (per sample,
  on the normalised image, as DeiT does) then ``Mixup`` (Mixup or CutMix on the whole batch,
  producing smoothed soft targets); ``loss()`` is the matching criterion.
"""
from __future__ import annotations

import torch
from timm.data import Mixup
from timm.data.random_erasing import RandomErasing
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn

from pipeline.config.schema import AugmentConfig


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
