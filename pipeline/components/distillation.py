"""DeiT's distillation (DeiT §5.2): a frozen teacher's argmax (hard) or its softened distribution
(soft) as a second target."""
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
    """``distill.teacher`` with ``distill.teacher_checkpoint``'s weights, frozen (``frozen_teacher``)."""
    model = timm.create_model(cfg.teacher, num_classes=num_classes, **cfg.teacher_args)
    load_teacher_weights(model, cfg.teacher_checkpoint)
    return frozen_teacher(model, device)


def frozen_teacher(model: nn.Module, device: torch.device | str = "cpu",
                   normalisation: tuple[tuple[float, ...], tuple[float, ...]] | None = None):
    """``model`` frozen in eval mode inside timm's DistillationTeacher, which bridges the student's input
    normalisation to the teacher's: the model's pretrained_cfg mean and std, or ``normalisation`` (mean,
    std) where the teacher was trained with its own (a vitsweep model's card)."""
    teacher = DistillationTeacher(model.to(device), device=torch.device(device))
    if normalisation is not None:
        mean, std = normalisation
        teacher.mean_kd.copy_(torch.tensor(mean).view(1, 3, 1, 1))
        teacher.std_kd.copy_(torch.tensor(std).view(1, 3, 1, 1))
    teacher.requires_grad_(False)
    return teacher.eval()


def hard_distillation(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """CE(student, argmax teacher)."""
    return F.cross_entropy(logits, teacher_logits.argmax(dim=-1))


def soft_distillation(logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(softmax(teacher / tau) || softmax(student / tau)) * tau², summed and divided by the number of
    logits (batch x classes), as DeiT's released losses.py does (timm's distillation task divides by the
    batch alone: C times this)."""
    divergence = F.kl_div(F.log_softmax(logits / tau, dim=-1), F.log_softmax(teacher_logits / tau, dim=-1),
                          reduction="sum", log_target=True)
    return divergence * tau * tau / logits.numel()


class DistillationLoss(nn.Module):
    """(1 - alpha)·task_loss(student, targets) + alpha·(hard or soft) distillation term.

    The teacher sees the same (augmented, mixed) images as the student, as in DeiT, in
    ``precision`` (an autocast context: the training precision; default fp32).
    """

    def __init__(self, task_loss: nn.Module, teacher, cfg: DistillConfig, data: DataConfig, precision=None):
        super().__init__()
        self.task_loss, self.teacher, self.alpha = task_loss, teacher, cfg.alpha
        self.kind, self.tau = cfg.kind, cfg.tau
        self.precision = precision or contextlib.nullcontext()
        self.register_buffer("student_mean", torch.tensor(data.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("student_std", torch.tensor(data.std).view(1, 3, 1, 1), persistent=False)

    def teacher_logits(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.precision:
            teacher_input = self.teacher.normalize_input(images.float(), self.student_mean, self.student_std)
            return self.teacher(teacher_input).float()

    def mix(self, logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor,
            dist_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``dist_logits``: a distillation token's (DeiT §4), which learn the teacher where ``logits`` learn
        the targets; without one, ``logits`` learn both."""
        student = logits if dist_logits is None else dist_logits
        distilled = (hard_distillation(student, teacher_logits) if self.kind == "hard"
                     else soft_distillation(student, teacher_logits, self.tau))
        return (1 - self.alpha) * self.task_loss(logits, targets) + self.alpha * distilled

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return self.mix(logits, targets, self.teacher_logits(images))
