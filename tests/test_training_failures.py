"""Bad input fails before any worker starts with exit 2, writing nothing; a diverged report marks its run."""
import os
import pickle
import socket
from pathlib import Path

import pytest
import torch

from conftest import processes_started_below, ray_processes, refused_in_process, run_vitsweep, train_command
from pipeline.components.checkpointing import weights_only_checkpoint_engine
from pipeline.console import MARK
from pipeline.report_keys import DIVERGED_CAUSE_KEY, DIVERGED_KEY
from pipeline.tracking.store import MlflowStore
from pipeline.config.loading import load_config
from pipeline.training.cost import RunCost
from pipeline.training.epoch_logger import MLflowEpochLogger


# Refusals run in this process (a command's main, its exit code and stderr): the subject is the refusal,
# not the console script, whose own exit is checked by the two subprocess tests below.
def test_invalid_config_exits_2_before_ray_starts(tmp_path, digits16, capsys):
    err = refused_in_process(train_command(tmp_path / "runs", digits16, "optim.lr=-1")[1:], capsys)
    assert "optim.lr" in err
    assert not (tmp_path / "runs").exists()


def test_unknown_model_override_exits_2_before_ray_starts(tmp_path, digits16, capsys):
    err = refused_in_process(train_command(tmp_path / "runs", digits16, "model.args.qkv=quadratic")[1:], capsys)
    assert "quadratic" in err
    assert not (tmp_path / "runs").exists()


def test_missing_dataset_exits_2_naming_the_path_before_ray_starts(tmp_path, digits16, capsys):
    data = {**digits16, "train": tmp_path / "nowhere.beton"}
    err = refused_in_process(train_command(tmp_path / "runs", data)[1:], capsys)
    assert "nowhere.beton" in err
    assert not (tmp_path / "runs").exists()


def test_truncated_dataset_exits_2_naming_the_file_before_ray_starts(tmp_path, digits16, capsys):
    truncated = tmp_path / "truncated.beton"
    truncated.write_bytes(digits16["train"].read_bytes()[:4096])
    (tmp_path / "truncated.beton.json").write_text(digits16["train"].with_suffix(".beton.json").read_text())
    err = refused_in_process(train_command(tmp_path / "runs", {**digits16, "train": truncated})[1:], capsys)
    assert "truncated.beton" in err


def test_unreachable_mlflow_server_is_a_clear_error_not_a_hang(tmp_path, digits16, capsys):
    err = refused_in_process(train_command(tmp_path / "runs", digits16, "tracking.mlflow_uri=http://127.0.0.1:9")[1:],
                             capsys)
    assert "http://127.0.0.1:9" in err and "unreachable" in err


def test_local_mlflow_store_with_a_ray_client_address_is_rejected(tmp_path, digits16, capsys):
    err = refused_in_process(train_command(tmp_path / "runs", digits16)[1:] + ["--address", "ray://10.0.0.1:10001"],
                             capsys)
    assert "cannot reach it" in err


def test_an_address_where_no_cluster_answers_is_refused_before_anything_starts(tmp_path, digits16, capsys):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err = refused_in_process(train_command(tmp_path / "runs", digits16)[1:] + ["--address", f"127.0.0.1:{port}"],
                             capsys)
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err
    assert not (tmp_path / "runs").exists()


