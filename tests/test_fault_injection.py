"""Faults injected into real runs: whatever ends a run, its MLflow status says so with a one-line
reason, the console's last line says what happened, and nothing half-written is left to resume from.
The finished run a refused re-run must leave alone is the suite's ZeRO-3 run with --verbose
(``finished_run``, conftest): its final weights, gathered from both ranks, and its console are checked
here too. Two killed workers share one run (``killed_and_rerun``): the group restarts from its
checkpoint within the second epoch after the first (``run.max_failures=1``, ``run.checkpoint_every_steps``),
the second fails the run with its reason, and the same command again continues the same MLflow run. (SIGTERM to a training driver: test_training's linear
probe.)"""
import json
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from ray.train import Result
from safetensors.torch import load_model

from conftest import (RunningVitsweep, assert_scores_the_runs_metrics, refused_in_process, run_vitsweep,
                      train_command, wait_for)
from pipeline.components.checkpointing import read_meta
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.components.modeling import build_model
from pipeline.training.runs import unregistered_checkpoints
from test_tune_e2e import tune_command

pytestmark = pytest.mark.slow


def _runs(storage: Path) -> list:
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = client.get_experiment_by_name("vitsweep")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def _last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def _ray_is_starting(driver: RunningVitsweep, cache: Path) -> bool:
    """The driver's local Ray has started its first process (the GCS server): ``ray.init`` is under way."""
    return any(process.name().startswith("gcs_server") for process in driver.processes())


def _checks_are_under_way(driver: RunningVitsweep, cache: Path) -> bool:
    """The checks verified the first dataset (and recorded it); the model and the MLflow store are next."""
    return (cache / "verified-datasets.json").exists()


@pytest.mark.parametrize("signum,exit_code,moment", [(signal.SIGINT, 130, _checks_are_under_way),
                                                      (signal.SIGTERM, 143, _ray_is_starting)],
                         ids=["SIGINT_during_the_checks", "SIGTERM_during_Ray_start"])
def test_a_signal_during_start_up_exits_with_its_code_in_one_line_and_leaves_no_process(
        tmp_path, digits16, signum, exit_code, moment):
    storage, cache = tmp_path / "runs", tmp_path / "cache"  # a cache of its own: the datasets are verified anew
    driver = RunningVitsweep(train_command(storage, digits16, "run.name=early"), env={"VITSWEEP_CACHE_DIR": str(cache)})
    wait_for(lambda: moment(driver, cache) or driver.process.poll() is not None, 120, moment.__doc__, every=0.02)
    driver.process.send_signal(signum)
    assert driver.finish(timeout=120) == exit_code, driver.output[-3000:]
    name = signal.Signals(signum).name
    assert _last_line(driver.output).startswith(f"vitsweep train: interrupted by {name}"), driver.output[-3000:]
    assert "Traceback" not in driver.output and "received at time" not in driver.output  # nor Ray's C++ dump
    assert all(run.info.status == "KILLED" for run in _runs(storage))  # a run opened meanwhile is never left RUNNING
    wait_for(lambda: not driver.processes(), 30, "every process the command started to end")


def test_a_signal_while_a_sweep_starts_its_ray_exits_with_its_code_and_leaves_no_process(tmp_path, digits16):
    cache = tmp_path / "cache"
    sweep = RunningVitsweep(tune_command(tmp_path / "runs", digits16, "lr_wd", "tune.scheduler=fifo"),
                            env={"VITSWEEP_CACHE_DIR": str(cache)})
    wait_for(lambda: _ray_is_starting(sweep, cache) or sweep.process.poll() is not None, 120, _ray_is_starting.__doc__,
             every=0.02)
    sweep.process.send_signal(signal.SIGTERM)
    assert sweep.finish(timeout=120) == 143, sweep.output[-3000:]
    assert _last_line(sweep.output).startswith("vitsweep tune: interrupted by SIGTERM"), sweep.output[-3000:]
    assert "Traceback" not in sweep.output and "received at time" not in sweep.output
    wait_for(lambda: not sweep.processes(), 30, "every process the command started to end")


def test_zero3_final_weights_gathered_from_both_ranks_score_the_runs_val_top1(finished_run, digits16):
    storage, _, _ = finished_run
    (run,) = _runs(storage)
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    cfg = load_config(client.download_artifacts(run.info.run_id, "config.yaml", str(storage)))  # as it trained
    assert cfg.deepspeed.zero_stage == 3 and cfg.model.name == "deit_tiny_distilled_p16"
    model = build_model(cfg.model, num_classes=10)
    load_model(model, client.download_artifacts(run.info.run_id, "model.safetensors", str(storage)))
    assert_scores_the_runs_metrics(model, cfg, digits16["val"], run.data.metrics)


