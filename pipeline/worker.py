"""The Ray Train worker: what every rank runs. Reads like the recipe; details live in components."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.config import ExperimentConfig
from pipeline.tracking import DIVERGED_TAG


@dataclass(frozen=True)
class WorkerPlan:
    """What the driver resolved before any worker started (sent as Ray's train_loop_config)."""

    config: dict[str, Any]
    num_classes: int
    launched_at: float  # driver's time.time() at `vitsweep train` start, for time-to-first-step

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "num_classes": self.num_classes, "launched_at": self.launched_at}


def train_worker(plan_dict: dict[str, Any]) -> None:
    import deepspeed
    import ray.train
    import ray.train.torch

    from pipeline.checkpointing import load_checkpoint, model_identity, save_checkpoint, save_final_weights
    from pipeline.checkpointing import use_weights_only_loading
    from pipeline.data.augment import BatchAugment
    from pipeline.data.loaders import build_train_loader, build_val_loader
    from pipeline.data.runtime import quiet_numba_finalizers
    from pipeline.data.staging import cache_dir_for, stage_dataset
    from pipeline.engine import deepspeed_config
    from pipeline.modeling import build_model
    from pipeline.optim import build_ema, build_optimizer, build_scheduler

    plan = WorkerPlan(**plan_dict)
    cfg = ExperimentConfig.model_validate(plan.config)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.run.seed + rank)
    quiet_numba_finalizers()

    # Data: this node's copy of each dataset, this rank's shard of it.
    cache_dir = cache_dir_for(cfg.data, cfg.run.storage_path)  # this node's own disk
    train_loader = build_train_loader(
        cfg.data, stage_dataset(cfg.data.train, cache_dir), cfg.optim.micro_batch_size, cfg.model.img_size,
        device, distributed=world_size > 1, seed=cfg.run.seed,
    )
    val_loader = build_val_loader(
        cfg.data, stage_dataset(cfg.data.val, cache_dir), cfg.optim.micro_batch_size, cfg.model.img_size,
        device, distributed=world_size > 1,
    )

    # Model and engine.
    model = build_model(cfg.model, plan.num_classes)
    optimizer = build_optimizer(model, cfg.optim)
    steps_per_epoch = max(1, len(train_loader) // cfg.optim.grad_accum_steps)
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, world_size),
        dist_init_required=False,
    )
    use_weights_only_loading(engine)
    identity = model_identity(cfg.model, plan.num_classes)
    ema = build_ema(engine.module, cfg.optim) if cfg.optim.ema_decay is not None else None

    # Resume: Ray hands the latest checkpoint to a restarted worker group (or a re-run of the run).
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start_epoch = load_checkpoint(engine, Path(directory), identity=identity, rank=rank, ema=ema)
    train_loader.next_epoch = start_epoch  # ffcv's shuffle order is a function of (seed, epoch)

    augment = BatchAugment(cfg.data.augment, plan.num_classes, device)
    criterion = augment.loss()
    distillation = None
    if cfg.distill.teacher is not None:
        from pipeline.distillation import HardDistillationLoss, build_teacher

        teacher = build_teacher(cfg.distill, plan.num_classes, device)
        distillation = HardDistillationLoss(criterion, teacher, cfg.distill.alpha, cfg.data).to(device)
    input_dtype = torch.bfloat16 if cfg.deepspeed.precision == "bf16" else (
        torch.float16 if cfg.deepspeed.precision == "fp16" else torch.float32)
    first_step_logged = start_epoch > 0

    for epoch in range(start_epoch, cfg.optim.epochs):
        epoch_start = time.perf_counter()
        engine.train()
        loss_sum, steps, samples = 0.0, 0, 0
        for step, (images, labels) in enumerate(train_loader):
            images, targets = augment(images, labels)
            logits = engine(images.to(input_dtype))
            loss = (criterion(logits.float(), targets) if distillation is None
                    else distillation(logits.float(), targets, images))
            engine.backward(loss)
            engine.step()
            if ema is not None and engine.is_gradient_accumulation_boundary():
                ema.update(engine.module, step=engine.global_steps)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # one collective: the global loss, and NaN/inf on any rank
            if not torch.isfinite(global_loss):
                ray.train.report({DIVERGED_TAG: 1.0, "epoch": epoch, "step": step, "rank": rank})
                return  # every rank saw the same sum: all stop together, no retry
            if not first_step_logged:
                first_step_logged = True
                time_to_first_step = time.time() - plan.launched_at
            loss_sum += global_loss.item() / world_size
            steps += 1
            samples += len(labels) * world_size
        train_seconds = time.perf_counter() - epoch_start

        metrics = {
            "epoch": epoch,
            "train_loss": loss_sum / max(steps, 1),
            "lr": engine.get_lr()[0],
            "images_per_sec": samples / train_seconds,
            **evaluate(engine, val_loader, input_dtype, device),
            **({} if ema is None else _suffixed(evaluate(ema.module, val_loader, torch.float32, device), "_ema")),
            "epoch_time_s": time.perf_counter() - epoch_start,
        }
        if epoch == start_epoch and start_epoch == 0:
            metrics["time_to_first_step_s"] = time_to_first_step
        elif epoch == start_epoch:  # a restart: MLflow shows where the run picked up its checkpoint
            metrics["resumed_at_epoch"] = start_epoch
        last = epoch == cfg.optim.epochs - 1
        if (epoch + 1) % cfg.run.checkpoint_every == 0 or last:
            with tempfile.TemporaryDirectory(prefix="vitsweep-ckpt-") as directory:
                save_checkpoint(engine, Path(directory), epoch=epoch, identity=identity, rank=rank, ema=ema)
                if last:
                    save_final_weights(engine, Path(directory), rank, ema=ema)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))
        else:
            ray.train.report(metrics)


def evaluate(model, val_loader, input_dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Top-1/top-5 and loss of ``model`` (the engine, or the EMA) over every validation sample
    exactly once across ranks."""
    from pipeline.metrics import Tally

    model.eval()
    tally = Tally()
    with torch.no_grad():
        for images, labels, num_real in val_loader:
            logits = model(images.to(input_dtype)).float()[:num_real]
            labels = labels[:num_real]
            tally.add(logits, labels, F.cross_entropy(logits, labels, reduction="none"))
    return tally.reduced(device).means("val")



def _suffixed(metrics: dict[str, float], suffix: str) -> dict[str, float]:
    return {f"{key}{suffix}": value for key, value in metrics.items()}
