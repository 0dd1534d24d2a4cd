"""From a config to a training run: check its inputs, open its MLflow run, build its trainer, fit and record.

One path for ``vitsweep train`` (``pipeline.driver``) and for every sweep trial
(``pipeline.sweeps.trial``):

1. ``check_run``: everything that can be wrong with the input, before any worker starts (exit 2,
   nothing written): the datasets, the model (built once on the meta device, which also gives its
   facts), the distillation teacher, the MLflow store, a restarted run's checkpoint.
2. ``open_tracking``: the run's MLflow run, new or continued, with its params, tags and setup artifacts.
3. ``build_trainer``: the Ray Train ``TorchTrainer`` running ``pipeline.worker`` on every rank.
4. ``fit_and_record``: fit; the MLflow run ends FINISHED (with the final model), FAILED or KILLED.
"""
from __future__ import annotations

import platform
import subprocess
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from ray.train import CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from safetensors.torch import load_model

import models
from models.measure import count_gmacs, count_params, params_by_module
from pipeline import uris
from pipeline.checkpointing import EMA_WEIGHTS_FILE, WEIGHTS_FILE, check_same_model, model_identity, read_meta
from pipeline.config import ExperimentConfig, ModelConfig
from pipeline.data.integrity import check_beton
from pipeline.data.prepare import prepare_offline_data
from pipeline.data.staging import read_location_sidecar
from pipeline.distillation import build_teacher
from pipeline.engine import deepspeed_config
from pipeline.errors import InvalidInputError
from pipeline.modeling import build_model
from pipeline.tracking import MLflowEpochLogger, MlflowRun, check_logger_can_reach, require_reachable, resolve_tracking_uri
from pipeline.worker import WorkerPlan, train_worker


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the run stopped and is recorded FAILED."""


@dataclass(frozen=True)
class ResolvedData:
    train: str
    val: str
    num_classes: int


@dataclass(frozen=True)
class ModelFacts:
    """What a run's model is, measured once on the meta device (no memory, no compute)."""

    name: str
    params: int
    gflops: float
    family: str
    paper: str
    summary: str  # per-module parameter breakdown and the module tree (model_summary.txt)

    @classmethod
    def measure(cls, cfg: ModelConfig, num_classes: int) -> ModelFacts:
        """Raises ConfigError when the model cannot be built with these overrides."""
        model = build_model(cfg, num_classes, device="meta")
        params = count_params(model)
        lines = [f"{cfg.name} {cfg.args} img_size={cfg.img_size} num_classes={num_classes}",
                 f"total parameters: {params:,}", ""]
        lines += [f"{name:<40}{count:>12,}" for name, count in params_by_module(model, depth=2)]
        variant = models.VARIANTS.get(cfg.name)
        return cls(
            name=cfg.name, params=params, gflops=round(count_gmacs(model, cfg.img_size), 4),
            family=variant.family if variant else "timm", paper=variant.paper if variant else "",
            summary="\n".join(lines) + "\n\n" + repr(model) + "\n",
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

    @property
    def run_dir(self) -> Path:
        return Path(self.storage) / self.run_name


@dataclass(frozen=True)
class TrainingOutcome:
    run_name: str
    run_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    metrics: dict[str, Any]


def resolve_data(cfg: ExperimentConfig) -> ResolvedData:
    """Write the offline dataset if asked, then check both splits before any worker starts."""
    prepare_offline_data(cfg)
    sidecars = {}
    for split in ("train", "val"):
        location = getattr(cfg.data, split)
        sidecars[split] = read_location_sidecar(location) if uris.is_uri(location) else check_beton(location)
    if sidecars["train"].num_classes != sidecars["val"].num_classes:
        raise InvalidInputError(
            f"data.train has {sidecars['train'].num_classes} classes but data.val has "
            f"{sidecars['val'].num_classes}; they must come from the same dataset"
        )
    return ResolvedData(cfg.data.train, cfg.data.val, sidecars["train"].num_classes)


def check_resumable(run_dir: Path, cfg: ExperimentConfig, num_classes: int) -> None:
    """A run restarted under the same name resumes its latest checkpoint: it must be this model's."""
    if not (run_dir / "checkpoint_manager_snapshot.json").exists():
        return
    checkpoint = Result.from_path(str(run_dir)).checkpoint
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            check_same_model(read_meta(directory), model_identity(cfg.model, num_classes), directory)


def check_run(cfg: ExperimentConfig, address: str | None = None) -> CheckedRun:
    """Everything that can be checked before any worker starts (InvalidInputError / ConfigError)."""
    cfg = cfg.with_absolute_paths()
    data = resolve_data(cfg)
    facts = ModelFacts.measure(cfg.model, data.num_classes)
    if cfg.distill.teacher is not None:
        build_teacher(cfg.distill, data.num_classes)  # its checkpoint must fit before any worker loads it
    storage = cfg.run.storage_path
    run_name = cfg.run.name or f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracking_uri = resolve_tracking_uri(cfg)
    check_logger_can_reach(tracking_uri, address)
    require_reachable(tracking_uri)
    check_resumable(Path(storage) / run_name, cfg, data.num_classes)
    return CheckedRun(cfg, data, facts, run_name, storage, tracking_uri)


def environment_tags(cfg: ExperimentConfig) -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {
        "torch_version": version("torch"),
        "deepspeed_version": version("deepspeed"),
        "ray_version": version("ray"),
        "python_version": platform.python_version(),
        "accelerator": "cuda" if cfg.scaling.use_gpu else "cpu",
        "world_size": str(cfg.scaling.num_workers),
        "mlflow.source.git.commit": commit or "unknown",
        "git_commit": commit or "unknown",
    }


def open_tracking(run: CheckedRun, tracking: MlflowRun | None = None) -> MlflowRun:
    """The run's MLflow run with its setup logged: ``tracking`` (a sweep trial's, already keyed by
    its trial id), else the one recorded in the run directory (a restart), else a new one."""
    cfg = run.cfg
    tracking = tracking or MlflowRun.open_or_continue(run.tracking_uri, cfg.tracking.experiment, run.run_dir,
                                                      run.run_name)
    tracking.log_setup(
        cfg,
        files={
            "config.yaml": cfg.to_yaml(),
            "deepspeed.json": yaml.safe_dump(deepspeed_config(cfg, cfg.scaling.num_workers)),
            "model_summary.txt": run.facts.summary,
        },
        facts=run.facts.as_params(),
        tags=environment_tags(cfg),
    )
    return tracking


def build_trainer(run: CheckedRun, tracking: MlflowRun, launched_at: float, callbacks: tuple = ()) -> TorchTrainer:
    """The Ray Train TorchTrainer of one run; ``callbacks`` adds e.g. Tune's report callback."""
    cfg = run.cfg
    score = cfg.run.checkpoint_score
    return TorchTrainer(
        train_worker,
        train_loop_config=WorkerPlan(cfg.model_dump(mode="json"), run.data.num_classes, launched_at).as_dict(),
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
                checkpoint_score_order="min" if score.endswith("loss") else "max",
            ),
            callbacks=[MLflowEpochLogger(tracking, cfg.optim.epochs), *callbacks],
            worker_runtime_env={"env_vars": {} if cfg.scaling.use_gpu else {"DS_ACCELERATOR": "cpu"}},
        ),
    )