def test_verbose_shows_the_library_output_on_the_console_too(finished_run):
    storage, _, result = finished_run
    console = result.stdout + result.stderr
    assert "TrainController" in console and "TrainController" in (storage / "done" / "vitsweep.log").read_text()
    assert "epoch 1/1  train_loss" in result.stdout  # vitsweep's own lines as ever


def test_a_jobs_api_address_is_refused_before_an_earlier_finished_run_is_touched(finished_run, capsys):
    storage, args, _ = finished_run
    (before,) = _runs(storage)

    assert "Ray Jobs API address" in refused_in_process(args[1:] + ["--address", "http://127.0.0.1:8265"], capsys)
    (after,) = _runs(storage)
    assert after.info.status == "FINISHED" and after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MB tmpfs: room for the run's store and datasets, not for its checkpoints."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True)
    assert mounted.returncode == 0, f"this test mounts a tmpfs (root): {mounted.stderr.decode()}"
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_the_run_failed_and_leaves_no_half_written_checkpoint(small_disk, digits16):
    storage = small_disk / "runs"
    result = run_vitsweep(train_command(storage, digits16, "run.name=full", "optim.epochs=30", "scaling.num_workers=1"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = _runs(storage)
    reason = run.data.tags["stop_reason"]
    assert run.info.status == "FAILED" and reason.startswith("error: ") and "No space left on device" in reason, reason
    assert _last_line(result.stderr).startswith(f"vitsweep train: {reason}")
    assert unregistered_checkpoints(storage / "full") == []


@dataclass(frozen=True)
class KilledAndRerun:
    storage: Path
    first_output: str  # the first command's console
    killed_workers: tuple[int, int]  # their pids: the one the group restarted after, the one that failed the run
    epochs_before: list[int]  # the val_top1 steps MLflow held when the run failed
    failed: Run  # the MLflow run as the failure left it
    damaged: Path  # the newest registered checkpoint, truncated
    resume_epoch: int  # the epoch after the newest intact registered checkpoint's, counted from 1
    orphan: Path
    rerun: subprocess.CompletedProcess

    def resumed_at(self, metric: str = "resumed_at_epoch") -> list[tuple[int, float]]:
        (run,) = _runs(self.storage)
        history = MlflowClient(f"sqlite:///{self.storage}/mlflow.db").get_metric_history(run.info.run_id, metric)
        return [(m.step, m.value) for m in sorted(history, key=lambda m: m.timestamp)]


def _registered_within_epoch(run_dir: Path, epoch: int, steps_done: int) -> bool:
    """Whether Ray Train's record of its registered checkpoints holds the one taken within ``epoch`` (0-based)."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        metas = [read_meta(run_dir / record["checkpoint_dir_name"]) for record in snapshot["checkpoint_results"]]
    except (OSError, ValueError, InvalidInputError):  # not written yet, being replaced, or a checkpoint since removed
        return False
    return any((meta["epoch"], meta.get("steps_done")) == (epoch, steps_done) for meta in metas)


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory, digits16) -> KilledAndRerun:
    """One run through the faults that end its workers, then the same command again: a worker SIGKILLed
    once the second epoch's checkpoint after its 12th of 22 steps was registered (``run.checkpoint_every_steps=12``;
    the group restarts from it, ``run.max_failures=1``, reading the rest of the epoch's repeated-augmentation
    order), then a worker of the restarted group once the third epoch's such checkpoint is registered (no
    retries left: the run fails; the re-run reads Ray's record of a checkpoint without an epoch's score);
    then the newest checkpoint truncated (as a write cut short leaves it) and an unregistered
    checkpoint directory added (as a kill mid-report leaves one), and the same command again. Checkpoints
    are kept by ``run.checkpoint_score=lr``: the two best by the learning rate, which the cosine schedule
    lowers every epoch (the oldest), and the latest. (Whole, this costs the suite one run less than a lost
    worker's failure and a killed driver's re-run apart did: a group's restart is cheaper than a command's.)"""
    storage = tmp_path_factory.mktemp("killed") / "runs"
    args = train_command(storage, digits16, "run.name=resumed", "optim.epochs=4", "run.max_failures=1",
                         "run.checkpoint_every=1", "run.checkpoint_every_steps=12", "run.num_to_keep=2",
                         "run.checkpoint_score=lr", "data.repeated_augmentation=3")
    driver = RunningVitsweep(args)
    driver.wait_for_line("epoch 2/4  step 12/22  checkpoint saved (within the epoch)")  # rank 0's, once saved
    first = wait_for(driver.train_workers, 60, "the training workers")[-1]
    # ... and registered by Ray, so the restart must load it (a checkpoint directory alone may not be
    # registered yet, and the group would restart from the epoch before). Killed at once: Ray's controller
    # registers a report per poll (every 2 s), so the epoch's end, trained by then on a fast host, comes a
    # poll later
    wait_for(lambda: _registered_within_epoch(storage / "resumed", epoch=1, steps_done=12), 60,
             "Ray to register the checkpoint within the second epoch", every=0.05)
    first.kill()
    # the restarted group's epoch 2, then epoch 3's checkpoint within it: the newest Ray registered when the run
    # fails, and the one the re-run finds first in Ray's record of them
    driver.wait_for_line("epoch 3/4  step 12/22  checkpoint saved (within the epoch)")
    second = wait_for(driver.train_workers, 60, "the restarted group's workers")[-1]
    wait_for(lambda: _registered_within_epoch(storage / "resumed", epoch=2, steps_done=12), 60,
             "Ray to register the checkpoint within the third epoch", every=0.05)
    second.kill()
    assert driver.finish(timeout=300) == 1, driver.output[-3000:]
    wait_for(lambda: not driver.processes(), 60, "every process the failed command started to end")
    (failed,) = _runs(storage)
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    epochs_before = sorted(m.step for m in client.get_metric_history(failed.info.run_id, "val_top1"))
    # Ray's newest registered checkpoint: a kill during the next epoch's report may leave a newer
    # directory it never registered, which a resume never picks (the re-run removes it)
    newest = Path(Result.from_path(str(storage / "resumed")).checkpoint.path)
    snapshot = json.loads((storage / "resumed" / "checkpoint_manager_snapshot.json").read_text())
    intact = [read_meta(storage / "resumed" / r["checkpoint_dir_name"])["epoch"] for r in snapshot["checkpoint_results"]
              if r["checkpoint_dir_name"] != newest.name]
    # an intact directory Ray never registered, the newest by its write: a resume must neither pick it
    # nor let it hide the damage below
    orphan = storage / "resumed" / "checkpoint_2000-01-01_00-00-00.000000"
    shutil.copytree(newest, orphan, copy_function=shutil.copy)  # written now: newer than the original
    states = next(newest.rglob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])  # truncated mid-write
    result = run_vitsweep(args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return KilledAndRerun(storage, driver.output, (first.pid, second.pid), epochs_before, failed, newest,
                          max(intact) + 2, orphan, result)


def test_a_killed_worker_restarts_its_group_from_the_checkpoint_and_the_run_goes_on(killed_and_rerun):
    assert not psutil.pid_exists(killed_and_rerun.killed_workers[0])
    assert "(resumed from a checkpoint)" in killed_and_rerun.first_output, killed_and_rerun.first_output[-4000:]
    # each epoch trained (and logged) once: none repeated after the restart
    epochs = killed_and_rerun.epochs_before
    assert len(epochs) >= 2 and epochs == list(range(1, len(epochs) + 1)), epochs
    # the restarted group loaded model, ZeRO optimizer shards and scheduler, and went on from there: the
    # second epoch's 13th step (1,437 images, 3 repeats: 718 a rank, 22 steps of 32)
    assert killed_and_rerun.resumed_at()[0] == (2, 2)
    assert killed_and_rerun.resumed_at("resumed_at_step") == [(2, 13)]  # the re-run resumed at an epoch's start
    assert "epoch 2/4  resuming after step 12 of 22" in killed_and_rerun.first_output
    # ... with the rest of that epoch: the health windows (every 20 steps and at an epoch's end) fall at the
    # optimizer's steps 20 and 22 of each epoch, never where a re-read epoch would put them (34 + 20, ...)
    (run,) = _runs(killed_and_rerun.storage)
    history = MlflowClient(f"sqlite:///{killed_and_rerun.storage}/mlflow.db").get_metric_history(
        run.info.run_id, "health/loss")
    windows = {22 * epoch + step for epoch in range(4) for step in (20, 22)}
    assert {m.step for m in history} <= windows and 22 * 4 in {m.step for m in history}


def test_a_killed_worker_with_no_retries_left_ends_the_run_failed_with_the_reason(killed_and_rerun):
    output, pid = killed_and_rerun.first_output, killed_and_rerun.killed_workers[1]
    # What happened, not what it caused: the gloo error of the rank that lost its peer is no reason.
    reason = rf"error: worker rank [01] \(pid {pid} on [\d.]+\) died: its worker process has died"
    assert re.match(f"vitsweep train: {reason}", _last_line(output)), output[-3000:]
    run = killed_and_rerun.failed
    assert run.info.status == "FAILED" and re.match(reason, run.data.tags["stop_reason"])


def test_a_failed_runs_command_again_finishes_its_run_and_leaves_no_unregistered_checkpoint(killed_and_rerun):
    storage, result = killed_and_rerun.storage, killed_and_rerun.rerun
    assert "(resumed from a checkpoint)" in result.stdout
    (run,) = _runs(storage)
    assert run.info.run_id == killed_and_rerun.failed.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["stop_reason"] == "completed"
    assert not killed_and_rerun.orphan.exists()
    assert unregistered_checkpoints(storage / "resumed") == []


def test_the_runs_spend_counts_its_restarted_group_and_its_re_run(killed_and_rerun):
    """2 workers x 1 CPU (the smoke preset's): CPU-core-hours are twice the wall hours, bounded by what
    MLflow's own timestamps and the epochs' times say, each attempt apart."""
    storage, failed = killed_and_rerun.storage, killed_and_rerun.failed
    (run,) = _runs(storage)
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    first = failed.data.metrics["cost/accelerator_hours"]  # the failed command's whole attempt
    epochs = client.get_metric_history(run.info.run_id, "epoch_time_s")
    before = sorted((m for m in epochs if m.timestamp <= failed.info.end_time), key=lambda m: m.timestamp)
    after = [m for m in epochs if m.timestamp > failed.info.end_time]
    # from its first epoch's start to its last epoch's end, the group's restart between: all paid for
    paid_at_least = (before[-1].timestamp - before[0].timestamp) / 1000 + before[0].value
    assert 2 * paid_at_least / 3600 < first < 2 * (failed.info.end_time - failed.info.start_time) / 3.6e6
    rerun = run.data.metrics["cost/accelerator_hours"] - first  # what the same command again added
    assert 2 * sum(m.value for m in after) / 3600 < rerun < 2 * (run.info.end_time - failed.info.end_time) / 3.6e6
    assert run.data.metrics["cost/wall_hours"] == pytest.approx(run.data.metrics["cost/accelerator_hours"] / 2)


def test_the_checkpoints_kept_are_the_best_by_the_checkpoint_score_and_the_latest(killed_and_rerun):
    storage = killed_and_rerun.storage
    (run,) = _runs(storage)
    lr = {m.step: m.value for m in MlflowClient(f"sqlite:///{storage}/mlflow.db").get_metric_history(run.info.run_id, "lr")}
    assert sorted(lr, key=lr.get, reverse=True)[:2] == [1, 2]  # the schedule's highest rates
    kept = sorted(read_meta(path)["epoch"] + 1 for path in (storage / "resumed").glob("checkpoint_*") if path.is_dir())
    assert kept == [1, 2, 4]  # the damaged third epoch's is neither among the best nor the latest


def test_a_corrupt_latest_checkpoint_is_named_and_skipped_for_the_newest_intact_one(killed_and_rerun):
    assert f"warning: checkpoint {killed_and_rerun.damaged} is corrupt" in killed_and_rerun.rerun.stdout
    # from the newest registered checkpoint before it (kept by its score, not necessarily the epoch before)
    assert killed_and_rerun.resumed_at()[-1][1] == killed_and_rerun.resume_epoch
    assert len(killed_and_rerun.resumed_at()) == 2  # the group's restart, then the re-run


def test_a_dataset_changed_after_its_sidecar_was_written_is_refused_before_ray_starts(tmp_path, digits16, capsys):
    damaged = tmp_path / "train.beton"
    data = bytearray(digits16["train"].read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(byte ^ 0xFF for byte in data[middle: middle + 64])  # same size, other bytes
    damaged.write_bytes(bytes(data))
    (tmp_path / "train.beton.json").write_text(
        digits16["train"].with_name("train.beton.json").read_text())
    storage = tmp_path / "runs"
    err = refused_in_process(train_command(storage, {**digits16, "train": damaged})[1:], capsys)
    assert str(damaged) in _last_line(err) and "SHA-256" in _last_line(err)
    assert not _runs(storage) and not list(storage.glob("*/vitsweep.log"))
