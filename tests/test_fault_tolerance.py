"""A worker process really dies mid-training: the group restarts from the latest checkpoint and the
run completes as one MLflow run with continuous epochs."""
import os
import signal

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import RunningVitsweep, train_command, wait_for

pytestmark = pytest.mark.slow


def test_killed_worker_restarts_from_checkpoint_and_the_mlflow_run_continues(tmp_path, digits16):
    storage = tmp_path / "runs"
    args = train_command(storage, digits16, "run.name=faulty", "optim.epochs=4", "run.max_failures=2",
                         "run.checkpoint_every=1")
    driver = RunningVitsweep(args)
    # The controller prints this once Ray has registered the checkpoint, so a restart must load it
    # (a checkpoint directory alone may not be registered yet, and the group would restart afresh).
    driver.wait_for_line("(checkpoint saved)", 300)
    victim_pid = wait_for(driver.train_workers, 60, "the training workers")[-1].pid
    os.kill(victim_pid, signal.SIGKILL)
    returncode = driver.finish()
    output = driver.output
    assert returncode == 0, output[-4000:]
    assert not psutil.pid_exists(victim_pid)
    assert "(resumed from a checkpoint)" in output, output[-4000:]

    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id])
    assert len(runs) == 1
    (run,) = runs
    assert run.info.status == "FINISHED"
    epochs = sorted({m.step for m in client.get_metric_history(run.info.run_id, "val_top1")})
    assert epochs == [1, 2, 3, 4]
    # The restarted group loaded model, ZeRO optimizer shards and scheduler, and went on from there.
    (resumed,) = client.get_metric_history(run.info.run_id, "resumed_at_epoch")
    assert resumed.step == resumed.value >= 2  # the first epoch trained again, counted from 1
