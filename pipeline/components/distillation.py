"""DeiT hard-label distillation: a frozen teacher's argmax as a second target (DeiT §5.2)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import timm
import torch
from safetensors.torch import load_model
from timm.task.distillation import DistillationTeacher
import torch.nn.functional as F
from torch import nn

from pipeline.config.schema import DataConfig, DistillConfig
from pipeline.errors import InvalidInputError


def load_teacher_weights(model: nn.Module, checkpoint: str) -> None:
    """safetensors, or a torch state dict (bare or under 'state_dict'/'model'), loaded weights-only."""
    path = Path(checkpoint)
    if not path.is_file():
        raise InvalidInputError(f"distill.teacher_checkpoint={checkpoint!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            load_model(model, str(path))
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("state_dict", "model"):
            state = state.get(key, state) if isinstance(state, dict) else state
        model.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as err:
        raise InvalidInputError(f"distill.teacher_checkpoint={checkpoint!r} does not fit the teacher: {err}") from None


def build_teacher(cfg: DistillConfig, num_classes: int, device: torch.device | str = "cpu"):
    """The frozen teacher wrapped by timm's DistillationTeacher (it bridges input normalisations)."""
    model = timm.create_model(cfg.teacher, num_classes=num_classes, **cfg.teacher_args)
    load_teacher_weights(model, cfg.teacher_checkpoint)
    teacher = DistillationTeacher(model.to(device), device=torch.device(device))
    teacher.requires_grad_(False)
    return teacher.eval()


class HardDistillationLoss(nn.Module):
    """(1 - alpha)·task_loss(student, targets) + alpha·CE(student, argmax teacher(images)).

    The teacher sees the same (augmented, mixed) images as the student, as in DeiT, in
    ``precision`` (an autocast context: the training precision; default fp32).
    """

    def __init__(self, task_loss: nn.Module, teacher, alpha: float, data: DataConfig, precision=None):
        super().__init__()
        self.task_loss, self.teacher, self.alpha = task_loss, teacher, alpha
        self.precision = precision or contextlib.nullcontext()
        self.register_buffer("student_mean", torch.tensor(data.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("student_std", torch.tensor(data.std).view(1, 3, 1, 1), persistent=False)

    def teacher_labels(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.precision:
            teacher_input = self.teacher.normalize_input(images.float(), self.student_mean, self.student_std)
            return self.teacher(teacher_input).argmax(dim=-1)

    def mix(self, logits: torch.Tensor, targets: torch.Tensor, teacher_labels: torch.Tensor) -> torch.Tensor:
        return (1 - self.alpha) * self.task_loss(logits, targets) + self.alpha * F.cross_entropy(logits, teacher_labels)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return self.mix(logits, targets, self.teacher_labels(images))
