"""Out of memory: what a sweep trial does when its workers run out (``pipeline.sweeps.trial``).

The trial is retried with its micro-batch halved and its gradient accumulation doubled (an odd
micro-batch divided by its smallest prime factor): the same
global batch (micro-batch x accumulation x workers), so the same learning rate, the same optimizer
steps per epoch and the same schedule, each step on the same samples (an epoch is a whole number of
steps: ``pipeline.data.loaders.DeviceLoader``). Its MLflow run goes on; its tag ``oom.split`` says the
split it trains at (``16x4``: micro-batch 16, 4 accumulation steps), and the split it ended at is
logged as the params ``oom_split.micro_batch_size`` and ``oom_split.grad_accum_steps`` (its params as
asked stay: MLflow's params never change). A configuration that does not fit at micro-batch 1 is pruned
as ``oom``, not failed. (A model with batch statistics, XCiT's BatchNorm, sees smaller batches there.)

On a CPU there is no device memory to run out of: ``VITSWEEP_INJECT_OOM=RUN_GLOB:MICRO_BATCH`` makes
the workers of every run whose name matches the glob raise torch's own out-of-memory error as they
start training while their micro-batch is larger than MICRO_BATCH (a test's fault, read by the workers).
"""
from __future__ import annotations

import fnmatch
import os

import torch
from ray.train import WorkerGroupError

from pipeline.config.schema import ExperimentConfig

OOM = "oom"  # a pruned trial's reason's first word
SPLIT_TAG = "oom.split"
RETRIES_TAG = "oom.retries"
SPLIT_PARAMS = ("oom_split.micro_batch_size", "oom_split.grad_accum_steps")
INJECT_ENV = "VITSWEEP_INJECT_OOM"


def ran_out_of_memory(err: BaseException) -> bool:
    """Whether a failed fit failed because a worker ran out of memory (Ray Train hands a worker's
    exception over inside its own wrapper, which keeps the original as ``_base_exc``)."""
    failures = err.worker_failures.values() if isinstance(err, WorkerGroupError) else [err]
    return any(isinstance(getattr(failure, "_base_exc", failure), torch.OutOfMemoryError) for failure in failures)


def smaller_micro_batch(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """``cfg`` at half the micro-batch and twice the accumulation; None at micro-batch 1. An odd
    micro-batch is divided by its smallest prime factor instead (15 -> 5 x 3 accumulation steps), so the
    global batch stays exactly what it was."""
    optim = cfg.optim
    if optim.micro_batch_size == 1:
        return None
    factor = next(f for f in range(2, optim.micro_batch_size + 1) if optim.micro_batch_size % f == 0)
    smaller = optim.model_copy(update={"micro_batch_size": optim.micro_batch_size // factor,
                                       "grad_accum_steps": optim.grad_accum_steps * factor})
    return cfg.model_copy(update={"optim": smaller})


def split(cfg: ExperimentConfig) -> str:
    return f"{cfg.optim.micro_batch_size}x{cfg.optim.grad_accum_steps}"


def split_params(cfg: ExperimentConfig) -> dict[str, int]:
    return dict(zip(SPLIT_PARAMS, (cfg.optim.micro_batch_size, cfg.optim.grad_accum_steps)))


def raise_injected_oom(run_name: str, micro_batch: int) -> None:
    """The test's fault (``VITSWEEP_INJECT_OOM``): torch's out-of-memory error, as a GPU would raise it."""
    glob, _, fits = os.environ.get(INJECT_ENV, "").rpartition(":")
    if glob and fnmatch.fnmatch(run_name, glob) and micro_batch > int(fits):
        raise torch.OutOfMemoryError(f"injected by {INJECT_ENV}: a micro-batch of {micro_batch} does not fit "
                                     f"(at most {fits})")
