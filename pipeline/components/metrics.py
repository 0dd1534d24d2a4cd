"""Metrics: loss and top-k tallies summed over ranks, so every sample counts exactly once; the
validation pass that fills them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.utils import distribute_bn

@dataclass
class Tally:
    """Sums over samples; ``reduced()`` adds every rank's sums, ``means()`` turns them into metrics."""

    loss_sum: float = 0.0
    correct_top1: float = 0.0
    correct_top5: float = 0.0
    samples: float = 0.0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, losses: torch.Tensor) -> None:
        """``losses`` holds one loss per sample; only the rows given count."""
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top.eq(labels[:, None])
        self.loss_sum += losses.float().sum().item()
        self.correct_top1 += hits[:, 0].sum().item()
        self.correct_top5 += hits.any(dim=1).sum().item()
        self.samples += len(labels)

    def reduced(self, device: torch.device) -> Tally:
        if not (dist.is_available() and dist.is_initialized()):
            return self
        sums = torch.tensor(
            [self.loss_sum, self.correct_top1, self.correct_top5, self.samples], dtype=torch.float64, device=device
        )
        dist.all_reduce(sums)
        return Tally(*sums.tolist())

    def means(self, prefix: str) -> dict[str, float]:
        n = max(self.samples, 1.0)
        return {
            f"{prefix}_loss": self.loss_sum / n,
            f"{prefix}_top1": 100.0 * self.correct_top1 / n,
            f"{prefix}_top5": 100.0 * self.correct_top5 / n,
        }


class ConfusionTally:
    """Counts of (true class, predicted class) pairs, summed over ranks like ``Tally``: row i holds the
    samples of class i, column j those predicted as j (top-1)."""

    def __init__(self, num_classes: int):
        self.counts = torch.zeros(num_classes, num_classes, dtype=torch.int64)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        pairs = labels.cpu() * self.counts.shape[0] + logits.argmax(dim=1).cpu()
        self.counts += torch.bincount(pairs, minlength=self.counts.numel()).view_as(self.counts)

    def reduced(self, device: torch.device) -> torch.Tensor:
        """The counts over every rank (this rank's where torch.distributed is not initialised)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.counts.clone()
        counts = self.counts.to(device)
        dist.all_reduce(counts)
        return counts.cpu()

    @staticmethod
    def per_class_accuracy(counts: torch.Tensor) -> list[float | None]:
        """Percent of each class's samples predicted as that class; None for a class with no samples."""
        return [None if total == 0 else 100.0 * float(counts[i, i]) / float(total)
                for i, total in enumerate(counts.sum(dim=1).tolist())]


def average_batchnorm_statistics(model) -> None:
    """Each rank's BatchNorm running statistics come from its own shard (DeepSpeed never broadcasts
    buffers): averaged over the ranks (timm's ``train.py``, ``--dist-bn reduce``), so every rank scores
    the same model, the one a checkpoint saves from rank 0."""
    if dist.is_available() and dist.is_initialized():
        distribute_bn(model, dist.get_world_size(), reduce=True)


def validation_metrics(model, val_loader, input_dtype: torch.dtype, device: torch.device,
                       observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> dict[str, float]:
    """Top-1/top-5 and loss of ``model`` (the engine, or the EMA) over every validation sample
    exactly once across ranks, after its BatchNorm statistics are averaged over the ranks;
    ``observe(logits, labels)`` sees each batch's real rows too (``vitsweep evaluate``'s confusion
    matrix and predictions)."""
    model.eval()
    average_batchnorm_statistics(model)
    tally = Tally()
    with torch.no_grad():
        for images, labels, num_real in val_loader:
            logits = model(images.to(input_dtype)).float()[:num_real]
            labels = labels[:num_real]
            tally.add(logits, labels, F.cross_entropy(logits, labels, reduction="none"))
            if observe is not None:
                observe(logits, labels)
    return tally.reduced(device).means("val")
