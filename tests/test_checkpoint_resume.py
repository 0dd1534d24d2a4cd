"""A resumed run continues exactly where its checkpoint was taken: a real one-process DeepSpeed engine
trains a step, saves, trains another, and loads the checkpoint back; model, optimizer (moments and
fp32 master weights), scheduler, EMA and every RNG must then be as they were at the save."""
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.components.checkpointing import (DEEPSPEED_TAG, ResumePoint, load_checkpoint, model_identity,
    save_checkpoint, use_weights_only_loading)
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError


@pytest.fixture(scope="module")
def trainer(single_process_group):
    """A ZeRO-1 engine of a one-block smoke model with its scheduler (warming up) and an EMA."""
    import deepspeed

    from pipeline.components.engine import deepspeed_config
    from pipeline.components.modeling import build_model
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.optim import build_ema, build_optimizer, build_scheduler

    cfg = load_config("smoke", ["model.args.depth=1", "scaling.num_workers=1", "optim.ema_decay=0.5",
                                "optim.epochs=2", "optim.schedule.warmup_epochs=1"])
    model = build_model(cfg.model, num_classes=10)
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, 1))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=build_scheduler(optimizer, cfg.optim, steps_per_epoch=4),
        config=deepspeed_config(cfg, 1), dist_init_required=False,
    )
    use_weights_only_loading(engine)
    return engine, build_ema(engine.module, cfg.optim), model_identity(cfg.model, 10)


def _train_step(engine, ema) -> None:
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))  # draws from the global RNG
    engine.backward(F.cross_entropy(engine(images), labels))
    engine.step()
    ema.update(engine.module, step=engine.global_steps)


def _state(engine, ema) -> dict:
    """Everything a resumed step depends on, copied."""
    base = engine.optimizer.optimizer  # torch's AdamW over ZeRO's fp32 partitions
    return {
        "model": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "moments": [t.clone() for s in base.state.values() for k, t in sorted(s.items()) if torch.is_tensor(t)],
        "fp32_master": [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups],
        "scheduler": engine.lr_scheduler.state_dict()["last_epoch"],
        "lr": engine.get_lr()[0],
        "global_steps": engine.global_steps,
        "ema": {k: v.clone() for k, v in ema.module.state_dict().items()},
    }


def _draws() -> tuple:
    """The next numbers of every RNG a training step uses."""
    return torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist()


def _differences(before: dict, after: dict) -> list[str]:
    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        return a == b

    return [key for key in before if not same(before[key], after[key])]


def test_loading_a_checkpoint_restores_model_optimizer_scheduler_ema_and_rng(trainer, tmp_path):
    engine, ema, identity = trainer
    _train_step(engine, ema)  # optimizer moments, a scheduler step and an EMA average exist
    save_checkpoint(engine, tmp_path, epoch=3, identity=identity, rank=0, ema=ema)
    at_save, draws_at_save = _state(engine, ema), _draws()

    _train_step(engine, ema)  # moves every part of the state, and the RNGs
    assert _differences(at_save, _state(engine, ema)) == list(at_save)  # each part really moved
    assert _draws() != draws_at_save

    assert load_checkpoint(engine, tmp_path, identity=identity, rank=0, ema=ema) == ResumePoint(epoch=4)
    assert _differences(at_save, _state(engine, ema)) == []
    assert _draws() == draws_at_save


def test_a_checkpoint_within_an_epoch_resumes_that_epoch_after_its_steps(trainer, tmp_path):
    engine, ema, identity = trainer
    save_checkpoint(engine, tmp_path, epoch=3, identity=identity, rank=0, ema=ema, steps_done=2)
    assert load_checkpoint(engine, tmp_path, identity=identity, rank=0, ema=ema) == ResumePoint(epoch=3, steps_done=2)
    # within the first epoch of a run from trained weights: their metrics, measured before it and not yet reported
    initial = {"initial_val_top1": 41.5, "initial_val_loss": 1.25}
    save_checkpoint(engine, tmp_path, epoch=0, identity=identity, rank=0, ema=ema, steps_done=2,
                    initial_metrics=initial)
    assert load_checkpoint(engine, tmp_path, identity=identity, rank=0, ema=ema) == ResumePoint(0, 2, initial)


@pytest.mark.parametrize("score", ["val_top1", "val_loss"])
def test_a_checkpoint_within_an_epoch_ranks_below_the_scored_ones_also_after_ray_reads_its_record_back(
        tmp_path, score):
    """Ray Train's own checkpoint manager (as its controller runs it): the within-epoch checkpoint's score
    (``unranked_score``) ranks it last; a re-run reads Ray's record back and goes on registering (a NaN score
    would be written as null there, and the next registration would fail on it)."""
    import asyncio

    from ray.train import Checkpoint, CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from pipeline.components.checkpointing import checkpoint_score_order, unranked_score

    def checkpoint(name: str) -> Checkpoint:
        directory = tmp_path / "run" / name
        directory.mkdir(parents=True)
        (directory / "state").write_text(name)
        return Checkpoint(str(directory))

    better, worse = (10.0, 50.0) if score.endswith("loss") else (50.0, 10.0)
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=score,
                              checkpoint_score_order=checkpoint_score_order(score))

    async def rerun_after_a_checkpoint_within_an_epoch() -> list[str]:
        first = CheckpointManager(config, StorageContext(str(tmp_path), "run"))
        for name, value in (("epoch1", worse), ("epoch2", better), ("epoch3_step5", unranked_score(score))):
            first.register_checkpoint(_TrainingReport(checkpoint(name), {score: value}, None))
        again = CheckpointManager(config, StorageContext(str(tmp_path), "run"))  # the re-run's controller
        again.register_checkpoint(_TrainingReport(checkpoint("epoch3"), {score: worse}, None))
        return [Path(result.checkpoint.path).name for result in again._checkpoint_results]

    ranked = asyncio.run(rerun_after_a_checkpoint_within_an_epoch())
    assert ranked[-1] == "epoch2" and "epoch3_step5" not in ranked  # the best kept; the unranked one gave way
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir()) == sorted(ranked)


