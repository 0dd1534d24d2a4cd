"""Checkpoints that cannot be read are named, and skipped for the newest intact one: real DeepSpeed
checkpoints written by pipeline.components.checkpointing, then truncated or overwritten."""
import json
import logging
import os
import re
import shutil
import zipfile

import pytest
import torch

from pipeline.components.checkpointing import (CheckpointMismatchError, CorruptCheckpointError, DEEPSPEED_TAG,
    MANIFEST_PREFIX, ResumePoint, check_run_checkpoints, checkpoint_to_resume, checkpoints_newest_first,
    latest_intact_checkpoint, load_checkpoint, model_identity, read_meta, save_checkpoint, use_weights_only_loading,
    verify_checkpoint, write_manifest)
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError


@pytest.fixture(scope="module")
def engine(single_process_group):
    """A one-process DeepSpeed ZeRO-1 engine of the smoke model (gloo on CPU)."""
    import deepspeed

    from pipeline.components.engine import deepspeed_config
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler

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


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def test_a_checkpoints_metadata_records_its_model_epoch_world_size_and_card(engine, tmp_path):
    """The files a resume, a model source and a check read back; the identity's keys are the ones
    checkpoints already written carry."""
    engine, _ = engine
    cfg = load_config("smoke", ["model.args.depth=1"])
    identity = model_identity(cfg.model, 10)
    assert identity == {"name": cfg.model.name, "args": cfg.model.args, "img_size": cfg.model.img_size,
                        "num_classes": 10}
    card = {"num_classes": 10, "class_names": ["zero"] * 10}
    for name, given in (("plain", None), ("carded", card)):
        (tmp_path / name).mkdir()
        save_checkpoint(engine, tmp_path / name, epoch=4, identity=identity, rank=0, card=given)
    assert read_meta(tmp_path / "plain") == {"model": identity, "epoch": 4, "world_size": 1}
    assert read_meta(tmp_path / "carded") == {"model": identity, "epoch": 4, "world_size": 1, "card": card}
    manifest = json.loads((tmp_path / "plain" / f"{MANIFEST_PREFIX}0.json").read_text())
    assert manifest.keys() == {"rank", "files"} and manifest["rank"] == 0


def test_deepspeed_writes_zip_archives_through_the_weights_only_engine(engine, tmp_path):
    """The engine vitsweep swaps in keeps DeepSpeed's configured serialization: zip archives, whose
    CRCs the check of a checkpoint without manifests reads."""
    engine, identity = engine
    use_weights_only_loading(engine)
    save_checkpoint(engine, tmp_path, epoch=0, identity=identity, rank=0)
    archives = sorted((tmp_path / DEEPSPEED_TAG).glob("*.pt"))
    assert len(archives) == 2 and all(zipfile.is_zipfile(archive) for archive in archives)


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
    written = states.stat().st_size
    states.write_bytes(states.read_bytes()[: written // 2])
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint file {str(states)!r} is {written // 2} bytes, {written} were written (truncated or "
            f"overwritten; listed in {MANIFEST_PREFIX}0.json)")):
        verify_checkpoint(checkpoint)


def test_overwritten_bytes_of_the_same_size_are_named(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    states = _model_states(checkpoint)
    data = bytearray(states.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    states.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint file {str(states)!r} does not hash to the SHA-256 its rank recorded in "
            f"{MANIFEST_PREFIX}0.json: its bytes changed after writing")):
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
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint {str(checkpoint)!r} was written by 2 ranks but holds the manifests of 1 "
            f"(['{MANIFEST_PREFIX}0.json']): a rank's files are missing")):
        verify_checkpoint(checkpoint)


def test_a_manifest_that_lists_no_files_vouches_for_nothing(run_dir):
    manifest = run_dir / "checkpoint_epoch1" / f"{MANIFEST_PREFIX}0.json"
    manifest.write_text(json.dumps({"rank": 0}))
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint file {str(manifest)!r} lists no files: it is not a manifest vitsweep wrote")):
        verify_checkpoint(run_dir / "checkpoint_epoch1")


