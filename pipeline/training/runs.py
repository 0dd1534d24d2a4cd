"""From a config to a training run: check its inputs, open its MLflow run, build its trainer, fit and record.

One path for ``vitsweep train`` (``pipeline.training.driver``) and for every sweep trial
(``pipeline.sweeps.trial``):

1. ``check_run``: everything that can be wrong with the input, before any worker starts (exit 2,
   nothing written): the datasets, the model (built once on the meta device, which also gives its
   facts), the distillation teacher, the MLflow store, a restarted run's checkpoint, the weights it
   starts from (``model.init_from``: resolved and fitted to the model, ``pipeline.trained.transfer``).
2. ``open_mlflow_run``: the run's MLflow run, new or continued, with its params, tags and setup artifacts
   (and where its initial weights came from: tags, ``init_weights.json``, the source model as an input).
3. ``build_trainer``: the Ray Train ``TorchTrainer`` running ``pipeline.training.worker`` on every rank.
4. ``fit_and_record``: fit; the MLflow run ends FINISHED (with the final model), FAILED or KILLED.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import yaml
from mlflow.exceptions import MlflowException
from ray.train import CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig, WorkerGroupError
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError
from safetensors.torch import load_model

import models
from models.measure import count_gmacs, count_params, params_by_module
from pipeline import interrupts, uris
from pipeline.components.checkpointing import (EMA_WEIGHTS_FILE, WEIGHTS_FILE, check_run_checkpoints, check_same_model,
    checkpoint_score_order, checkpoints_newest_first, model_identity, read_meta)
from pipeline.config.schema import ExperimentConfig, ModelConfig
from pipeline.data.loaders import check_decoding_threads, train_steps_per_epoch
from pipeline.data.verification import verify_dataset
from pipeline.data.prepare import prepare_offline_data
from pipeline.components.distillation import build_teacher
from pipeline.console import active_console, counted
from pipeline.components.engine import deepspeed_config
from pipeline.errors import AlreadyFinished, Interrupted, InvalidInputError, RunFailed, error_line
from pipeline.training.jobs import git_provenance
from pipeline.trained.serving import log_model
from pipeline.components.lr_scaling import describe_lr, effective_lr, recorded_params
from pipeline.components.model_card import ModelCard
from pipeline.components.modeling import build_model, checked_model, checked_training_sizes
from pipeline.training.cost import ACCELERATOR_HOURS, UNIT_TAG, RunCost, cost_unit
from pipeline.training.epoch_logger import MLflowEpochLogger
from pipeline.training.nccl_hangs import detect_nccl_hangs
from pipeline.tracking.store import MlflowRun, MlflowStore, command_line, read_run_record, run_origin, update_run_record
from pipeline.tracking.connection import (check_logger_can_reach, is_new_local_store, require_reachable,
                                          resolve_tracking_uri)
from pipeline.trained.transfer import PLAN_ARTIFACT, InitialWeights, resolve_initial_weights
from pipeline.trained.teacher import TeacherWeights, resolve_teacher
from pipeline.training.worker import WorkerPlan, train_worker


class TrainingDiverged(RunFailed):
    """The loss became NaN/inf; the run stopped and is recorded FAILED."""


@dataclass(frozen=True)
class ResolvedData:
    train: str
    val: str
    num_classes: int
    train_sha256: str = ""  # from the sidecars: MLflow's dataset digests
    val_sha256: str = ""
    classes: tuple[str, ...] = ()  # the training set's class names, label order (its sidecar's)
    train_samples: int | None = None  # the training set's images (its sidecar's)


@dataclass(frozen=True)
class ModelFacts:
    """What a run's model is, measured once on the meta device (no memory, no compute)."""

    name: str
    params: int
    gflops: float
    family: str
    paper: str
    summary: str  # per-module parameter breakdown and the module tree (model_summary.txt)
    # data.progressive: the forward multiply-adds per image at each of its crop sizes (TFLOP/s and MFU)
    gmacs_by_size: dict[int, float] = field(default_factory=dict)

    @classmethod
    def measure(cls, cfg: ModelConfig, num_classes: int, sizes: Sequence[int] = ()) -> ModelFacts:
        """Raises ConfigError when the model cannot be built or run with these overrides; ``sizes``: the
        training crop sizes to count multiply-adds at besides ``cfg.img_size`` (``checked_training_sizes``)."""
        model = checked_model(cfg, num_classes)
        params = count_params(model)
        lines = [f"{cfg.name} {cfg.args} img_size={cfg.img_size} num_classes={num_classes}",
                 f"total parameters: {params:,}", ""]
        lines += [f"{name:<40}{count:>12,}" for name, count in params_by_module(model, depth=2)]
        variant = models.VARIANTS.get(cfg.name)
        return cls(
            name=cfg.name, params=params, gflops=round(count_gmacs(model, cfg.img_size), 4),
            family=variant.family if variant else "timm", paper=variant.paper if variant else "",
            summary="\n".join(lines) + "\n\n" + repr(model) + "\n",
            gmacs_by_size={size: count_gmacs(model, size) for size in set(sizes)},
        )

    def as_params(self) -> dict[str, Any]:
        """The ``model_facts.*`` MLflow params."""
        return {"name": self.name, "params": self.params, "gflops": self.gflops, "family": self.family,
                "paper": self.paper}