def fit_and_record(trainer: TorchTrainer, run: CheckedRun, tracking: MlflowRun, record_failure: bool = True) -> Result:
    """Run the trainer; the MLflow run ends FINISHED (with the final model), FAILED or KILLED.

    ``record_failure=False`` leaves a run whose ``fit()`` raised RUNNING for the caller to record:
    a sweep trial may have been stopped on purpose by its scheduler, which only the sweep knows.
    """
    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        tracking.finish("KILLED")
        raise
    except BaseException:
        if record_failure:
            tracking.finish("FAILED")
        raise
    divergence = tracking.diverged_at()
    if divergence:
        tracking.finish("FAILED")
        raise TrainingDiverged(f"loss diverged at {divergence}; MLflow run {tracking.run_id} marked FAILED")
    log_final_model(run, result.checkpoint, tracking)
    tracking.finish("FINISHED")
    return result


def log_final_model(run: CheckedRun, checkpoint, tracking: MlflowRun) -> None:
    with checkpoint.as_directory() as directory:
        model = build_model(run.cfg.model, run.data.num_classes)
        load_model(model, str(Path(directory) / WEIGHTS_FILE))
        tracking.log_model(model, Path(directory) / WEIGHTS_FILE, run.cfg.model.img_size)
        if (Path(directory) / EMA_WEIGHTS_FILE).exists():
            tracking.log_artifact(Path(directory) / EMA_WEIGHTS_FILE)


def launch(run: CheckedRun, tracking: MlflowRun, launched_at: float) -> TrainingOutcome:
    """Train a checked run whose MLflow run is open: build the trainer, fit, record."""
    result = fit_and_record(build_trainer(run, tracking, launched_at), run, tracking)
    return TrainingOutcome(run.run_name, run.run_dir, run.tracking_uri, tracking.run_id, dict(result.metrics))