def test_metadata_that_is_missing_or_no_record_is_named(run_dir):
    checkpoint = run_dir / "checkpoint_epoch1"
    meta = checkpoint / "vitsweep_checkpoint.json"
    meta.write_text("[1, 2]")
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint file {str(meta)!r} holds list, not a record")):
        read_meta(checkpoint)
    meta.unlink()
    with pytest.raises(InvalidInputError, match=_exactly(
            f"{checkpoint} is not a vitsweep checkpoint (no vitsweep_checkpoint.json)")):
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
    prefix = re.escape(f"checkpoint file {str(states)!r}: entry ")
    with pytest.raises(CorruptCheckpointError, match=f"^{prefix}'[^']+' fails its CRC-32 check$"):
        verify_checkpoint(checkpoint)
    states.write_bytes(states.read_bytes()[:-100])  # its directory at the end cut off
    with pytest.raises(CorruptCheckpointError, match=_exactly(
            f"checkpoint file {str(states)!r} is not a whole torch archive (File is not a zip file)")):
        verify_checkpoint(checkpoint)


def test_checkpoints_are_ordered_by_epoch_not_by_when_they_were_written(run_dir):
    """A checkpoint copied back or touched later is still older than the next epoch's; metadata that
    is unreadable or has no epoch sorts last (verification names its problem)."""
    older, newer = run_dir / "checkpoint_epoch0", run_dir / "checkpoint_epoch1"
    latest = (newer / "vitsweep_checkpoint.json").stat().st_mtime_ns
    os.utime(older / "vitsweep_checkpoint.json", ns=(latest + 10**9, latest + 10**9))
    assert checkpoints_newest_first(run_dir) == [newer, older]
    for name, meta in (("checkpoint_no_epoch", {"model": {}}), ("checkpoint_unreadable", "{truncated")):
        shutil.copytree(older, run_dir / name)
        (run_dir / name / "vitsweep_checkpoint.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    ordered = checkpoints_newest_first(run_dir)
    assert ordered[:2] == [newer, older] and set(ordered[2:]) == {run_dir / "checkpoint_no_epoch",
                                                                 run_dir / "checkpoint_unreadable"}


def test_checkpoints_within_an_epoch_sort_after_the_epoch_before_and_before_their_epochs_end(run_dir):
    """run.checkpoint_every_steps: (epoch 1, 2 steps done) and (epoch 1, 4 steps done) come between epoch 0's
    end and epoch 1's, in their steps' order, whenever they were written."""
    newest_end = run_dir / "checkpoint_epoch1"
    for name, steps in (("checkpoint_epoch1_step4", 4), ("checkpoint_epoch1_step2", 2)):  # step 2 written last
        shutil.copytree(run_dir / "checkpoint_epoch0", run_dir / name)
        meta = json.loads((run_dir / name / "vitsweep_checkpoint.json").read_text())
        (run_dir / name / "vitsweep_checkpoint.json").write_text(json.dumps({**meta, "epoch": 1, "steps_done": steps}))
        write_manifest(run_dir / name, 0)  # as its rank would have written it
    assert checkpoints_newest_first(run_dir) == [newest_end, run_dir / "checkpoint_epoch1_step4",
                                                 run_dir / "checkpoint_epoch1_step2", run_dir / "checkpoint_epoch0"]
    shutil.rmtree(newest_end)  # the run stopped within epoch 1: the newest mid-epoch checkpoint is resumed
    assert latest_intact_checkpoint(run_dir) == run_dir / "checkpoint_epoch1_step4"


def test_the_newest_intact_checkpoint_is_picked_with_a_warning_naming_the_bad_file(run_dir, caplog):
    states = _model_states(run_dir / "checkpoint_epoch1")
    states.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="pipeline.components.checkpointing"):
        assert latest_intact_checkpoint(run_dir) == run_dir / "checkpoint_epoch0"
    (warning,) = caplog.messages
    assert warning.startswith(f"skipping a corrupt checkpoint: checkpoint file {str(states)!r} is 0 bytes, ")


def test_the_latest_checkpoint_is_picked_when_every_one_is_intact(run_dir):
    assert latest_intact_checkpoint(run_dir) == run_dir / "checkpoint_epoch1"


def test_a_worker_handed_a_corrupt_checkpoint_resumes_from_the_intact_one_and_loads_it(run_dir, engine, caplog):
    engine, identity = engine
    states = _model_states(run_dir / "checkpoint_epoch1")
    states.write_bytes(b"PK\x03\x04 truncated")
    with caplog.at_level(logging.WARNING, logger="pipeline.components.checkpointing"):
        chosen = checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir)
    assert chosen == run_dir / "checkpoint_epoch0"
    handed_warning = caplog.messages[-1]  # after latest_intact_checkpoint's own, for the same file
    assert handed_warning.startswith(f"checkpoint file {str(states)!r} is {states.stat().st_size} bytes, ")
    assert handed_warning.endswith(f"; resuming from the newest intact checkpoint {chosen} instead")
    assert load_checkpoint(engine, chosen, identity=identity, rank=0) == ResumePoint(1)  # epoch 0 done: start at 1