@dataclass(frozen=True)
class CheckedRun:
    """A run whose input passed every check: what launching it needs."""

    cfg: ExperimentConfig  # with absolute paths
    data: ResolvedData
    facts: ModelFacts
    run_name: str
    storage: str  # where Ray Train keeps the run: a local directory or a URI
    tracking_uri: str
    init: InitialWeights | None = None  # model.init_from, resolved and fitted to the model
    teacher: TeacherWeights | None = None  # distill.teacher_from, resolved and checked

    @property
    def run_dir(self) -> Path:
        return Path(self.storage) / self.run_name

    @property
    def card(self) -> ModelCard:
        """What the trained model will be: recorded in its checkpoints and with its MLflow model."""
        return ModelCard.of_run(self.cfg, self.data.num_classes, self.data.classes)


@dataclass(frozen=True)
class TrainingOutcome:
    run_name: str
    run_dir: Path
    tracking_uri: str
    experiment_id: str
    mlflow_run_id: str
    metrics: dict[str, Any]
    model_id: str | None  # its logged model's (models:/<model_id>)


def resolve_data(cfg: ExperimentConfig) -> ResolvedData:
    """Write the offline dataset if asked, then check both splits before any worker starts."""
    prepare_offline_data(cfg)
    sidecars = {}
    for split in ("train", "val"):
        # every byte, before any worker reads one
        sidecars[split] = verify_dataset(getattr(cfg.data, split), streams=cfg.data.stage_streams,
                                         storage_path=cfg.run.storage_path)
    if sidecars["train"].num_classes != sidecars["val"].num_classes:
        raise InvalidInputError(
            f"data.train has {sidecars['train'].num_classes} classes but data.val has "
            f"{sidecars['val'].num_classes}; they must come from the same dataset"
        )
    named = [(label, train, val) for label, (train, val) in enumerate(zip(sidecars["train"].classes,
                                                                          sidecars["val"].classes)) if train != val]
    if named:  # `data write --classes` labels in the order given: the same classes in another order swap labels
        label, train, val = named[0]
        raise InvalidInputError(
            f"label {label} is class {train!r} in data.train but {val!r} in data.val ({len(named)} label(s) differ); "
            "write both splits with the same classes in the same order")
    return ResolvedData(cfg.data.train, cfg.data.val, sidecars["train"].num_classes, sidecars["train"].sha256,
                        sidecars["val"].sha256, tuple(sidecars["train"].classes), sidecars["train"].num_samples)


def check_steps_per_epoch(cfg: ExperimentConfig, data: ResolvedData) -> None:
    """Each worker's share of the training set must make an optimizer step: its loader would have none to
    train (checked once the workers are known to fit, so a machine too small for them says that first)."""
    optim, workers, images = cfg.optim, cfg.scaling.num_workers, data.train_samples
    if images is not None and train_steps_per_epoch(images, cfg.data, optim.micro_batch_size,
                                                    optim.grad_accum_steps, workers) < 1:
        raise InvalidInputError(
            f"data.train's {images} images make no optimizer step on each of {workers} worker(s): a step takes "
            f"{optim.micro_batch_size} x {optim.grad_accum_steps} (optim.micro_batch_size x grad_accum_steps) of its "
            "share; lower them, use fewer workers, or write more images")


CHECKPOINT_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of the checkpoints it registered


