"""Checkpoints that cannot be read are named, and skipped for the newest intact one: real DeepSpeed
checkpoints written by pipeline.checkpointing, then truncated or overwritten."""
import json
import logging
import shutil

import pytest
import torch

from pipeline.checkpointing import (
    CorruptCheckpointError,
    DEEPSPEED_TAG,
    MANIFEST_PREFIX,
    check_run_checkpoints,
    checkpoint_to_resume,
    checkpoints_newest_first,
    latest_intact_checkpoint,
    load_checkpoint,
    model_identity,
    save_checkpoint,
    use_weights_only_loading,
    verify_checkpoint,
)
from pipeline.config import load_config


@pytest.fixture(scope="module")
def engine(single_process_group):
    """A one-process DeepSpeed ZeRO-1 engine of the smoke model (gloo on CPU)."""
    import deepspeed

    from pipeline.engine import deepspeed_config
    from pipeline.lr_scaling import effective_lr
    from pipeline.modeling import build_model
    from pipeline.optim import build_optimizer, build_scheduler

    cfg = load_config("smoke", ["model.args.depth=1", "scaling.num_workers=1"])
    model = build_model(cfg.model, num_classes=10)
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, cfg.optim, 4),
        config=deepspeed_config(cfg, 1), dist_init_required=False,
    )
    use_weights_only_loading(engine)
    return engine, model_identity(cfg.model, 10)


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    """A run directory with two intact checkpoints, epochs 0 and 1 (copied per test, free to damage)."""
    engine, identity = engine
    run = tmp_path_factory.mktemp("run")
    for epoch in (0, 1):
        directory = run / f"checkpoint_epoch{epoch}"
        directory.mkdir()
        save_checkpoint(engine, directory, epoch=epoch, identity=identity, rank=0)
    return run


