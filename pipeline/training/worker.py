"""The Ray Train worker: what every rank runs, read as the recipe (as torchtitan's ``train.py``).

``Trainer.setup`` builds this rank's state (data shards, the model with the weights it starts from,
DeepSpeed engine, EMA, loss) and resumes a checkpoint (at an epoch's start, or within it where the
checkpoint was taken within it); ``fit`` then evaluates the loaded weights of a run that starts from
trained ones, and runs, for each epoch, ``train_epoch`` (``train_step`` per batch, a checkpoint every
``run.checkpoint_every_steps``), ``evaluate`` and ``end_epoch`` (one report to Ray Train, with a
checkpoint when one is due). The details live in the components it calls.
"""
from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray.train
import ray.train.torch
import torch

from pipeline.components.checkpointing import (ResumePoint, checkpoint_to_resume, load_checkpoint, model_identity,
    save_checkpoint, save_final_weights, unranked_score, use_weights_only_loading)
from pipeline.config.schema import ExperimentConfig
from pipeline.console import duration, say, say_progress
from pipeline.data.augment import BatchAugment
from pipeline.data.loaders import build_train_loader, build_val_loader
from pipeline.data.progressive_resolution import set_training_size, training_sizes
from pipeline.data.runtime import quiet_numba_finalizers
from pipeline.data.staging import cache_dir_for, stage_dataset
from pipeline.components.accelerator import math_mode, mfu, peak_tflops, prepare_gpu_worker, training_tflops
from pipeline.components.health import (HEALTH_PREFIX, HealthReport, LossSpikes, StepHealth, computes_grad_norm,
    step_measuring_grad_norm)
from pipeline.components.engine import (compile_engine, deepspeed_config, input_dtype, keep_batchnorm_in_fp32,
    low_precision_autocast, use_the_environments_ninja)
from pipeline.components.losses import build_training_loss
from pipeline.components.metrics import validation_metrics
from pipeline.components.modeling import build_model, patch_step
from pipeline.components.optim import build_ema, build_optimizer, build_scheduler
from pipeline.components.memory_snapshot import write_memory_snapshot
from pipeline.components.profiling import FIRST_TRACED_STEP, StepProfiler
from pipeline.report_keys import DIVERGED_CAUSE_KEY, DIVERGED_KEY, EPOCH_STEPS_KEY, INITIAL_PREFIX, MID_EPOCH_KEY
from pipeline.tracking.step_metrics import StepMetricsLog
from pipeline.training.oom import raise_injected_oom
from pipeline.trained.teacher import load_teacher
from pipeline.trained.transfer import (TransferPlan, freeze_backbone, load_initial_weights, read_saved_weights,
    train_head_only)


PROFILE_ARTIFACTS = "profile"  # the run's artifact folder for run.profile's trace
OOM_ARTIFACTS = "oom"  # ... and for the memory snapshots of the ranks that ran out of memory
MONITOR_STOP_TIMEOUT_S = 30.0  # the most a worker waits for its node's last system-metrics sample to be logged


@dataclass(frozen=True)
class WorkerPlan:
    """What the driver resolved before any worker started (sent as Ray's train_loop_config)."""

    config: dict[str, Any]
    num_classes: int
    launched_at: float  # driver's time.time() at `vitsweep train` start, for time-to-first-step
    tracking_uri: str  # the run's MLflow store and run: each node's system metrics go there
    mlflow_run_id: str
    gmacs_per_image: float  # the model's forward multiply-adds (models.measure), for TFLOP/s and MFU
    lr: float  # the peak rate, of the global batch (lr_scaling.effective_lr): decided once, recorded as optim.lr_effective
    announce: bool = True  # progress lines on the console (a sweep shows its own table instead)
    model_card: dict[str, Any] | None = None  # ModelCard.as_dict(): recorded in every checkpoint
    # model.init_from: {"location": the saved source, "plan": TransferPlan.as_dict()} (InitialWeights.for_workers)
    init_weights: dict[str, Any] | None = None
    teacher_source: str | None = None  # distill.teacher_from: the saved source (TeacherWeights.location)
    gmacs_by_size: dict[int, float] = field(default_factory=dict)  # data.progressive's (ModelFacts.gmacs_by_size)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train_worker(plan: dict[str, Any]) -> None:
    """Ray Train's entry point on every rank."""
    Trainer(WorkerPlan(**plan)).fit()


