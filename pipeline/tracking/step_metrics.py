"""Rank 0's step metrics (``pipeline.components.health``) into its run, on MLflow's step axis, and
the files of its profile (``pipeline.components.profiling``) as the run's artifacts.

Written from a thread of its own: the training loop only hands each logging step's metrics over, and
MLflow, which imports slowly and answers over the network, never holds a step up. This module imports
no MLflow itself (the worker imports it): its thread does.
"""
from __future__ import annotations

import logging
import queue
import shutil
import threading
from pathlib import Path

_STOP = None
CLOSE_TIMEOUT_S = 30.0  # what a run's end waits for the last steps' metrics to be written


class StepMetricsLog:
    """Step metrics queued by the training loop, written to ``run_id`` in ``uri`` in order."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id
        self.pending: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._write, name="vitsweep-step-metrics", daemon=True)
        self.thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.pending.put((metrics, step))

    def log_files(self, directory: Path, artifact_path: str) -> None:
        """Every file in ``directory`` under ``artifact_path``; the directory is removed once written."""
        self.pending.put((directory, artifact_path))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (a store that does not answer holds the run's end up for ``timeout_s`` at most)."""
        self.pending.put(_STOP)
        self.thread.join(timeout_s)

    def _write(self) -> None:
        from pipeline.tracking.connection import is_new_local_store
        from pipeline.tracking.store import MlflowRun

        logger = logging.getLogger("vitsweep.step_metrics")
        run = None
        # A SQLite file this node does not have belongs to another node: opening it would create a store here.
        if is_new_local_store(self.uri):
            logger.warning("step metrics and profiles are not recorded: the store %s is not on this node", self.uri)
        else:
            try:
                run = MlflowRun(self.uri, self.run_id)
            except Exception as err:  # noqa: BLE001  (as MLflow's own system metrics: never fail the run over them)
                logger.warning("step metrics and profiles are not recorded: %s", err)
        while (item := self.pending.get()) is not _STOP:
            if isinstance(item[0], Path):
                self._write_files(run, *item, logger)
                continue
            if run is None:
                continue
            metrics, step = item
            try:
                run.log_metrics(metrics, step=step)
            except Exception as err:  # noqa: BLE001
                logger.warning("could not log step %d's metrics: %s", step, err)

    @staticmethod
    def _write_files(run, directory: Path, artifact_path: str, logger: logging.Logger) -> None:
        try:
            if run is not None:
                for path in sorted(directory.iterdir()):
                    run.log_artifact(path, artifact_path)
        except Exception as err:  # noqa: BLE001
            logger.warning("could not log %s: %s", artifact_path, err)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