def test_more_workers_than_the_local_ray_can_hold_is_refused_before_it_starts(tmp_path, digits16, capsys):
    err = refused_in_process(train_command(tmp_path / "runs", digits16, "scaling.num_workers=64")[1:], capsys)
    assert f"scaling.num_workers=64 workers need 64 CPUs (the cluster has {os.cpu_count()})" in err
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_the_console_script_exits_2_on_a_misspelt_key_with_one_line_and_no_ray(tmp_path, digits16):
    with processes_started_below(os.getpid()) as started:
        result = run_vitsweep(train_command(tmp_path / "runs", digits16, "optim.lrr=1e-3"), timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "optim.lrr: unknown key (did you mean 'lr'?)" in result.stderr and "Traceback" not in result.stderr
    assert not ray_processes(started), sorted(started)


def test_the_console_script_exits_2_on_a_storage_path_that_cannot_be_created_and_starts_no_ray(tmp_path, digits16):
    with processes_started_below(os.getpid()) as started:
        result = run_vitsweep(train_command(Path("/proc/vitsweep-test/runs"), digits16), timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "run.storage_path: '/proc/vitsweep-test/runs' cannot be created" in result.stderr
    assert "Traceback" not in result.stderr
    assert not ray_processes(started), sorted(started)


def test_a_diverged_report_marks_where_the_loss_diverged_and_logs_no_step(tmp_path, capsys):
    """The controller's side of a divergence (Ray Train's callback, as it runs there): the MLflow run is tagged
    with where, for ``fit_and_record`` to end it FAILED, and the console says it. End to end, through a
    worker's check and ``fit_and_record``, the ASHA sweep's diverging trial (test_tune_e2e), and a failed
    ``vitsweep train``'s exit 1 and last line, the full-disk and lost-worker runs (test_fault_injection)."""
    store = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db")
    run = store.create_run("vitsweep", "diverge")
    cost = RunCost.begin(load_config("smoke"), {})
    MLflowEpochLogger(run, 3, cost).after_report(None, [{DIVERGED_KEY: 1.0, "epoch": 1, "step": 4, "rank": 0}], None)
    assert run.diverged_at() == "epoch 1 step 4"
    assert MARK + "loss diverged at epoch 1 step 4: stopping" in capsys.readouterr().out
    assert not store.client.get_metric_history(run.run_id, "epochs_trained")  # no result logged as an epoch

    spiked = store.create_run("vitsweep", "spikes")  # stopped by run.max_loss_spikes: where, and why
    MLflowEpochLogger(spiked, 3, cost).after_report(None, [{DIVERGED_KEY: 1.0, "epoch": 2, "step": 7, "rank": 0,
                                                           DIVERGED_CAUSE_KEY: "3 loss spikes over 5x the running median"}], None)
    assert spiked.diverged_at() == "epoch 2 step 7 (3 loss spikes over 5x the running median)"


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("unpickled arbitrary code",))


@pytest.mark.parametrize("told_to_unpickle", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_checkpoint_loading_refuses_arbitrary_pickles(tmp_path, monkeypatch, told_to_unpickle):
    if told_to_unpickle:  # torch's switch for loads that do not say weights_only: ours say it
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "payload": _RunsCodeWhenUnpickled()}, path)
    with pytest.raises(pickle.UnpicklingError):
        weights_only_checkpoint_engine().load(str(path))


def test_checkpoint_loading_accepts_tensors_and_containers(tmp_path):
    path = tmp_path / "state.pt"
    buffer = {"module": {"w": torch.ones(2)}, "epoch": 3, "rng": [1, 2], "name": "x"}
    torch.save(buffer, path)
    loaded = weights_only_checkpoint_engine().load(str(path))
    assert loaded["epoch"] == 3 and torch.equal(loaded["module"]["w"], torch.ones(2))


def test_checkpoint_loading_accepts_deepspeed_zero_optimizer_state(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients, "w": torch.ones(2)}, path)
    loaded = weights_only_checkpoint_engine().load(str(path))
    assert loaded["zero_stage"] == ZeroStageEnum.gradients and torch.equal(loaded["w"], torch.ones(2))


def test_a_lost_worker_is_the_failure_reason_not_the_broken_connection_it_left_on_the_other_rank():
    """Ray Train's own error types, shaped as it hands them over when rank 1's process is killed (the
    end-to-end case: test_fault_injection.py::test_a_killed_worker_with_no_retries_left_...)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2._internal.execution.worker_group.worker import ActorMetadata

    from pipeline.training.runs import failure_reason

    where = ActorMetadata(hostname="node-b", node_id="ab" * 28, node_ip="10.0.0.7", pid=4242, accelerator_ids={})
    died = ActorDiedError(ActorDiedErrorContext(
        error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                      "exit detail: Worker unexpectedly exits with a connection error code 2. End of file.",
        actor_id=bytes(16), class_name="RayTrainWorker", pid=4242, node_ip_address="10.0.0.7"))
    lost = WorkerHealthCheckFailedError(f"A worker health check failed.\nWorker info: {where!r}", failure=died)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]:41234")
    assert failure_reason(WorkerGroupError("two ranks failed", {0: gloo, 1: lost})) == (
        "worker rank 1 (pid 4242 on 10.0.0.7) died: its worker process has died "
        "(SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2)")


def test_a_failed_runs_stop_reason_is_the_last_line_of_the_workers_error():
    from pipeline.errors import error_line

    wrapped = RuntimeError("Training failed due to worker errors:\n[Rank 1]\nTraceback (most recent call last):\n"
                           '  File "worker.py", line 3, in fit\nOSError: [Errno 28] No space left on device\n\n')
    assert error_line(wrapped) == "OSError: [Errno 28] No space left on device"
    assert error_line(KeyboardInterrupt()) == "KeyboardInterrupt"  # no message: its type names it