@dataclass
class EpochStats:
    loss_sum: float = 0.0  # the global (all-rank mean) loss, summed over the steps synced so far
    steps: int = 0
    samples: int = 0  # over all ranks
    seconds: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)


class LossDiverged(Exception):
    """The global loss of a step is NaN/inf, or spiked ``run.max_loss_spikes`` times: every rank sees the
    same reports and stops together. ``cause``: said beside where (none for a NaN/inf)."""

    def __init__(self, step: int, cause: str | None = None):
        super().__init__(f"loss diverged at step {step}" + (f" ({cause})" if cause else ""))
        self.step, self.cause = step, cause


class Trainer:
    """One rank's training run."""

    def __init__(self, plan: WorkerPlan):
        self.plan = plan
        self.cfg = ExperimentConfig.model_validate(plan.config)
        self.time_to_first_step: float | None = None
        self.initial: dict[str, float] = {}  # initial_val_*: the metrics of the weights the run started from
        self.monitor_start: threading.Thread | None = None  # this node's system-metrics monitor (local rank 0)
        self.monitor = None

    def setup(self) -> None:
        # Here, in the worker process only: the driver imports this module to hand `train_worker`
        # to Ray, and importing DeepSpeed would cost it seconds.
        import deepspeed

        cfg, num_classes = self.cfg, self.plan.num_classes
        if cfg.scaling.use_gpu:  # before any CUDA allocation: a driver too old for torch's CUDA fails here, named
            prepare_gpu_worker(cfg.deepspeed.tf32)
        else:  # before DeepSpeed loads its CPU comm op: the build every process shares, not a rebuild
            use_the_environments_ninja()
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.device = ray.train.torch.get_device()
        torch.manual_seed(cfg.run.seed + self.rank)
        quiet_numba_finalizers()
        if context.get_local_rank() == 0:  # one monitor per node, started on its own thread: MLflow imports slowly
            self.monitor_start = threading.Thread(target=self._monitor_node, args=(context.get_node_rank(),),
                                                  daemon=True)
            self.monitor_start.start()

        self.train_loader, self.val_loader = self.build_loaders()

        # Model (with the weights it starts from, before DeepSpeed partitions or casts it), optimizer,
        # schedule, engine.
        model = build_model(cfg.model, num_classes)
        if self.plan.init_weights is not None:
            load_initial_weights(model, read_saved_weights(self.plan.init_weights["location"]),
                                 TransferPlan.from_dict(self.plan.init_weights["plan"]))
        if cfg.model.freeze == "backbone":
            freeze_backbone(model)
        # data.progressive: each epoch's crop size, rounded to this model's patch (the driver ran the model at each)
        self.training_sizes = (training_sizes(cfg.data.progressive, cfg.model.img_size, cfg.optim.epochs,
                                              patch_step(model))
                               if cfg.data.progressive is not None else None)
        optimizer = build_optimizer(model, cfg.optim, self.plan.lr)
        steps_per_epoch = max(1, len(self.train_loader) // cfg.optim.grad_accum_steps)
        scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(cfg, self.world_size), dist_init_required=False,
        )
        use_weights_only_loading(self.engine)
        keep_batchnorm_in_fp32(self.engine.module)  # running statistics drift in bf16
        compile_engine(self.engine, cfg)
        self.input_dtype = input_dtype(cfg)
        self.autocast = low_precision_autocast(cfg, self.device)
        self.peak_tflops = (peak_tflops(torch.cuda.get_device_name(self.device),
                                        math_mode(cfg.deepspeed.precision, cfg.deepspeed.tf32))
                            if cfg.scaling.use_gpu else None)
        self.identity = model_identity(cfg.model, num_classes)
        self.ema = build_ema(self.engine.module, cfg.optim) if cfg.optim.ema_decay is not None else None
        self.augment = BatchAugment(cfg.data.augment, num_classes, self.device)
        teacher = (load_teacher(self.plan.teacher_source, cfg.model.img_size, self.device)
                   if self.plan.teacher_source is not None else None)
        self.loss = build_training_loss(cfg, self.augment, num_classes, self.device, self.autocast, teacher)

        self.health = StepHealth(self.device, cfg.optim.grad_clip)
        self.loss_spikes = LossSpikes(cfg.run.loss_spike_factor, cfg.run.max_loss_spikes)
        self.deepspeed_grad_norm = computes_grad_norm(self.engine)
        self.step_metrics = StepMetricsLog(self.plan.tracking_uri, self.plan.mlflow_run_id) if self.rank == 0 else None
        self.profiler = (StepProfiler(cfg.run.profile_steps, self.device,
                                      lambda files: self.step_metrics.log_files(files, PROFILE_ARTIFACTS))
                         if self.rank == 0 and cfg.run.profile_steps else None)

        self.resumed = self.resume()
        start = self.resumed or ResumePoint(0)
        self.start_epoch, self.batches_done = start.epoch, start.steps_done * cfg.optim.grad_accum_steps
        self.train_loader.next_epoch = self.start_epoch  # ffcv's shuffle order is a function of (seed, epoch)
        self.train_loader.resume_within_epoch(self.batches_done)  # the rest of the epoch a checkpoint was taken in

    def build_loaders(self):
        """This node's copy of each dataset (staged once per node), this rank's shard of it."""
        cfg = self.cfg
        cache_dir = cache_dir_for(cfg.data, cfg.run.storage_path)
        train, val = (stage_dataset(location, cache_dir, cfg.data.stage_streams)
                      for location in (cfg.data.train, cfg.data.val))
        distributed = self.world_size > 1
        train_loader = build_train_loader(
            cfg.data, train, cfg.optim.micro_batch_size, cfg.model.img_size,
            self.device, distributed=distributed, seed=cfg.run.seed, batches_per_step=cfg.optim.grad_accum_steps,
        )
        val_loader = build_val_loader(  # no activations kept for a backward pass: twice the batch fits
            cfg.data, val, 2 * cfg.optim.micro_batch_size, cfg.model.img_size, self.device, distributed=distributed,
        )
        return train_loader, val_loader

    def resume(self) -> ResumePoint | None:
        """Where to go on: Ray hands the latest checkpoint to a restarted worker group (or a re-run of the
        run), loaded into the engine and EMA; a corrupt one is skipped for the newest intact one beside it
        (local storage), never retried. None: start afresh."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            local = isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)
            chosen = checkpoint_to_resume(directory, Path(checkpoint.path).parent if local else None)
            if chosen is None:
                return None
            return load_checkpoint(self.engine, chosen, identity=self.identity, rank=self.rank, ema=self.ema)

    def _monitor_node(self, node_rank: int) -> None:
        from pipeline.tracking.system_metrics import monitor_node_system

        self.monitor = monitor_node_system(self.plan.tracking_uri, self.plan.mlflow_run_id, f"node{node_rank}",
                                           gpus=self.cfg.scaling.use_gpu)

    def stop_monitoring(self) -> None:
        """The node's last system-metrics sample, logged while the run is still open: a run shorter than
        one sampling interval still has one per node. A store that does not answer never holds the worker up."""
        if self.monitor_start is not None:
            self.monitor_start.join(MONITOR_STOP_TIMEOUT_S)
        if self.monitor is not None:
            stopping = threading.Thread(target=self.monitor.finish, daemon=True)
            stopping.start()
            stopping.join(MONITOR_STOP_TIMEOUT_S)

    def fit(self) -> None:
        self.setup()
        try:
            self.train_epochs()
        except torch.OutOfMemoryError:
            self.leave_memory_snapshot()
            raise  # the run fails; a sweep's trial goes on at a smaller micro-batch (pipeline.training.oom)
        finally:
            if self.profiler is not None:
                self.end_profile()
            if self.step_metrics is not None:
                self.step_metrics.close()
            self.stop_monitoring()

    def train_epochs(self) -> None:
        raise_injected_oom(self.cfg.run.name, self.cfg.optim.micro_batch_size)  # a test's fault (oom.INJECT_ENV)
        # A run started from trained weights first evaluates them as loaded, before any step (reported
        # with its first epoch as initial_val_*, MLflow's step 0; a restart within that epoch has them saved).
        if self.plan.init_weights is not None and self.resumed is None:
            self.initial = {f"{INITIAL_PREFIX}{key}": value for key, value in self.evaluate(with_ema=False).items()}
            if self.rank == 0 and self.plan.announce:
                say(f"epoch 0/{self.cfg.optim.epochs}  the initial weights, before any step:  val_loss "
                    f"{self.initial['initial_val_loss']:.4f}  val_top1 {self.initial['initial_val_top1']:.2f}%  "
                    f"val_top5 {self.initial['initial_val_top5']:.2f}%")
        elif self.resumed is not None:
            self.initial = self.resumed.initial_metrics
        # Epochs count from 1 in everything a person sees (console, MLflow steps, Tune, resumed_at_epoch);
        # `epoch` below is the 0-based index ffcv and the checkpoints use.
        for epoch in range(self.start_epoch, self.cfg.optim.epochs):
            started = time.perf_counter()
            self.resize_crops(epoch)
            try:
                stats = self.train_epoch(epoch)
            except LossDiverged as diverged:
                ray.train.report({DIVERGED_KEY: 1.0, "epoch": epoch + 1, "step": diverged.step, "rank": self.rank,
                                  **({DIVERGED_CAUSE_KEY: diverged.cause} if diverged.cause else {})})
                return  # no retry: the run is recorded FAILED
            images_per_sec = stats.samples / stats.seconds
            size = self.cfg.model.img_size if self.training_sizes is None else self.training_sizes[epoch]
            gmacs = self.plan.gmacs_by_size.get(size, self.plan.gmacs_per_image)  # an image's, at its size
            # lr: the schedule's, the head's under layer-wise decay (the lower layers' are smaller).
            metrics = {"epoch": epoch + 1, "train_loss": stats.mean_loss, "lr": max(self.engine.get_lr()),
                       "images_per_sec": images_per_sec,
                       "tflops_per_sec": training_tflops(gmacs, images_per_sec),
                       **({} if self.peak_tflops is None
                          else {"mfu": mfu(gmacs, images_per_sec, self.peak_tflops)}),
                       **({} if self.training_sizes is None else {"train_img_size": size}),
                       **self.evaluate()}
            metrics["epoch_time_s"] = time.perf_counter() - started
            self.end_epoch(epoch, {**metrics, **self.initial} if epoch == 0 else metrics)

    def resize_crops(self, epoch: int) -> None:
        """Progressive resolution: the epoch's training crop size, said on the console where it changes."""
        if self.training_sizes is None:
            return
        size, final = self.training_sizes[epoch], self.cfg.model.img_size
        set_training_size(self.train_loader, size)
        if self.rank == 0 and self.plan.announce and (epoch == self.start_epoch or size != self.training_sizes[epoch - 1]):
            say(f"epoch {epoch + 1}/{self.cfg.optim.epochs}  training crops at {size} px (data.progressive: "
                f"{final} px from epoch {self.cfg.data.progressive.end_epoch}; validation at {final} px)")

    def train_epoch(self, epoch: int) -> EpochStats:
        self.engine.train()
        if self.cfg.model.freeze == "backbone":
            train_head_only(self.engine.module)
        stats = EpochStats()
        started, saving = time.perf_counter(), 0.0  # saving: the seconds its checkpoints within it took
        steps = len(self.train_loader)
        first = self.batches_done if epoch == self.start_epoch else 0  # resumed within this epoch: its rest
        if first and self.rank == 0 and self.plan.announce:
            accum = self.cfg.optim.grad_accum_steps
            say(f"epoch {epoch + 1}/{self.cfg.optim.epochs}  resuming after step {first // accum} of "
                f"{steps // accum} (a checkpoint within the epoch): the rest of the epoch's order follows")
        self.health.start_window()
        for step, (images, labels) in enumerate(self.health.timed(self.train_loader), start=first):
            self.train_step(images, labels)
            if self.time_to_first_step is None:
                self.time_to_first_step = time.time() - self.plan.launched_at
            stats.steps += 1
            stats.samples += len(labels) * self.world_size
            if (step + 1) % self.cfg.run.log_every_steps == 0 or step + 1 == steps:
                stats.loss_sum += self.log_health(step)
                self.show_progress(epoch, step + 1, steps, stats, time.perf_counter() - started - saving)
            if self.checkpoint_due_within_epoch(step + 1, steps):
                saving -= time.perf_counter()
                self.checkpoint_within_epoch(epoch, step + 1, steps)
                saving += time.perf_counter()
        stats.seconds = time.perf_counter() - started - saving  # training's: images_per_sec, TFLOP/s, MFU
        return stats

    def checkpoint_due_within_epoch(self, batches_done: int, batches: int) -> bool:
        """``run.checkpoint_every_steps`` optimizer steps since the last (the epoch's end has its own)."""
        every = self.cfg.run.checkpoint_every_steps
        return every is not None and batches_done < batches and batches_done % (
            every * self.cfg.optim.grad_accum_steps) == 0

    def checkpoint_within_epoch(self, epoch: int, batches_done: int, batches: int) -> None:
        """A checkpoint after ``batches_done`` batches of ``epoch``, reported to Ray Train without an epoch's
        metrics: its score is the worst there is (``unranked_score``), so Ray keeps it in a place of
        ``run.num_to_keep`` no scored checkpoint needs, or while it is the latest. Rank 0 says so among its
        progress lines, in their order (the controller would say it later)."""
        accum, score = self.cfg.optim.grad_accum_steps, self.cfg.run.checkpoint_score
        steps_done, steps = batches_done // accum, batches // accum
        self.report_with_checkpoint(
            {"epoch": epoch + 1, MID_EPOCH_KEY: steps_done, EPOCH_STEPS_KEY: steps, score: unranked_score(score)},
            epoch, steps_done=steps_done, initial_metrics=self.initial if epoch == 0 else None)
        if self.rank == 0 and self.plan.announce:
            say_progress(epoch + 1, f"epoch {epoch + 1}/{self.cfg.optim.epochs}  step {steps_done}/{steps}  "
                                    "checkpoint saved (within the epoch)")

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Forward, backward, optimizer step (at accumulation boundaries), EMA; the step's loss and
        gradient norm go to this rank's health window, and the step to the profiler where one runs."""
        images, targets = self.augment(images, labels)
        loss = self.loss(self.engine(images.to(self.input_dtype)), targets, images)
        self.engine.backward(loss)
        grad_norm = step_measuring_grad_norm(self.engine, self.deepspeed_grad_norm)
        # after an optimizer step only (was_step_applied: the boundary just passed, not the next micro step's)
        if self.ema is not None and self.engine.was_step_applied():
            self.ema.update(self.engine.module, step=self.engine.global_steps)
        self.health.add_step(loss.detach().float(), grad_norm)
        if self.profiler is not None:
            self.profiler.step()

    def log_health(self, step: int) -> float:
        """The window since the last logging step over all ranks (one collective, which also carries a
        NaN/inf loss from any rank to all of them, so every rank stops together); rank 0 logs it as MLflow
        step metrics at the optimizer's global step. Returns the global loss summed over the window."""
        report = self.health.gather(self.world_size)
        if not report.finite:
            raise LossDiverged(step)
        spiked = self.loss_spikes.observe(report)
        if self.step_metrics is not None:
            self.step_metrics.log({**report.metrics(), f"{HEALTH_PREFIX}lr": max(self.engine.get_lr()),
                                   f"{HEALTH_PREFIX}loss_spikes": self.loss_spikes.count}, self.engine.global_steps)
        if spiked:
            self.loss_spiked(report, step)
        return report.loss_sum

    def loss_spiked(self, report: HealthReport, step: int) -> None:
        """Says so (rank 0: on the console for `train`, in the log for a sweep's trial); the
        ``run.max_loss_spikes``-th spike stops the run as diverged."""
        spikes = self.loss_spikes
        if self.rank == 0:
            (say if self.plan.announce else print)(
                f"loss spike at step {self.engine.global_steps}: {report.loss_max:.4g}, over {spikes.factor:g}x "
                f"the running median {spikes.median:.4g} "
                f"({spikes.count}{'' if spikes.limit is None else f' of {spikes.limit}'})")
        if spikes.exhausted:
            raise LossDiverged(step, spikes.cause)

    def leave_memory_snapshot(self) -> None:
        """What held this rank's memory as it ran out (``pipeline.components.memory_snapshot``), as the run's
        ``oom/micro_batch_<N>/`` artifacts: rank 0's through its writer, another rank's through one of its own."""
        files = write_memory_snapshot(Path(tempfile.mkdtemp(prefix="vitsweep-oom-")), self.rank, self.device)
        artifact_path = f"{OOM_ARTIFACTS}/micro_batch_{self.cfg.optim.micro_batch_size}"
        if self.step_metrics is not None:
            self.step_metrics.log_files(files, artifact_path)  # written by its close(), as the run ends
            return
        log = StepMetricsLog(self.plan.tracking_uri, self.plan.mlflow_run_id)
        log.log_files(files, artifact_path)
        log.close()

    def end_profile(self) -> None:
        """A run that ended before its profile's last step says what the trace holds."""
        traced, asked = self.profiler.finish(), self.cfg.run.profile_steps
        if traced == asked:
            return
        (say if self.plan.announce else print)(
            f"profile: the trace holds {traced} of the {asked} steps asked; the run ended before the rest"
            if traced else f"profile: no trace; the run ended before step {FIRST_TRACED_STEP}, the first one traced")

    def show_progress(self, epoch: int, done: int, steps: int, stats: EpochStats, seconds: float) -> None:
        if self.rank != 0 or not self.plan.announce:
            return
        eta = seconds / max(stats.steps, 1) * (steps - done)  # stats.steps: this epoch's batches since (re)start
        say_progress(epoch + 1, f"epoch {epoch + 1}/{self.cfg.optim.epochs}  step {done}/{steps}  "
                                f"loss {stats.mean_loss:.4f}  {stats.samples / max(seconds, 1e-9):.0f} img/s  "
                                f"eta {duration(eta)}")

    def evaluate(self, with_ema: bool = True) -> dict[str, float]:
        metrics = validation_metrics(self.engine, self.val_loader, self.input_dtype, self.device)
        if self.ema is not None and with_ema:  # the fp32 shadow, run in the training precision
            with self.autocast:
                ema_metrics = validation_metrics(self.ema.module, self.val_loader, torch.float32, self.device)
            metrics.update({f"{key}_ema": value for key, value in ema_metrics.items()})
        return metrics

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """Report the epoch to Ray Train, with a checkpoint every ``run.checkpoint_every`` epochs and at the end."""
        if epoch == self.start_epoch and self.resumed is None:
            metrics["time_to_first_step_s"] = self.time_to_first_step
        elif epoch == self.start_epoch:  # a restart: MLflow shows where the run picked up its checkpoint
            metrics["resumed_at_epoch"] = epoch + 1
            if self.resumed.steps_done:  # within the epoch: its first step trained again, counted from 1
                metrics["resumed_at_step"] = self.resumed.steps_done + 1
        last = epoch == self.cfg.optim.epochs - 1
        if (epoch + 1) % self.cfg.run.checkpoint_every and not last:
            ray.train.report(metrics)
            return
        self.report_with_checkpoint(metrics, epoch, final=last)

    def report_with_checkpoint(self, metrics: dict[str, float], epoch: int, final: bool = False,
                               **within_epoch) -> None:
        """``metrics`` reported to Ray Train with this rank's checkpoint of ``epoch`` (``within_epoch``:
        ``save_checkpoint``'s steps_done and initial_metrics); ``final``: with the run's final weights too."""
        with tempfile.TemporaryDirectory(prefix="vitsweep-ckpt-") as directory:
            save_checkpoint(self.engine, Path(directory), epoch=epoch, identity=self.identity, rank=self.rank,
                            ema=self.ema, card=self.plan.model_card, **within_epoch)
            if final:
                save_final_weights(self.engine, Path(directory), self.rank, ema=self.ema)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

