"""A worker process really dies mid-training: the group restarts from the latest checkpoint and the
run completes as one MLflow run with continuous epochs; the checkpoints kept are the best by
``run.checkpoint_score`` (here the learning rate, which the cosine schedule lowers every epoch: the
best are the oldest) and the latest."""
import os
import signal

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import RunningVitsweep, train_command, wait_for
from pipeline.components.checkpointing import read_meta

pytestmark = pytest.mark.slow


def test_killed_worker_restarts_from_checkpoint_and_the_mlflow_run_continues(tmp_path, digits16):
    storage = tmp_path / "runs"
    args = train_command(storage, digits16, "run.name=faulty", "optim.epochs=4", "run.max_failures=2",
                         "run.checkpoint_every=1", "run.num_to_keep=2", "run.checkpoint_score=lr")
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
    epochs = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_top1"))
    assert epochs == [1, 2, 3, 4]  # each epoch trained (and logged) once: none repeated after the restart
    # The restarted group loaded model, ZeRO optimizer shards and scheduler, and went on from there.
    (resumed,) = client.get_metric_history(run.info.run_id, "resumed_at_epoch")
    assert resumed.step == resumed.value >= 2  # the first epoch trained again, counted from 1

    # Kept: the two best by lr (the schedule's highest, epochs 1 and 2) and the latest, epoch 4.
    lr = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "lr")}
    best_two = sorted(lr, key=lr.get, reverse=True)[:2]
    assert best_two == [1, 2]
    kept = sorted(read_meta(path)["epoch"] + 1 for path in (storage / "faulty").glob("checkpoint_*") if path.is_dir())
    assert kept == [1, 2, 4]
