"""Step-level health of a run: what each logging step says beside its loss (torchtitan logs the same).

Between two logging steps every rank keeps, without a host sync, the sum and the max of its losses, the
gradient norm before clipping of each optimizer step and how many of them clipping cut (on the device),
and, on the host, how long it waited for its loader and how long the window took. At the logging step one
all_gather of those few scalars per rank (``StepHealth.gather``) gives every rank the whole picture: the
global mean loss (whose NaN/inf stops every rank together), its max, the gradient norm, the share of steps
clipped, each rank's data-wait share and peak memory, the slowest rank's named.
"""
from __future__ import annotations

import math
import re
import resource
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

HEALTH_PREFIX = "health/"  # the step metrics' keys, apart from the epochs' (lr, train_loss, ...)
# One row per rank, in this order: what ``gather`` all-gathers.
_LOSS_SUM, _LOSS_MAX, _GRAD_NORM, _CLIPPED, _OPTIMIZER_STEPS, _WAIT_S, _ELAPSED_S, _PEAK_BYTES = range(8)


def peak_memory_bytes(device: torch.device) -> int:
    """The most this rank has held: the CUDA caching allocator's peak reservation on a GPU, else the
    process's peak resident set: the kernel's VmHWM on Linux (``ru_maxrss`` would also count what the
    process that forked and exec'd this one held: a Ray worker's raylet, a test's pytest), ``ru_maxrss``
    elsewhere (bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    status = Path("/proc/self/status")
    if status.exists():
        (kib,) = re.findall(r"^VmHWM:\s+(\d+) kB", status.read_text(), re.M)
        return int(kib) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@dataclass(frozen=True)
class HealthReport:
    """One logging window, the same on every rank."""

    loss_sum: float  # the global (all-rank mean) loss summed over the window's steps
    steps: int
    loss_max: float  # the highest micro-batch loss any rank saw in the window
    grad_norm: float | None  # the window's last optimizer step's, before clipping; None: no step taken
    clipped_share: float  # of the window's optimizer steps, those whose norm exceeded the clipping threshold
    data_wait_share: list[float]  # per rank: the time it waited for its loader over the window's time
    peak_memory_bytes: list[int]  # per rank

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss_sum)

    def metrics(self) -> dict[str, float]:
        """The window as MLflow step metrics under ``health/`` (the UI's chart view groups them by it); the
        rank that waited longest for data and the one holding the most memory named by their numbers."""
        slowest = max(range(len(self.data_wait_share)), key=self.data_wait_share.__getitem__)
        largest = max(range(len(self.peak_memory_bytes)), key=self.peak_memory_bytes.__getitem__)
        metrics = {
            "loss": self.loss_sum / self.steps, "loss_max": self.loss_max,
            "grad_clipped_share": self.clipped_share,
            "data_wait_share": sum(self.data_wait_share) / len(self.data_wait_share),
            "data_wait_share_max": self.data_wait_share[slowest], "data_wait_slowest_rank": slowest,
            "peak_memory_gib": self.peak_memory_bytes[largest] / 2**30, "peak_memory_rank": largest,
            **({} if self.grad_norm is None else {"grad_norm": self.grad_norm}),
        }
        return {f"{HEALTH_PREFIX}{key}": float(value) for key, value in metrics.items()}


class StepHealth:
    """One rank's window of steps since the last logging step."""

    def __init__(self, device: torch.device, grad_clip: float | None):
        self.device, self.grad_clip = device, grad_clip
        self.start_window()

    def start_window(self) -> None:
        self.losses = torch.zeros(2, device=self.device)  # sum, max
        self.losses[1] = -torch.inf
        self.grad = torch.zeros(3, device=self.device)  # last norm, steps clipped, optimizer steps
        self.steps, self.wait_s = 0, 0.0
        self.started = time.perf_counter()

    def timed(self, batches: Iterable) -> Iterator:
        """``batches``, the time this rank waits for each counted as its data wait."""
        iterator = iter(batches)
        while True:
            waiting = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - waiting
            yield batch

    def add_step(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None) -> None:
        """A micro step's loss and, where it took an optimizer step, that step's gradient norm before clipping."""
        self.steps += 1
        self.losses[0] += loss
        self.losses[1] = torch.maximum(self.losses[1], loss)
        if grad_norm is not None:
            norm = torch.as_tensor(grad_norm, dtype=self.grad.dtype, device=self.device)
            self.grad[0] = norm
            if self.grad_clip is not None:
                self.grad[1] += (norm > self.grad_clip).to(self.grad.dtype)
            self.grad[2] += 1

    def gather(self, world_size: int) -> HealthReport:
        """The window over all ranks (one all_gather; with one rank, none), then a new window."""
        elapsed = time.perf_counter() - self.started
        host = torch.tensor([self.wait_s, elapsed, float(peak_memory_bytes(self.device))], dtype=torch.float64)
        mine = torch.cat([self.losses.double(), self.grad.double(), host.to(self.device)])
        if world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(rows, mine)
            table = torch.stack(rows).cpu()
        else:
            table = mine.cpu().unsqueeze(0)
        optimizer_steps = int(table[0, _OPTIMIZER_STEPS])
        report = HealthReport(
            loss_sum=float(table[:, _LOSS_SUM].sum()) / world_size, steps=self.steps,
            loss_max=float(table[:, _LOSS_MAX].max()),
            grad_norm=float(table[0, _GRAD_NORM]) if optimizer_steps else None,
            clipped_share=float(table[0, _CLIPPED]) / optimizer_steps if optimizer_steps else 0.0,
            data_wait_share=[float(row[_WAIT_S] / row[_ELAPSED_S]) for row in table],
            peak_memory_bytes=[int(row[_PEAK_BYTES]) for row in table],
        )
        self.start_window()
        return report


def computes_grad_norm(engine) -> bool:
    """Whether DeepSpeed's optimizer wrapper computes each step's gradient norm before clipping (ZeRO 1-3,
    bf16). Plain ZeRO-0 in fp32 steps torch's optimizer itself, and DeepSpeed keeps no norm."""
    return hasattr(engine.optimizer, "_global_grad_norm")


def step_measuring_grad_norm(engine, deepspeed_norm: bool) -> torch.Tensor | float | None:
    """``engine.step()``; returns the gradient norm before clipping of the optimizer step it took, or None
    where it took none (between accumulation boundaries, or skipping an fp16 overflow). Without
    DeepSpeed's norm (``deepspeed_norm``) the gradients, which ``backward()`` all-reduced at the boundary,
    are measured here before ``step()`` clips them, as ``torch.nn.utils.clip_grad_norm_`` measures them."""
    own = None
    if not deepspeed_norm and engine.is_gradient_accumulation_boundary():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        own = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    engine.step()
    if not engine.was_step_applied():
        return None
    return engine.get_global_grad_norm() if deepspeed_norm else own


class LossSpikes:
    """Loss spikes: a logging window whose max loss exceeds ``factor`` x the running median of the windows
    before it (the last ``history`` window means, once there are ``warmup`` of them); the ``limit``-th spike
    ends the run (None: none does). Every rank holds the same reports, so every rank counts the same spikes
    and stops at the same step."""

    def __init__(self, factor: float, limit: int | None = None, history: int = 20, warmup: int = 3):
        self.factor, self.limit, self.warmup = factor, limit, warmup
        self.means: deque[float] = deque(maxlen=history)
        self.count = 0
        self.median: float | None = None  # the running median the last window was held against

    def observe(self, report: HealthReport) -> bool:
        """Whether ``report``'s window spiked (counted); its mean joins the running median after."""
        self.median = statistics.median(self.means) if len(self.means) >= self.warmup else None
        spiked = self.median is not None and report.loss_max > self.factor * self.median
        self.count += spiked
        self.means.append(report.loss_sum / report.steps)
        return spiked

    @property
    def exhausted(self) -> bool:
        """The run has spiked as often as it may."""
        return self.limit is not None and self.count >= self.limit

    @property
    def cause(self) -> str:
        """Why the run stopped, said beside where (``run.diverged_at``)."""
        return f"{self.count} loss spikes over {self.factor:g}x the running median"