def unregistered_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories Ray Train never registered (a driver or disk that died mid-report):
    a resume would never pick them, and they would outlive ``run.num_to_keep``."""
    found = sorted(path for path in run_dir.glob("checkpoint_*") if path.is_dir())  # not Ray's snapshot file
    if not found or not (run_dir / CHECKPOINT_SNAPSHOT).exists():
        return found
    result = Result.from_path(str(run_dir))
    registered = {Path(checkpoint.path).resolve() for checkpoint, _ in result.best_checkpoints or []}
    if result.checkpoint is not None:
        registered.add(Path(result.checkpoint.path).resolve())
    return [path for path in found if path.resolve() not in registered]


def remove_unregistered_checkpoints(run: CheckedRun) -> None:
    if uris.is_uri(run.storage) or not run.run_dir.is_dir():
        return
    for path in unregistered_checkpoints(run.run_dir):
        shutil.rmtree(path, ignore_errors=True)


def check_resumable(run_dir: Path, cfg: ExperimentConfig, num_classes: int) -> None:
    """A run restarted under the same name resumes its newest intact checkpoint (a corrupt one is
    named and skipped; none intact is bad input): it must be this model's. One stopped before its
    first checkpoint starts again from epoch 1, which is said."""
    # a directory Ray never registered (a kill mid-report; all of them without Ray's snapshot) is never
    # resumed from: the run removes it
    unregistered = unregistered_checkpoints(run_dir)
    intact = check_run_checkpoints(run_dir, unregistered)
    if intact is None:
        if read_run_record(run_dir) is not None:  # it was started: its MLflow run continues
            active_console().line(f"run {cfg.run.name} was started before, but no checkpoint was saved: "
                                  "starting from epoch 1")
        return
    newest = checkpoints_newest_first(run_dir, unregistered)[0]
    if intact != newest:
        active_console().line(f"warning: checkpoint {newest} is corrupt (see the log); resuming from {intact.name}")
    check_same_model(read_meta(intact), model_identity(cfg.model, num_classes), str(intact))


def check_rerun(run_dir: Path, cfg: ExperimentConfig, tracking_uri: str) -> None:
    """A run name stands for one config: a second run under it with another config is refused naming
    the keys, and a finished run is not trained again (``AlreadyFinished``)."""
    record = read_run_record(run_dir)
    if record is None or record["tracking_uri"] != tracking_uri:
        return
    try:
        earlier = MlflowStore(tracking_uri).client.get_run(record["run_id"])
    except MlflowException:  # deleted from the store: nothing to contradict
        return
    logged = earlier.data.params
    changed = [f"{key}: {logged[key]} -> {value}" for key, value in cfg.flat().items()
               if key in logged and logged[key] != str(value)]
    finished = earlier.info.status == "FINISHED"
    if changed:
        raise InvalidInputError(
            f"run {cfg.run.name!r} ({run_dir}) was {'trained' if finished else 'started'} with another config: "
            f"{'; '.join(changed)}. Give this one a new run.name (or none: a unique name is chosen)"
            + ("" if finished else ", or resume it with its own config")
        )
    if finished:
        final = {key: earlier.data.metrics[key] for key in ("val_top1", "val_top5") if key in earlier.data.metrics}
        raise AlreadyFinished(
            f"run {cfg.run.name!r} already finished with this config ({', '.join(f'{k} {v:.2f}%' for k, v in final.items())}"
            f"): {run_dir}, MLflow run {earlier.info.run_id} in {tracking_uri}; nothing to train. Give run.name "
            "another value (or none) to train again"
        )


def check_run(cfg: ExperimentConfig, address: str | None = None) -> CheckedRun:
    """Everything that can be checked before Ray starts (InvalidInputError / ConfigError).

    Writes nothing but a dataset the config asks to prepare; an MLflow store that exists is opened
    (one that cannot be is bad input), a new local one is created later (``create_store``).
    """
    cfg = cfg.with_absolute_paths()
    data = resolve_data(cfg)
    # data.progressive: the model must run at every crop size, not only model.img_size
    sizes = (checked_training_sizes(cfg.model, cfg.data.progressive, cfg.optim.epochs)
             if cfg.data.progressive is not None else [cfg.model.img_size])
    facts = ModelFacts.measure(cfg.model, data.num_classes, sizes if cfg.data.progressive is not None else ())
    if cfg.distill.teacher is not None:
        build_teacher(cfg.distill, data.num_classes)  # its checkpoint must fit before any worker loads it
    storage = cfg.run.storage_path
    run_name = cfg.run.name or f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_name})})
    tracking_uri = resolve_tracking_uri(cfg)
    check_logger_can_reach(tracking_uri, address)
    require_reachable(tracking_uri)
    check_rerun(Path(storage) / run_name, cfg, tracking_uri)
    check_resumable(Path(storage) / run_name, cfg, data.num_classes)
    init = (resolve_initial_weights(cfg.model, data.num_classes, uris.join(storage, run_name), storage, tracking_uri)
            if cfg.model.init_from else None)
    teacher = (resolve_teacher(cfg.distill, data.num_classes, cfg.model.img_size, sizes, uris.join(storage, run_name),
                               storage, tracking_uri)
               if cfg.distill.teacher_from else None)
    if not is_new_local_store(tracking_uri):
        MlflowStore(tracking_uri).find_experiment(cfg.tracking.experiment)
    return CheckedRun(cfg, data, facts, run_name, storage, tracking_uri, init, teacher)


def create_store(run: CheckedRun) -> None:
    """A new local MLflow store's schema created (~4 s of migrations; nothing for a store that exists),
    while Ray starts, so that opening the run later is quick."""
    MlflowStore(run.tracking_uri).find_experiment(run.cfg.tracking.experiment)


def check_resources(cfg: ExperimentConfig, local: bool, have: dict[str, float]) -> None:
    """The workers must fit the Ray cluster, which has ``have``: a local Ray that is too small is bad
    input (checked before it starts, ``local_ray_resources``); a cluster may grow (autoscaler), so the
    wait for it is announced and bounded by Ray Train's start timeout."""
    if local:  # its workers' loaders decode on this machine's threads
        check_decoding_threads(cfg.data.num_workers)
    scaling = cfg.scaling
    need = {"CPU": scaling.num_workers * scaling.cpus_per_worker,
            "GPU": scaling.num_workers * scaling.gpus_per_worker if scaling.use_gpu else 0.0}
    short = {kind: (amount, have.get(kind, 0.0)) for kind, amount in need.items() if amount > have.get(kind, 0.0)}
    if not short:
        return
    wanted = ", ".join(f"{amount:g} {kind}s (the cluster has {available:g})" for kind, (amount, available) in short.items())
    if local:
        raise InvalidInputError(
            f"scaling.num_workers={scaling.num_workers} workers need {wanted} on this machine's local Ray; lower "
            "scaling.num_workers or scaling.cpus_per_worker / gpus_per_worker, or join a cluster with --address"
        )
    timeout = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    active_console().line(f"waiting for the cluster to grow: the workers need {wanted}; Ray Train gives up after "
                          f"{timeout} s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S)")


