"""A worker process really dies mid-training: the group restarts from the latest checkpoint and the
run completes as one MLflow run with continuous epochs."""
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import train_command, vitsweep_env

pytestmark = pytest.mark.slow


def _train_workers(driver_pid: int) -> list[psutil.Process]:
    """This run's Ray Train workers: descendants of its driver (which started Ray in-process)."""
    workers = []
    for process in psutil.Process(driver_pid).children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith("ray::RayTrainWorker"):
                workers.append(process)
        except psutil.NoSuchProcess:
            continue
    return workers


def _collect_lines(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_killed_worker_restarts_from_checkpoint_and_the_mlflow_run_continues(tmp_path, digits16):
    storage = tmp_path / "runs"
    args = train_command(storage, digits16, "run.name=faulty", "optim.epochs=4", "run.max_failures=2",
                         "run.checkpoint_every=1")
    driver = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=vitsweep_env())
    lines: list[str] = []
    reader = threading.Thread(target=_collect_lines, args=(driver.stdout, lines), daemon=True)
    reader.start()
    try:
        # The controller prints this once Ray has registered the checkpoint, so a restart must load it
        # (a checkpoint directory alone may not be registered yet, and the group would restart afresh).
        _wait_for(lambda: any("(checkpoint saved)" in line for line in lines), 300, "the first registered checkpoint")
        victims = _wait_for(lambda: _train_workers(driver.pid), 60, "the training workers")
        victim_pid = victims[-1].pid
        os.kill(victim_pid, signal.SIGKILL)
        driver.wait(timeout=600)
        reader.join(timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()
    output = "".join(lines)
    assert driver.returncode == 0, output[-4000:]
    assert not psutil.pid_exists(victim_pid)
    assert "(resumed from a checkpoint)" in output, output[-4000:]

    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id])
    assert len(runs) == 1
    (run,) = runs
    assert run.info.status == "FINISHED"
    epochs = sorted({m.step for m in client.get_metric_history(run.info.run_id, "val_top1")})
    assert epochs == [0, 1, 2, 3]
    # The restarted group loaded model, ZeRO optimizer shards and scheduler, and went on from there.
    (resumed,) = client.get_metric_history(run.info.run_id, "resumed_at_epoch")
    assert resumed.step == resumed.value >= 1
