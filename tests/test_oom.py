"""A trial that runs out of memory goes on at a smaller micro-batch (``pipeline.training.oom``): the split
by hand, the fault a CPU test injects, the failure Ray Train hands over, and, with FFCV's real loader and a
real DeepSpeed engine, the same global batches and the same loss trajectory at any split of the step.
(A sweep's trial retried end to end: test_tune_e2e.)"""
import os
import re

import pytest
import torch
from ray.train import WorkerGroupError
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
from ray.tune.experiment import Trial

from pipeline.components.lr_scaling import effective_lr
from pipeline.components.memory_snapshot import write_memory_snapshot
from pipeline.config.loading import load_config
from pipeline.config.schema import DataConfig
from pipeline.data.loaders import build_train_loader
from pipeline.sweeps.tracking import STOP_REASON_TAG, TrialRecorder
from pipeline.tracking.store import MlflowStore
from pipeline.training.oom import (INJECT_ENV, raise_injected_oom, ran_out_of_memory, smaller_micro_batch, split,
                                   split_params)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("asked, smaller", [((32, 1), (16, 2)), ((16, 2), (8, 4)), ((15, 1), (5, 3)), ((7, 2), (1, 14)),
                                            ((2, 3), (1, 6))])
def test_a_smaller_split_keeps_the_global_batch_and_the_rate(asked, smaller):
    overrides = [f"optim.micro_batch_size={asked[0]}", f"optim.grad_accum_steps={asked[1]}", "optim.lr=null",
                 "optim.lr_per_512=1e-3"]
    cfg = load_config("smoke", overrides)
    retried = smaller_micro_batch(cfg)
    assert (retried.optim.micro_batch_size, retried.optim.grad_accum_steps) == smaller
    assert smaller[0] * smaller[1] == asked[0] * asked[1]  # by hand: the same samples per worker and step
    assert effective_lr(retried.optim, 2) == effective_lr(cfg.optim, 2) == pytest.approx(1e-3 * asked[0] * asked[1] * 2 / 512)
    assert retried.optim.schedule == cfg.optim.schedule and retried.model_dump(exclude={"optim"}) == cfg.model_dump(
        exclude={"optim"})
    assert split(retried) == f"{smaller[0]}x{smaller[1]}"
    assert split_params(retried) == {"oom_split.micro_batch_size": smaller[0], "oom_split.grad_accum_steps": smaller[1]}


def test_a_micro_batch_of_one_has_no_smaller_split():
    assert smaller_micro_batch(load_config("smoke", ["optim.micro_batch_size=1"])) is None


def test_the_injected_fault_is_torchs_own_error_for_the_runs_it_names_above_the_micro_batch_given(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "*_00000:16")
    with pytest.raises(torch.OutOfMemoryError, match="a micro-batch of 32 does not fit"):
        raise_injected_oom("4f2a1_00000", 32)
    raise_injected_oom("4f2a1_00000", 16)  # fits
    raise_injected_oom("4f2a1_00001", 32)  # another run
    monkeypatch.delenv(INJECT_ENV)
    raise_injected_oom("4f2a1_00000", 10**6)  # no fault without the variable


def test_a_fit_failed_by_a_workers_out_of_memory_error_is_told_from_other_failures():
    oom = UserExceptionWithTraceback(torch.OutOfMemoryError("CUDA out of memory"), "Traceback ...")
    other = UserExceptionWithTraceback(RuntimeError("gloo: connection closed"), "Traceback ...")
    assert ran_out_of_memory(WorkerGroupError("rank 1 failed", {0: other, 1: oom}))
    assert not ran_out_of_memory(WorkerGroupError("rank 0 failed", {0: other}))
    assert not ran_out_of_memory(RuntimeError("the controller failed"))