def environment_tags(cfg: ExperimentConfig) -> dict[str, str]:
    return {
        "torch_version": version("torch"),
        "deepspeed_version": version("deepspeed"),
        "ray_version": version("ray"),
        "python_version": platform.python_version(),
        "accelerator": "cuda" if cfg.scaling.use_gpu else "cpu",
        UNIT_TAG: cost_unit(cfg),
        "world_size": str(cfg.scaling.num_workers),
        **git_provenance(),
    }


def describe_run(run: CheckedRun) -> str:
    """The run's MLflow description: what was trained, on what, how."""
    cfg, facts = run.cfg, run.facts
    paper = f", paper {facts.paper}" if facts.paper else ""
    workers = counted(cfg.scaling.num_workers, f"{'GPU' if cfg.scaling.use_gpu else 'CPU'} worker")
    start = f" Starts from `{run.init.plan.summary()}`." if run.init is not None else ""
    args = "".join(f", {key}={value}" for key, value in cfg.model.args.items())
    return (f"**{cfg.model.name}** ({facts.family}{paper}{args}): "
            f"{facts.params / 1e6:.2f} M parameters, {facts.gflops:.3g} GMACs at {cfg.model.img_size} px.{start} "
            f"{counted(cfg.optim.epochs, 'epoch')} on `{Path(run.data.train).name}` ({run.data.num_classes} classes), "
            f"validated on `{Path(run.data.val).name}`; {workers}, DeepSpeed ZeRO-{cfg.deepspeed.zero_stage} "
            f"{cfg.deepspeed.precision}; AdamW, {describe_lr(cfg.optim, cfg.scaling.num_workers)}.")