def test_a_worker_handed_an_intact_checkpoint_keeps_it(run_dir):
    assert checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir) == run_dir / "checkpoint_epoch1"


def test_with_no_intact_checkpoint_left_training_starts_afresh_rather_than_failing_again(run_dir, caplog):
    for epoch in (0, 1):
        _model_states(run_dir / f"checkpoint_epoch{epoch}").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="pipeline.components.checkpointing"):
        assert checkpoint_to_resume(run_dir / "checkpoint_epoch1", run_dir) is None
    handed_warning = caplog.messages[-1]
    states = _model_states(run_dir / "checkpoint_epoch1")
    assert handed_warning.startswith(f"checkpoint file {str(states)!r} is 0 bytes")
    assert handed_warning.endswith("; no intact checkpoint is left, so training starts again from epoch 0")


def test_a_worker_handed_a_corrupt_checkpoint_without_its_run_directory_starts_afresh(run_dir, caplog):
    _model_states(run_dir / "checkpoint_epoch1").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="pipeline.components.checkpointing"):
        assert checkpoint_to_resume(run_dir / "checkpoint_epoch1", None) is None
    assert caplog.messages[-1].endswith("; no intact checkpoint is left, so training starts again from epoch 0")


def test_a_checkpoint_of_another_model_is_refused_naming_each_difference(run_dir, engine):
    engine, identity = engine
    checkpoint = run_dir / "checkpoint_epoch1"
    with pytest.raises(CheckpointMismatchError, match=_exactly(
            f"checkpoint {checkpoint} belongs to another model (img_size: checkpoint {identity['img_size']!r} vs "
            "config 32; num_classes: checkpoint 10 vs config 100); use a new run.name to start afresh")):
        load_checkpoint(engine, checkpoint, identity=identity | {"img_size": 32, "num_classes": 100}, rank=0)


def test_torch_itself_fails_on_the_file_verification_refuses(run_dir):
    states = _model_states(run_dir / "checkpoint_epoch1")
    states.write_bytes(states.read_bytes()[:-100])
    with pytest.raises(RuntimeError, match="zip archive"):
        torch.load(states, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=states.name):
        verify_checkpoint(run_dir / "checkpoint_epoch1")


def test_a_rerun_is_told_before_any_worker_which_intact_checkpoint_it_resumes(run_dir, caplog):
    (run_dir / "checkpoint_epoch1" / "vitsweep_manifest_rank0.json").write_text("{truncated")
    with caplog.at_level(logging.WARNING, logger="pipeline.components.checkpointing"):
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
    states = _model_states(run_dir / "checkpoint_epoch1")
    refusal = (f"none of the 2 checkpoints of run {str(run_dir)!r} is intact (the newest: checkpoint file "
               f"{str(states)!r} is 0 bytes, ")
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(refusal)}.*" + re.escape(
            "); choose a new run.name to start afresh, or remove the run directory") + "$"):
        check_run_checkpoints(run_dir)


def test_a_new_run_has_no_checkpoint_to_check(tmp_path):
    assert check_run_checkpoints(tmp_path / "never-ran") is None


def test_a_rerun_of_a_run_stopped_before_its_first_checkpoint_says_it_starts_from_epoch_1(tmp_path, capsys):
    from pipeline.training.runs import check_resumable
    from pipeline.tracking.store import RUN_RECORD

    started = tmp_path / "stopped"  # its MLflow run was opened, then a signal came before epoch 1 ended
    started.mkdir()
    (started / RUN_RECORD).write_text(json.dumps({"tracking_uri": "sqlite:///m.db", "run_id": "0" * 32}))
    check_resumable(started, load_config("smoke", ["run.name=stopped"]), num_classes=10)
    assert "run stopped was started before, but no checkpoint was saved: starting from epoch 1" in \
        capsys.readouterr().out


def test_a_first_run_says_nothing_about_checkpoints(tmp_path, capsys):
    from pipeline.training.runs import check_resumable

    check_resumable(tmp_path / "new", load_config("smoke", ["run.name=new"]), num_classes=10)
    assert capsys.readouterr().out == ""
