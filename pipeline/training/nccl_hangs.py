"""NCCL hangs as failures Ray Train retries: Ray 2.60's NCCL RAS hang detector, on for every GPU run.

NCCL (>= 2.24) runs a RAS thread in every rank that tracks each communicator's collective counts across
ranks. Ray Train's controller asks a worker's ``ncclras`` client for them every
``RAY_TRAIN_NCCL_RAS_MIN_POLL_INTERVAL_S`` (15 s); a communicator whose ranks disagree and make no progress
for ``RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S`` (600 s) is a hang, and the action ``fail`` raises
``NCCLHangError``: a failure like a lost worker, retried from the latest checkpoint while
``run.max_failures`` allows (else the run fails with it as its reason), its stack traces and RAS history
kept under the run's storage. Ray switches the detector on from the process that builds the trainer
(the command, or a sweep's trial), so vitsweep sets it there. A user's own values stand
(``RAY_TRAIN_NCCL_RAS_ACTION=observe`` logs a hang and goes on). Without the ``ncclras`` client on the
workers (NCCL >= 2.28 for its JSON output) the detector says so once in the log and stops polling:
``vitsweep doctor --node gpu-worker`` reports it.
"""
from __future__ import annotations

import os
import shutil

DETECTOR_ENV = {"RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR": "1", "RAY_TRAIN_NCCL_RAS_ACTION": "fail"}
RAS_CLIENT = "ncclras"


def detect_nccl_hangs() -> None:
    """Ray Train's hang detector on, hangs failing the run, for the trainers this process builds."""
    for key, value in DETECTOR_ENV.items():
        os.environ.setdefault(key, value)


def ras_client() -> str:
    """Where this node's ``ncclras`` is, or what its absence means (``vitsweep doctor``)."""
    found = shutil.which(RAS_CLIENT)
    if found:
        return f"{found} (NCCL hangs fail the run after {os.environ.get('RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S', '600')} s)"
    return (f"{RAS_CLIENT} not found on PATH: Ray Train's NCCL hang detector cannot ask this node, and a hung "
            "collective waits for NCCL's own timeout (install NCCL >= 2.28's ncclras in the image)")