def open_mlflow_run(run: CheckedRun, mlflow_run: MlflowRun | None = None, source: str | None = None) -> MlflowRun:
    """The run's MLflow run with its setup logged: ``mlflow_run`` (a sweep trial's, already keyed by
    its trial id), else the one recorded in the run directory (a restart), else a new one."""
    cfg = run.cfg
    mlflow_run = mlflow_run or MlflowRun.open_or_continue(run.tracking_uri, cfg.tracking.experiment, run.run_dir,
                                                          run.run_name)
    mlflow_run.log_setup(
        cfg,
        files={
            "config.yaml": cfg.to_yaml(),
            "deepspeed.json": yaml.safe_dump(deepspeed_config(cfg, cfg.scaling.num_workers)),
            "model_summary.txt": run.facts.summary,
        },
        facts=run.facts.as_params(),
        tags={**environment_tags(cfg), **run_origin(describe_run(run), source or command_line())},
    )
    # The rate and global batch it trains at, beside the knob the config gives (optim.lr or optim.lr_per_512).
    mlflow_run.log_params(recorded_params(cfg.optim, cfg.scaling.num_workers))
    if not mlflow_run.get().inputs.dataset_inputs and run.data.train_sha256:
        mlflow_run.log_datasets({"training": (run.data.train, run.data.train_sha256),
                                 "validation": (run.data.val, run.data.val_sha256)})
    if run.init is not None:
        record_initial_weights(mlflow_run, run.init)
    return mlflow_run


def record_initial_weights(mlflow_run: MlflowRun, init: InitialWeights) -> None:
    """Where the run's weights came from, on its MLflow run: ``init.*`` tags (the source as given,
    its kind, run, logged and registered model; what was loaded, reset, resampled), every weight's
    fate in ``init_weights.json``, and the source's logged model as an input of the run (MLflow 3's
    lineage: the run page links to the model, the model to the run that trained it) where both are
    in one store."""
    plan, provenance = init.plan, init.plan.provenance
    registered = (f"{provenance.registered_name}/{provenance.registered_version}"
                  + (f"@{provenance.registered_alias}" if provenance.registered_alias else "")
                  if provenance.registered_name else None)
    tags = {"init.source": provenance.given, "init.kind": provenance.kind, "init.ema": str(provenance.ema),
            "init.run_id": provenance.run_id, "init.model_id": provenance.model_id, "init.registered_model": registered,
            "init.summary": _shortened(plan.summary()), "init.loaded": str(len(plan.loaded)),
            "init.reset": _shortened(", ".join(plan.reset)), "init.resampled": _shortened(", ".join(plan.resampled)),
            "init.excluded": _shortened(", ".join(plan.excluded))}
    mlflow_run.set_tags({key: value for key, value in tags.items() if value})
    mlflow_run.log_texts({PLAN_ARTIFACT: json.dumps(plan.as_dict(), indent=1)})
    if provenance.model_id and provenance.tracking_uri == mlflow_run.uri:
        mlflow_run.log_model_input(provenance.model_id)


def _shortened(text: str, limit: int = 1000) -> str:
    """A tag's value within MLflow's limits; the whole list is in init_weights.json."""
    return text if len(text) <= limit else text[:limit - 40].rsplit(", ", 1)[0] + f", ... (see {PLAN_ARTIFACT})"


