"""A trial that Tune stops ends its Ray Train run at once, so that its process can take the next trial.

Tune reuses a trial's process (``reuse_actors``) only once the trial's function has returned, and waits
``TUNE_FUNCTION_THREAD_TIMEOUT_S`` (2 s by default) for it. A function blocked in ``TorchTrainer.fit()``
never sees the stop: Tune sets an event on the trial's session, which Ray reads only at a report. So the
function watches that event (``TrialStopWatch``) and, once it is set, tells its Train controller to
abort (``AbortOnTrialStop``: the workers shut down, their placement group is removed). The message is a
file: Ray Train V2 runs the controller on the node of the function that calls ``fit()``, and hands that
function no handle to it. The function then waits until the run's workers are dead before it returns,
so a reused process never starts a trial beside the workers of the one Tune stopped.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.train._internal.session import get_session
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

STOP_FILE, WORKERS_FILE = "stop", "workers"
POLL_S = 0.2
# How long Tune's reset waits for a stopped trial's function: the abort gives each worker up to 5 s to
# shut down (Ray Train's patience) before it is killed, and then the function waits for its death.
FUNCTION_END_TIMEOUT_S = "120"
WORKERS_DEAD_TIMEOUT_S = 60.0


class AbortOnTrialStop(ControllerCallback, WorkerGroupCallback):
    """In the Train controller: abort the run once the trial's function asks, and say which workers it
    started (their actor ids), so the function can wait for their end."""

    def __init__(self, directory: str):
        self.directory = directory

    def after_controller_start(self, train_run_context) -> None:
        controller = ray.get_runtime_context().current_actor
        stop = Path(self.directory) / STOP_FILE

        def abort_when_asked() -> None:
            while not stop.exists():
                time.sleep(POLL_S)
            controller.abort.remote()

        threading.Thread(target=abort_when_asked, name="vitsweep-trial-stop", daemon=True).start()

    def after_worker_group_start(self, worker_group) -> None:
        ids = "\n".join(worker.actor._actor_id.hex() for worker in worker_group.get_workers())
        written = Path(self.directory) / f".{WORKERS_FILE}"
        written.write_text(ids)
        written.replace(Path(self.directory) / WORKERS_FILE)


class TrialStopWatch:
    """In the trial's function, around its ``fit()``: turns Tune's stop into the controller's abort.

    ``requested`` says whether Tune stopped the trial (an error from ``fit()`` is then the abort's).
    On leaving, a stopped trial's workers are waited for until Ray reports them dead."""

    def __init__(self):
        os.environ["TUNE_FUNCTION_THREAD_TIMEOUT_S"] = FUNCTION_END_TIMEOUT_S  # read by Tune's reset, here
        self._stop_event = get_session().stop_event
        self._ended = threading.Event()
        self.directory = tempfile.mkdtemp(prefix="vitsweep-trial-")
        self.callback = AbortOnTrialStop(self.directory)

    @property
    def requested(self) -> bool:
        return self._stop_event.is_set() or (Path(self.directory) / STOP_FILE).exists()

    def __enter__(self) -> TrialStopWatch:
        def ask_for_abort() -> None:
            while not self._ended.is_set():
                if self._stop_event.wait(POLL_S):
                    # Tune also sets the event once a trial has ended, as its directory goes: nothing to stop
                    with contextlib.suppress(FileNotFoundError):
                        if not self._ended.is_set():
                            (Path(self.directory) / STOP_FILE).touch()
                    return

        threading.Thread(target=ask_for_abort, name="vitsweep-trial-stop-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._ended.set()
        try:
            if self.requested:
                self._wait_for_workers_to_end()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _wait_for_workers_to_end(self) -> None:
        from ray.util.state import get_actor

        workers = Path(self.directory) / WORKERS_FILE
        ids = workers.read_text().split() if workers.exists() else []
        deadline = time.monotonic() + WORKERS_DEAD_TIMEOUT_S
        while ids and time.monotonic() < deadline:
            ids = [actor_id for actor_id in ids if (getattr(get_actor(actor_id), "state", "DEAD") != "DEAD")]
            if ids:
                time.sleep(POLL_S)
