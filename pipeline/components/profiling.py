"""One-flag profiling (``run.profile=steps:N``): a torch profiler trace of N training steps on rank 0.

The trace leaves out the command's first step (its lazy set-up: DeepSpeed's buffers, a compile) and
one warm-up step (the profiler's own start-up), then records N: every op on the CPU, and on a GPU its
kernels, with shapes and memory. It is written as a Chrome trace (Perfetto and chrome://tracing open
it), beside a table of the ops by their own time; on a GPU also the CUDA caching allocator's memory
snapshot over the same steps (https://pytorch.org/memory_viz opens it). ``on_ready`` receives the
directory holding them, once, when the last step is recorded or the run ends before it.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

SKIPPED_STEPS = 1  # the command's first step: set-up done lazily, not the steady state
WARMUP_STEPS = 1  # the profiler's first traced step carries its own start-up cost: not recorded
FIRST_TRACED_STEP = SKIPPED_STEPS + WARMUP_STEPS + 1  # counted from 1, from the command's (or restart's) start
TRACE_FILE = "rank0_trace.json"
OPS_FILE = "rank0_ops.txt"
MEMORY_SNAPSHOT_FILE = "rank0_memory_snapshot.pickle"
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept: the snapshot's ring buffer
# Kineto's log level above its ERROR: on a CPU-only process it logs "gpuGetDeviceCount failed" as an error.
QUIET_KINETO = "5"


class StepProfiler:
    """Traces ``steps`` training steps on this process; call ``step`` after each and ``finish`` at the end."""

    def __init__(self, steps: int, device: torch.device, on_ready: Callable[[Path], None]):
        self.steps, self.on_ready = steps, on_ready
        self.gpu = device.type == "cuda"
        if not self.gpu:  # read when the profiler first starts in this process
            os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO)
        self.total_calls = SKIPPED_STEPS + WARMUP_STEPS + steps
        self.calls = 0
        self.running, self.written = True, False
        self.profiler = profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.gpu else [])],
            schedule=schedule(skip_first=SKIPPED_STEPS, wait=0, warmup=WARMUP_STEPS, active=steps, repeat=1),
            on_trace_ready=self._write, record_shapes=True, profile_memory=True,
        )
        self.profiler.start()
        if self.gpu:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    @property
    def recorded(self) -> int:
        """The training steps traced so far."""
        return min(self.steps, max(0, self.calls - SKIPPED_STEPS - WARMUP_STEPS))

    def step(self) -> None:
        """One training step done: the profiler moves on (after its last recorded step, it writes the trace)."""
        if not self.running:
            return
        self.calls += 1
        self.profiler.step()
        if self.calls == self.total_calls:
            self._stop()

    def finish(self) -> int:
        """Stops a profile the run ended before (what was traced so far is written); the number of
        training steps the trace holds."""
        if self.running:
            self._stop()
        return self.recorded

    def _stop(self) -> None:
        self.running = False
        self.profiler.stop()
        if self.gpu and not self.written:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write(self, profiler: profile) -> None:
        if self.recorded == 0:  # stopped as the first traced step began: nothing to read
            return
        self.written = True
        directory = Path(tempfile.mkdtemp(prefix="vitsweep-profile-"))
        profiler.export_chrome_trace(str(directory / TRACE_FILE))
        (directory / OPS_FILE).write_text(
            profiler.key_averages().table(sort_by="self_device_time_total" if self.gpu else "self_cpu_time_total",
                                          row_limit=40) + "\n")
        if self.gpu:
            torch.cuda.memory._dump_snapshot(str(directory / MEMORY_SNAPSHOT_FILE))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.on_ready(directory)