def build_trainer(run: CheckedRun, mlflow_run: MlflowRun, launched_at: float, cost: RunCost, callbacks: tuple = (),
                  announce: bool = True) -> TorchTrainer:
    """The Ray Train TorchTrainer of one run; ``cost``: this attempt's spend, logged with each epoch;
    ``callbacks`` adds e.g. Tune's report callback; ``announce``: epoch and progress lines on the console
    (a sweep shows its own table instead)."""
    cfg = run.cfg
    if cfg.scaling.use_gpu:
        detect_nccl_hangs()
    score = cfg.run.checkpoint_score
    plan = WorkerPlan(cfg.model_dump(mode="json"), run.data.num_classes, launched_at, mlflow_run.uri, mlflow_run.run_id,
                      run.facts.gflops, lr=effective_lr(cfg.optim, cfg.scaling.num_workers), announce=announce,
                      model_card=run.card.as_dict(), init_weights=run.init.for_workers() if run.init is not None else None,
                      teacher_source=run.teacher.location if run.teacher is not None else None,
                      gmacs_by_size=run.facts.gmacs_by_size)
    return TorchTrainer(
        train_worker,
        train_loop_config=plan.as_dict(),
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker,
                                  **({"GPU": cfg.scaling.gpus_per_worker} if cfg.scaling.use_gpu else {})},
            placement_strategy=cfg.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=run.run_name,
            storage_path=run.storage,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.run.num_to_keep,
                checkpoint_score_attribute=score,
                checkpoint_score_order=checkpoint_score_order(score),
            ),
            callbacks=[MLflowEpochLogger(mlflow_run, cfg.optim.epochs, cost, announce), *callbacks],
            worker_runtime_env={"env_vars": {} if cfg.scaling.use_gpu else {"DS_ACCELERATOR": "cpu"}},
        ),
    )


def begin_attempt(run: CheckedRun, mlflow_run: MlflowRun) -> RunCost:
    """This attempt's spend from now, on top of what the run's earlier attempts recorded."""
    return RunCost.begin(run.cfg, mlflow_run.get().data.metrics)


def fit_counting_cost(trainer: TorchTrainer, mlflow_run: MlflowRun, cost: RunCost) -> Result:
    """``trainer.fit()``; however it ends, the attempt's spend is logged at its last epoch's step, so
    the run's latest ``cost/*`` values are its whole spend."""
    try:
        if threading.current_thread() is threading.main_thread():
            return fit_interruptibly(trainer)
        return trainer.fit()  # a sweep trial: Tune owns the signals
    finally:
        try:
            history = mlflow_run.metric_history(ACCELERATOR_HOURS)
            mlflow_run.log_metrics(cost.so_far(), step=max((m.step for m in history), default=0))
        except Exception as err:  # noqa: BLE001  (a store that cannot be written: the run's own error matters more)
            print(f"vitsweep: could not record the spend of MLflow run {mlflow_run.run_id}: {error_line(err)}",
                  file=sys.stderr, flush=True)


def fit_interruptibly(trainer: TorchTrainer) -> Result:
    """``trainer.fit()`` on a thread, while the main thread turns SIGINT and SIGTERM into ``Interrupted``.

    Ray Train's own SIGINT handler (installed when fit runs in the main thread) would abort the run
    into an anonymous actor error; here either signal ends the run KILLED.
    """
    with interrupts.raised():
        return interrupts.OnThread(trainer.fit, "vitsweep-fit").result()


def failure_reason(err: BaseException) -> str:
    """Why a run failed, in one line. A worker that was lost (killed, crashed, its node gone, hung) is
    named with its rank, process and node, and how it ended: the surviving ranks' errors (gloo's or
    NCCL's broken connection) are what its loss caused, not why the run failed. Otherwise the first
    failed rank's last error line."""
    failures = err.worker_failures if isinstance(err, WorkerGroupError) else {}
    lost = {rank: failure for rank, failure in failures.items()
            if isinstance(failure, (WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError))}
    if not lost:
        return error_line(err)
    rank, failure = min(lost.items())
    return lost_worker(rank, failure)[:300]


def lost_worker(rank: int, failure: Exception) -> str:
    """'worker rank R (pid P on NODE) died: how', from Ray Train's health-check failure and the actor
    error it wraps (Ray hands both over as text only)."""
    text = str(failure)
    pid, node = re.search(r"\bpid=(\d+)", text), re.search(r"\bnode_ip='([^']+)'", text)
    where = f" (pid {pid[1]} on {node[1]})" if pid and node else ""
    if isinstance(failure, WorkerHealthCheckTimeoutError):
        return f"worker rank {rank}{where} stopped answering Ray Train's health checks"
    death = re.search(r"The actor is dead because ([^.\n]*)", text)
    exit_type = re.search(r"Worker exit type: (\S+)", text)
    detail = re.search(r"Worker exit detail: ([^.\n]*)", text)
    how = death[1] if death else error_line(failure.health_check_failure)
    if exit_type:
        how += f" ({exit_type[1]}{': ' + detail[1] if detail else ''})"
    return f"worker rank {rank}{where} died: {how}"