def test_resuming_an_ema_run_from_a_checkpoint_without_ema_weights_is_refused(trainer, tmp_path):
    engine, ema, identity = trainer
    save_checkpoint(engine, tmp_path, epoch=0, identity=identity, rank=0)  # as a run without optim.ema_decay does
    with pytest.raises(InvalidInputError, match=re.escape(
            f"checkpoint {tmp_path} has no EMA weights, but optim.ema_decay is set")):
        load_checkpoint(engine, tmp_path, identity=identity, rank=0, ema=ema)


def test_a_checkpoint_whose_deepspeed_state_is_gone_is_refused(trainer, tmp_path):
    engine, ema, identity = trainer
    save_checkpoint(engine, tmp_path, epoch=0, identity=identity, rank=0, ema=ema)
    shutil.rmtree(tmp_path / DEEPSPEED_TAG)
    with pytest.raises(InvalidInputError, match=re.escape(
            f"checkpoint {tmp_path} has no DeepSpeed state under tag 'state'")):
        load_checkpoint(engine, tmp_path, identity=identity, rank=0, ema=ema)


def _save_and_resume_on_rank(rank: int, world_size: int, port: int, directory, out_dir) -> None:
    """One of two ZeRO-2 ranks: seed its RNGs its own way, checkpoint, draw (the uninterrupted run's next
    numbers), reseed as a new process would be, load the checkpoint and draw again."""
    import json

    import deepspeed

    from conftest import gloo_rank
    from pipeline.components.engine import deepspeed_config, use_the_environments_ninja
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    use_the_environments_ninja()  # as a worker does: DeepSpeed loads its CPU comm op, not rebuilds it
    with gloo_rank(rank, world_size, port):
        cfg = load_config("smoke", ["model.args.depth=1", "deepspeed.zero_stage=2"])
        torch.manual_seed(0)  # the same initial model on both ranks
        model = build_model(cfg.model, num_classes=10)
        optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, world_size))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world_size),
                                               lr_scheduler=build_scheduler(optimizer, cfg.optim, 4),
                                               dist_init_required=False)
        use_weights_only_loading(engine)
        identity = model_identity(cfg.model, 10)
        torch.manual_seed(1000 + rank), random.seed(2000 + rank), np.random.seed(3000 + rank)
        directory.mkdir(exist_ok=True)
        save_checkpoint(engine, directory, epoch=0, identity=identity, rank=rank)
        uninterrupted = _draws()
        torch.manual_seed(7), random.seed(7), np.random.seed(7)  # a restarted process's RNGs: anything else
        load_checkpoint(engine, directory, identity=identity, rank=rank)
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"uninterrupted": uninterrupted, "resumed": _draws()}))


def test_resuming_under_zero2_restores_each_ranks_own_rng_state(tmp_path):
    import json

    import torch.multiprocessing as torch_mp

    from conftest import free_port

    torch_mp.spawn(_save_and_resume_on_rank, args=(2, free_port(), tmp_path / "checkpoint", tmp_path), nprocs=2)
    draws = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):
        assert draws[rank]["resumed"] == draws[rank]["uninterrupted"], rank
    assert draws[0]["uninterrupted"] != draws[1]["uninterrupted"]  # each rank has RNGs of its own


def test_a_checkpoint_within_an_epoch_is_reported_but_is_neither_an_epoch_nor_a_trials_result(
        tmp_path, capsys, monkeypatch):
    """The controller's side (Ray Train's callbacks, as they run there) of run.checkpoint_every_steps's report
    (rank 0 says it on the console, in its progress lines' order); end to end: test_fault_injection's
    killed_and_rerun, resumed from one."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from pipeline.report_keys import EPOCH_STEPS_KEY, MID_EPOCH_KEY
    from pipeline.sweeps.tune_callback import SweepReportCallback
    from pipeline.tracking.store import MlflowStore
    from pipeline.training.cost import RunCost
    from pipeline.training.epoch_logger import MLflowEpochLogger

    store = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db")
    run = store.create_run("vitsweep", "mid-epoch")
    report = {"epoch": 2, MID_EPOCH_KEY: 8, EPOCH_STEPS_KEY: 22, "val_top1": float("nan")}
    MLflowEpochLogger(run, 4, RunCost.begin(load_config("smoke"), {})).after_report(None, [report], None)
    assert capsys.readouterr().out == ""
    assert not store.client.get_run(run.run_id).data.metrics  # nothing logged: no epoch ended

    forwarded = []  # what Tune's own callback would report from inside a trial's Tune session
    monkeypatch.setattr(TuneReportCallback, "__init__", lambda self: None)
    monkeypatch.setattr(TuneReportCallback, "after_report", lambda self, context, metrics, checkpoint: forwarded.append(
        metrics[0]))
    callback = SweepReportCallback()
    callback.after_report(None, [report], None)
    assert forwarded == []
    callback.after_report(None, [{"epoch": 2, "val_top1": 50.0}], None)  # an epoch's report still reaches Tune
    assert forwarded == [{"epoch": 2, "val_top1": 50.0, "epochs_done": 2}]
