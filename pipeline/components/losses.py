"""The training loss: one function of (model output, targets, images), whatever the recipe.

The task loss matches the targets the batch augmentation produces (``BatchAugment.loss``: soft
targets under Mixup/CutMix, label smoothing otherwise); DeiT's distillation mixes in a frozen
teacher's argmax (hard) or its softened distribution (soft); a model with DeiT's distillation token
trains its class head on the targets and its distillation head on the teacher. A model whose
training forward returns a plain tuple of logits has several classifier branches, each trained on
the targets (SoT's late fusion as its authors train it): their losses add.
"""
from __future__ import annotations

import torch
from torch import nn

from models.layers.heads import DistilledLogits
from pipeline.config.schema import ExperimentConfig
from pipeline.data.augment import BatchAugment
from pipeline.components.distillation import DistillationLoss, build_teacher


class TrainingLoss(nn.Module):
    def __init__(self, task_loss: nn.Module, distillation: DistillationLoss | None = None):
        super().__init__()
        self.task_loss, self.distillation = task_loss, distillation

    def forward(self, output: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor,
                images: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DistilledLogits):  # DeiT's distillation token: its own head learns the teacher
            teacher_logits = self.distillation.teacher_logits(images)
            return self.distillation.mix(output.cls.float(), targets, teacher_logits, output.dist.float())
        branches = output if isinstance(output, (tuple, list)) else (output,)
        if self.distillation is None:
            return sum(self.task_loss(logits.float(), targets) for logits in branches)
        teacher_logits = self.distillation.teacher_logits(images)  # once, whatever the number of branches
        return sum(self.distillation.mix(logits.float(), targets, teacher_logits) for logits in branches)


def build_training_loss(cfg: ExperimentConfig, augment: BatchAugment, num_classes: int, device: torch.device,
                        teacher_precision=None, teacher=None) -> TrainingLoss:
    """``teacher_precision``: the autocast context the teacher runs in (the training precision); ``teacher``:
    ``distill.teacher_from``'s, frozen (``pipeline.trained.teacher.load_teacher``), else built from
    ``distill.teacher`` and its checkpoint."""
    task_loss = augment.loss()
    if not cfg.distill.enabled:
        return TrainingLoss(task_loss)
    teacher = teacher if teacher is not None else build_teacher(cfg.distill, num_classes, device)
    distillation = DistillationLoss(task_loss, teacher, cfg.distill, cfg.data, teacher_precision)
    return TrainingLoss(task_loss, distillation.to(device))