@pytest.fixture
def run_dir(saved, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def _model_states(checkpoint):
    return next((checkpoint / DEEPSPEED_TAG).glob("*model_states.pt"))


def test_a_saved_checkpoint_lists_every_file_with_its_size_and_sha256(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    manifest = json.loads((checkpoint / f"{MANIFEST_PREFIX}0.json").read_text())
    listed = {entry["name"] for entry in manifest["files"]}
    written = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*")
               if p.is_file() and not p.name.startswith(MANIFEST_PREFIX)}
    assert listed == written and f"{DEEPSPEED_TAG}/{_model_states(checkpoint).name}" in listed
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"])
    verify_checkpoint(checkpoint)


def test_a_truncated_checkpoint_file_is_named(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    states = _model_states(checkpoint)
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=rf"{states.name}.*truncated"):
        verify_checkpoint(checkpoint)


def test_overwritten_bytes_of_the_same_size_are_named(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    states = _model_states(checkpoint)
    data = bytearray(states.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    states.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{states.name}.*SHA-256"):
        verify_checkpoint(checkpoint)


def test_a_missing_checkpoint_file_is_named(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    _model_states(checkpoint).unlink()
    with pytest.raises(CorruptCheckpointError, match="model_states.pt' is missing"):
        verify_checkpoint(checkpoint)


def test_a_checkpoint_missing_a_ranks_manifest_is_incomplete(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    meta = checkpoint / "vitsweep_checkpoint.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"world_size": 2}))
    with pytest.raises(CorruptCheckpointError, match="written by 2 ranks"):
        verify_checkpoint(checkpoint)


def test_a_checkpoint_without_manifests_is_checked_by_its_archives_crc(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    for manifest in checkpoint.glob(f"{MANIFEST_PREFIX}*"):
        manifest.unlink()
    verify_checkpoint(checkpoint)  # an intact checkpoint of before manifests still passes
    states = _model_states(checkpoint)
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=states.name):
        verify_checkpoint(checkpoint)


def test_the_newest_intact_checkpoint_is_picked_with_a_warning_naming_the_bad_file(run_dir, caplog):
    states = _model_states(run_dir / "checkpoint_epoch1")
    states.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpointing"):
        assert latest_intact_checkpoint(run_dir) == run_dir / "checkpoint_epoch0"
    assert states.name in caplog.text


def test_the_latest_checkpoint_is_picked_when_every_one_is_intact(run_dir):
    assert latest_intact_checkpoint(run_dir) == run_dir / "checkpoint_epoch1"


def test_a_worker_handed_a_corrupt_checkpoint_resumes_from_the_intact_one_and_loads_it(run_dir, engine):
    engine, identity = engine
    _model_states(run_dir / "checkpoint_epoch1").write_bytes(b"PK\x03\x04 truncated")
    chosen = checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir)
    assert chosen == run_dir / "checkpoint_epoch0"
    assert load_checkpoint(engine, chosen, identity=identity, rank=0) == 1  # epoch 0 done: start at 1


def test_a_worker_handed_an_intact_checkpoint_keeps_it(run_dir):
    assert checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir) == run_dir / "checkpoint_epoch1"


def test_with_no_intact_checkpoint_left_training_starts_afresh_rather_than_failing_again(run_dir, caplog):
    for epoch in (0, 1):
        _model_states(run_dir / f"checkpoint_epoch{epoch}").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpointing"):
        assert checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir) is None
    assert "starts again from epoch 0" in caplog.text


def test_torch_itself_fails_on_the_file_verification_refuses(run_dir):
    states = _model_states(run_dir / "checkpoint_epoch1")
    states.write_bytes(states.read_bytes()[:-100])
    with pytest.raises(RuntimeError, match="zip archive"):
        torch.load(states, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=states.name):
        verify_checkpoint(run_dir / "checkpoint_epoch1")


def test_a_rerun_is_told_before_any_worker_which_intact_checkpoint_it_resumes(run_dir, caplog):
    (run_dir / "checkpoint_epoch1" / "vitsweep_manifest_rank0.json").write_text("{truncated")
    with caplog.at_level(logging.WARNING, logger="pipeline.checkpointing"):
        assert check_run_checkpoints(run_dir) == run_dir / "checkpoint_epoch0"
    assert "vitsweep_manifest_rank0.json" in caplog.text


def test_a_rerun_checks_only_the_checkpoints_it_may_resume(run_dir):
    """A newer directory Ray never registered (a kill mid-report) is neither resumed nor the newest."""
    unregistered = [run_dir / "checkpoint_epoch1"]
    assert check_run_checkpoints(run_dir, ignore=unregistered) == run_dir / "checkpoint_epoch0"
    assert checkpoints_newest_first(run_dir, ignore=unregistered) == [run_dir / "checkpoint_epoch0"]
    _model_states(run_dir / "checkpoint_epoch0").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"none of the 1 checkpoints.*checkpoint_epoch0"):
        check_run_checkpoints(run_dir, ignore=unregistered)  # the intact one it may not resume is no rescue


def test_a_rerun_whose_checkpoints_are_all_corrupt_is_refused_before_any_worker(run_dir):
    for epoch in (0, 1):
        _model_states(run_dir / f"checkpoint_epoch{epoch}").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"none of the 2 checkpoints.*model_states.pt.*new run.name"):
        check_run_checkpoints(run_dir)


def test_a_new_run_has_no_checkpoint_to_check(tmp_path):
    assert check_run_checkpoints(tmp_path / "never-ran") is None


def test_a_rerun_of_a_run_stopped_before_its_first_checkpoint_says_it_starts_from_epoch_1(tmp_path, capsys):
    from pipeline.runs import check_resumable
    from pipeline.tracking import RUN_RECORD

    started = tmp_path / "stopped"  # its MLflow run was opened, then a signal came before epoch 1 ended
    started.mkdir()
    (started / RUN_RECORD).write_text(json.dumps({"tracking_uri": "sqlite:///m.db", "run_id": "0" * 32}))
    check_resumable(started, load_config("smoke", ["run.name=stopped"]), num_classes=10)
    assert "run stopped was started before, but no checkpoint was saved: starting from epoch 1" in \
        capsys.readouterr().out


def test_a_first_run_says_nothing_about_checkpoints(tmp_path, capsys):
    from pipeline.runs import check_resumable

    check_resumable(tmp_path / "new", load_config("smoke", ["run.name=new"]), num_classes=10)
    assert capsys.readouterr().out == ""