def test_a_trial_that_ended_itself_pruned_as_out_of_memory_keeps_its_reason(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    store = MlflowStore(uri)
    parent = store.create_run("vitsweep", "sweep")
    recorder = TrialRecorder(uri, "vitsweep", parent.run_id, epochs=2, scheduler="fifo")
    reasons = {}
    for trial_id, ended in [("t_00000", "pruned: oom: out of memory at micro-batch 1"), ("t_00001", None)]:
        child = store.create_run("vitsweep", trial_id, {"mlflow.parentRunId": parent.run_id, "trial_id": trial_id,
                                                        STOP_REASON_TAG: "running"})
        child.end("FINISHED", ended) if ended else child.finish("FINISHED")
        recorder.on_trial_complete(0, [], Trial("trial", trial_id=trial_id, config={}, stub=True))
        run = child.get()
        reasons[trial_id] = (run.info.status, run.data.tags[STOP_REASON_TAG])
    assert reasons == {"t_00000": ("FINISHED", "pruned: oom: out of memory at micro-batch 1"),
                       "t_00001": ("FINISHED", "completed")}


def test_the_memory_snapshot_lists_the_largest_live_tensor_first_and_the_processes_memory(tmp_path):
    held = torch.ones(4, 4096, 1024)  # 64 MiB, by hand, touched: resident
    directory = write_memory_snapshot(tmp_path / "oom", 1, torch.device("cpu"))
    lines = (directory / "rank1_memory.txt").read_text().splitlines()
    assert lines[0] == "rank 1 ran out of memory on cpu"
    now, peak = (float(mib) for mib in re.findall(r"([\d.]+) MiB", lines[1]))
    assert 64 <= now <= peak
    listed = [line.split() for line in lines[3:]]
    assert ["64.000", "MiB", "torch.float32", "(4,", "4096,", "1024)"] in listed  # whatever else this process holds
    sizes = [float(line[0]) for line in listed]
    assert sizes == sorted(sizes, reverse=True) and len(listed) <= 25  # the largest first, 25 at most
    assert [path.name for path in directory.iterdir()] == ["rank1_memory.txt"]  # no CUDA allocator on a CPU
    del held


# --------------------------------------------------------------------------------------------------
# The same global batches, the same trajectory
# --------------------------------------------------------------------------------------------------

# Every sample whole and unflipped: the crops are the same draws at any batch size.
EXACT = DataConfig(num_workers=1, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
                   augment={"hflip": 0.0, "rand_augment": None, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
                            "random_erasing": 0.0})
SPLITS = [(32, 1), (16, 2), (8, 4)]


def _steps(digits16, micro: int, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The epoch's optimizer steps, each its micro-batches' images and labels concatenated."""
    loader = build_train_loader(EXACT, digits16["train"], micro, 16, "cpu", seed=3, batches_per_step=accum)
    assert len(loader) % accum == 0
    batches = [(images.clone(), labels.clone()) for images, labels in loader]
    assert len(batches) == len(loader)
    return [tuple(torch.cat(part) for part in zip(*batches[i:i + accum])) for i in range(0, len(batches), accum)]


def test_every_split_of_the_step_trains_each_step_on_the_same_samples_and_no_step_crosses_an_epoch(digits16):
    steps = {split_: _steps(digits16, *split_) for split_ in SPLITS}
    whole = steps[(32, 1)]
    assert len(whole) == 1437 // 32  # by hand: the digits' 1,437 training images in whole steps of 32
    for split_, each in steps.items():
        assert len(each) == len(whole), split_
        for (images, labels), (whole_images, whole_labels) in zip(each, whole):
            assert torch.equal(labels, whole_labels) and torch.equal(images, whole_images)


def test_a_split_step_follows_the_unsplit_runs_loss_trajectory(digits16, single_process_group):
    """A LayerNorm ViT (no batch statistics), DeepSpeed's ZeRO-1 in fp32 with the worker's optimizer, schedule
    and loss: one epoch at each split, the loss of every optimizer step and the final weights compared."""
    import deepspeed

    from pipeline.components.engine import deepspeed_config
    from pipeline.components.losses import build_training_loss
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler
    from pipeline.data.augment import BatchAugment

    trajectories, weights = {}, {}
    for micro, accum in SPLITS:
        cfg = load_config("smoke", ["model.name=vit_mini_p4", "model.args={depth: 1, embed_dim: 32, num_heads: 2}",
                                    f"optim.micro_batch_size={micro}", f"optim.grad_accum_steps={accum}"])
        torch.manual_seed(0)
        model = build_model(cfg.model, 10)
        optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, 1))
        steps = _steps(digits16, micro, accum)
        scheduler = build_scheduler(optimizer, cfg.optim, len(steps))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(cfg, 1), dist_init_required=False)
        augment = BatchAugment(cfg.data.augment, 10, torch.device("cpu"))
        loss_of = build_training_loss(cfg, augment, 10, torch.device("cpu"))
        losses = []
        for images, labels in steps:
            step_loss = 0.0
            for chunk_images, chunk_labels in zip(images.split(micro), labels.split(micro)):
                inputs, targets = augment(chunk_images, chunk_labels)
                loss = loss_of(engine(inputs), targets, inputs)
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / accum
            losses.append(step_loss)
        trajectories[(micro, accum)] = torch.tensor(losses, dtype=torch.float64)
        weights[(micro, accum)] = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    assert trajectories[(32, 1)][-1] < trajectories[(32, 1)][0]  # it learns: the comparison is not of constants
    for split_ in SPLITS[1:]:
        torch.testing.assert_close(trajectories[split_], trajectories[(32, 1)], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(weights[split_], weights[(32, 1)], rtol=1e-3, atol=1e-5)