def end_run(mlflow_run: MlflowRun, status: str, reason: str) -> None:
    """The run's final status with its one-line reason (tag ``stop_reason``); a store that cannot be
    written any more (a full disk) is reported, not raised over the run's own error."""
    try:
        mlflow_run.end(status, reason)
    except Exception as err:  # noqa: BLE001
        print(f"vitsweep: could not record {status} ({reason}) in MLflow run {mlflow_run.run_id}: {error_line(err)}",
              file=sys.stderr, flush=True)


def record_interrupt(mlflow_run: MlflowRun, stop: Interrupted) -> None:
    """The MLflow run ends KILLED with the signal as its reason, and the interrupt says so."""
    end_run(mlflow_run, "KILLED", f"interrupted: {stop.signal_name}")
    stop.outcome = (f"MLflow run {mlflow_run.run_id} is marked KILLED; run the same command again to continue "
                    "from its last checkpoint")


def fit_and_record(trainer: TorchTrainer, run: CheckedRun, mlflow_run: MlflowRun, cost: RunCost,
                   record_failure: bool = True) -> Result:
    """Run the trainer (``build_trainer``'s, with the same ``cost``); the MLflow run ends FINISHED (with
    the final model), FAILED or KILLED, with its reason and its spend.

    ``record_failure=False`` leaves a run whose ``fit()`` raised RUNNING for the caller to record:
    a sweep trial may have been stopped on purpose by its scheduler, which only the sweep knows.
    """
    remove_unregistered_checkpoints(run)
    try:
        result = fit_counting_cost(trainer, mlflow_run, cost)
    except Interrupted as stop:
        record_interrupt(mlflow_run, stop)
        raise
    except KeyboardInterrupt:
        end_run(mlflow_run, "KILLED", "interrupted")
        raise
    except BaseException as err:
        if not record_failure:
            raise
        remove_unregistered_checkpoints(run)  # also frees the space a full disk needs to record the failure
        active_console().library("".join(traceback.format_exception(err)))
        reason = f"error: {failure_reason(err)}"
        end_run(mlflow_run, "FAILED", reason)
        raise RunFailed(f"{reason}; MLflow run {mlflow_run.run_id} marked FAILED") from err
    remove_unregistered_checkpoints(run)  # a worker group restarted mid-report left its half-reported one
    divergence = mlflow_run.diverged_at()
    if divergence:
        end_run(mlflow_run, "FAILED", f"diverged: loss diverged at {divergence}")
        raise TrainingDiverged(f"loss diverged at {divergence}; MLflow run {mlflow_run.run_id} marked FAILED")
    log_final_model(run, result, mlflow_run)
    end_run(mlflow_run, "FINISHED", "completed")
    return result


def log_final_model(run: CheckedRun, result: Result, mlflow_run: MlflowRun) -> None:
    """The final checkpoint's weights as the run's MLflow model; its id joins the run directory's
    record, so the run's name or directory leads to it (``pipeline.trained.model_source``)."""
    with result.checkpoint.as_directory() as directory:
        final, ema = Path(directory) / WEIGHTS_FILE, Path(directory) / EMA_WEIGHTS_FILE
        weights = [final, ema] if ema.exists() else [final]
        model = build_model(run.cfg.model, run.data.num_classes)
        load_model(model, str(final))
        last_epoch = int(result.metrics.get("epoch", run.cfg.optim.epochs))
        model_id = log_model(mlflow_run, model, weights, run.card, step=last_epoch)
    if not uris.is_uri(run.storage):
        update_run_record(run.run_dir, tracking_uri=mlflow_run.uri, run_id=mlflow_run.run_id,
                          experiment_id=mlflow_run.get().info.experiment_id, model_id=model_id)


def launch(run: CheckedRun, mlflow_run: MlflowRun, launched_at: float) -> TrainingOutcome:
    """Train a checked run whose MLflow run is open: build the trainer, fit, record."""
    cost = begin_attempt(run, mlflow_run)
    result = fit_and_record(build_trainer(run, mlflow_run, launched_at, cost), run, mlflow_run, cost)
    return TrainingOutcome(run.run_name, run.run_dir, run.tracking_uri, mlflow_run.get().info.experiment_id,
                           mlflow_run.run_id, dict(result.metrics), mlflow_run.model_id())
