"""The Ray driver of one training run: validate everything, start Ray, train, record in MLflow.

Everything that can be wrong with the input is checked before any worker starts (exit 2, nothing
written): the config, the model's overrides, the datasets, the MLflow store, and a resumed
run's checkpoint belonging to the same model. `vitsweep train` starts a new local Ray while it
checks (and stops it again on bad input); a cluster is joined only after the checks passed.
"""
from __future__ import annotations

import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ExperimentConfig
from pipeline.errors import InvalidInputError

# Slow 2-core machines need more than Ray's 60 s to start a worker group (import torch, DeepSpeed).
WORKER_GROUP_START_TIMEOUT_S = "600"


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the run stopped and is recorded FAILED."""


@dataclass(frozen=True)
class TrainingOutcome:
    run_name: str
    run_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    metrics: dict[str, Any]


@dataclass(frozen=True)
class ResolvedData:
    train: str
    val: str
    num_classes: int


def prepare_offline_data(cfg: ExperimentConfig) -> None:
    """Write the offline dataset the config asks for (``data.prepare``), unless it is there already."""
    from pipeline.data.prepare import prepare_digits

    if cfg.data.prepare == "digits":
        prepare_digits(cfg.data, cfg.model.img_size)


def resolve_data(cfg: ExperimentConfig) -> ResolvedData:
    """Write the offline dataset if asked, then check both splits before any worker starts."""
    from pipeline.data.integrity import check_beton
    from pipeline.data.staging import is_uri, read_location_sidecar

    prepare_offline_data(cfg)
    sidecars = {}
    for split in ("train", "val"):
        location = getattr(cfg.data, split)
        sidecars[split] = read_location_sidecar(location) if is_uri(location) else check_beton(location)
    if sidecars["train"].num_classes != sidecars["val"].num_classes:
        raise InvalidInputError(
            f"data.train has {sidecars['train'].num_classes} classes but data.val has "
            f"{sidecars['val'].num_classes}; they must come from the same dataset"
        )
    return ResolvedData(cfg.data.train, cfg.data.val, sidecars["train"].num_classes)


def check_resumable(run_dir: Path, cfg: ExperimentConfig, num_classes: int) -> None:
    """A run restarted under the same name resumes its latest checkpoint: it must be this model's."""
    from ray.train import Result

    from pipeline.checkpointing import check_same_model, model_identity, read_meta

    if not (run_dir / "checkpoint_manager_snapshot.json").exists():
        return
    checkpoint = Result.from_path(str(run_dir)).checkpoint
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            check_same_model(read_meta(directory), model_identity(cfg.model, num_classes), directory)


def model_facts(cfg: ExperimentConfig, num_classes: int) -> dict[str, Any]:
    import models
    from models.measure import count_gmacs, count_params
    from pipeline.modeling import build_model

    model = build_model(cfg.model, num_classes, device="meta")
    facts = models.VARIANTS.get(cfg.model.name)
    return {
        "name": cfg.model.name,
        "params": count_params(model),
        "gflops": round(count_gmacs(model, cfg.model.img_size), 4),
        "family": facts.family if facts else "timm",
        "paper": facts.paper if facts else "",
    }


def environment_tags(cfg: ExperimentConfig) -> dict[str, str]:
    from importlib.metadata import version

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


def _ray_address(address: str | None) -> str:
    # --address, else RAY_ADDRESS (set for a `ray job submit` driver: the cluster it was submitted
    # to), else a new local Ray in this process -- never a cluster that merely runs on this machine
    # (a bare ray.init() would join one found through /tmp/ray).
    return address or os.environ.get("RAY_ADDRESS") or "local"


def start_ray(address: str | None, command: str = "train", local_cpus: int | None = None) -> None:
    """Join ``address`` (or RAY_ADDRESS), else start a local Ray advertising ``local_cpus`` (default: the cores)."""
    import ray

    if ray.is_initialized():
        return
    if address and address.startswith(("http://", "https://")):
        raise InvalidInputError(
            f"--address {address} is a Ray Jobs API address: run `ray job submit --address {address} "
            f"--working-dir . -- vitsweep {command} ...` (see README) or pass a cluster address (auto, ray://...)"
        )
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S)
    address = _ray_address(address)
    local = {"num_cpus": local_cpus} if address == "local" and local_cpus else {}
    ray.init(address=address, logging_level="WARNING", configure_logging=True, log_to_driver=True, **local)


@dataclass(frozen=True)
class CheckedRun:
    """A run whose input passed every check: what launching it needs."""

    cfg: ExperimentConfig  # with absolute paths
    data: ResolvedData
    run_name: str
    storage: Path
    tracking_uri: str

    @property
    def run_dir(self) -> Path:
        return self.storage / self.run_name


def check_run(cfg: ExperimentConfig, address: str | None = None) -> CheckedRun:
    """Everything that can be checked before any worker starts (InvalidInputError / ConfigError)."""
    from pipeline.modeling import check_buildable
    from pipeline.tracking import check_logger_can_reach, check_reachable, resolve_tracking_uri

    cfg = cfg.with_absolute_paths()
    check_buildable(cfg.model)
    data = resolve_data(cfg)
    if cfg.distill.teacher is not None:
        from pipeline.distillation import build_teacher

        build_teacher(cfg.distill, data.num_classes)  # its checkpoint must fit before any worker loads it
    storage = Path(cfg.run.storage_path).expanduser().resolve()
    run_name = cfg.run.name or f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    tracking_uri = resolve_tracking_uri(cfg)
    check_logger_can_reach(tracking_uri, address)
    try:
        check_reachable(tracking_uri)
    except ConnectionError as err:
        raise InvalidInputError(str(err)) from None
    check_resumable(storage / run_name, cfg, data.num_classes)
    return CheckedRun(cfg, data, run_name, storage, tracking_uri)


def run_training(cfg: ExperimentConfig, address: str | None = None, launched_at: float | None = None) -> TrainingOutcome:
    """Check everything, then start Ray and open the MLflow run side by side (both mostly wait), then train."""
    from pipeline.tracking import finish_run

    launched_at = launched_at or time.time()
    run = check_run(cfg, address)
    with ThreadPoolExecutor(max_workers=1) as pool:
        opening = pool.submit(open_mlflow_run, run.cfg, run.data, run.run_name, run.run_dir, run.tracking_uri)
        try:
            start_ray(address)
        except BaseException:
            finish_run(run.tracking_uri, opening.result(), "FAILED")
            raise
        mlflow_run_id = opening.result()
    return _train(run, mlflow_run_id, launched_at)


def train_from_config(config: str | None, overrides: list[str], address: str | None, launched_at: float) -> TrainingOutcome:
    """`vitsweep train`. With a new local Ray (no --address, no RAY_ADDRESS), Ray starts (~5 s,
    mostly its own processes on the other core) while the input is checked and the MLflow run
    opened (~3 s): bad input stops that Ray again, nothing written. A cluster is joined only after
    the checks passed."""
    from pipeline.config import load_config
    from pipeline.tracking import finish_run

    cfg = load_config(config, overrides)
    if _ray_address(address) != "local":
        return run_training(cfg, address, launched_at)
    # ffcv's writer forks worker processes and reports a dead one by interrupting the main thread:
    # a dataset to write (the first run only) is written here, before Ray starts.
    prepare_offline_data(cfg.with_absolute_paths())

    def prepare() -> tuple[CheckedRun, str]:
        run = check_run(cfg, address)
        return run, open_mlflow_run(run.cfg, run.data, run.run_name, run.run_dir, run.tracking_uri)

    import ray

    with ThreadPoolExecutor(max_workers=1) as pool:
        preparing = pool.submit(prepare)
        try:
            start_ray(address)  # in the main thread, where Ray installs its SIGTERM handler
        except BaseException:
            run, mlflow_run_id = preparing.result()  # bad input explains more than a failed Ray start
            finish_run(run.tracking_uri, mlflow_run_id, "FAILED")
            raise
        try:
            run, mlflow_run_id = preparing.result()
        except BaseException:
            ray.shutdown()
            raise
    return _train(run, mlflow_run_id, launched_at)


def _train(run: CheckedRun, mlflow_run_id: str, launched_at: float) -> TrainingOutcome:
    trainer = build_trainer(run.cfg, run.data, run.run_name, run.storage, run.tracking_uri, mlflow_run_id, launched_at)
    result = fit_and_record(trainer, run.cfg, run.data, run.tracking_uri, mlflow_run_id)
    return TrainingOutcome(run.run_name, run.run_dir, run.tracking_uri, mlflow_run_id, dict(result.metrics))


def open_mlflow_run(cfg: ExperimentConfig, data: ResolvedData, run_name: str, run_dir: Path, tracking_uri: str,
                    tags: dict[str, str] | None = None, run_id: str | None = None) -> str:
    """Create (or, for a restarted run, continue) the run's MLflow run and log its setup.

    ``run_id``: an MLflow run already created for this run (a sweep's trial, keyed by its trial
    id); it is continued and ``run_dir`` is not consulted.
    """
    import yaml

    from pipeline.engine import deepspeed_config
    from pipeline.tracking import log_run_setup, start_or_continue_run

    mlflow_run_id = run_id or start_or_continue_run(tracking_uri, cfg.tracking.experiment, run_dir, run_name, tags)
    log_run_setup(
        tracking_uri, mlflow_run_id, cfg,
        files={
            "config.yaml": cfg.to_yaml(),
            "deepspeed.json": yaml.safe_dump(deepspeed_config(cfg, cfg.scaling.num_workers)),
            "model_summary.txt": _model_summary(cfg, data.num_classes),
        },
        facts=model_facts(cfg, data.num_classes),
        tags=environment_tags(cfg),
    )
    return mlflow_run_id


def build_trainer(cfg: ExperimentConfig, data: ResolvedData, run_name: str, storage: Path, tracking_uri: str,
                  mlflow_run_id: str, launched_at: float, callbacks: tuple = ()):
    """The Ray Train TorchTrainer of one run; ``callbacks`` adds e.g. Tune's report callback."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.tracking import MLflowEpochLogger
    from pipeline.worker import WorkerPlan, train_worker

    score = cfg.run.checkpoint_score
    return TorchTrainer(
        train_worker,
        train_loop_config=WorkerPlan(cfg.model_dump(mode="json"), data.num_classes, launched_at).as_dict(),
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker,
                                  **({"GPU": cfg.scaling.gpus_per_worker} if cfg.scaling.use_gpu else {})},
            placement_strategy=cfg.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.run.num_to_keep,
                checkpoint_score_attribute=score,
                checkpoint_score_order="min" if score.endswith("loss") else "max",
            ),
            callbacks=[MLflowEpochLogger(tracking_uri, mlflow_run_id, cfg.optim.epochs), *callbacks],
            worker_runtime_env={"env_vars": {} if cfg.scaling.use_gpu else {"DS_ACCELERATOR": "cpu"}},
        ),
    )


def fit_and_record(trainer, cfg: ExperimentConfig, data: ResolvedData, tracking_uri: str, mlflow_run_id: str,
                   record_failure: bool = True):
    """Run the trainer; the MLflow run ends FINISHED (with the final model), FAILED or KILLED.

    ``record_failure=False`` leaves a run whose ``fit()`` raised RUNNING for the caller to record:
    a sweep trial may have been stopped on purpose by its scheduler, which only the sweep knows.
    """
    from pipeline.tracking import diverged_at, finish_run

    try:
        result = trainer.fit()
    except KeyboardInterrupt:
        finish_run(tracking_uri, mlflow_run_id, "KILLED")
        raise
    except BaseException:
        if record_failure:
            finish_run(tracking_uri, mlflow_run_id, "FAILED")
        raise
    divergence = diverged_at(tracking_uri, mlflow_run_id)
    if divergence:
        finish_run(tracking_uri, mlflow_run_id, "FAILED")
        raise TrainingDiverged(f"loss diverged at {divergence}; MLflow run {mlflow_run_id} marked FAILED")
    _log_final_model(cfg, data.num_classes, result.checkpoint, tracking_uri, mlflow_run_id)
    finish_run(tracking_uri, mlflow_run_id, "FINISHED")
    return result


def _log_final_model(cfg: ExperimentConfig, num_classes: int, checkpoint, tracking_uri: str, run_id: str) -> None:
    from safetensors.torch import load_model

    from mlflow.tracking import MlflowClient

    from pipeline.checkpointing import EMA_WEIGHTS_FILE, WEIGHTS_FILE
    from pipeline.modeling import build_model
    from pipeline.tracking import log_trained_model

    with checkpoint.as_directory() as directory:
        weights = Path(directory) / WEIGHTS_FILE
        model = build_model(cfg.model, num_classes)
        load_model(model, str(weights))
        log_trained_model(tracking_uri, run_id, model, weights, cfg.model.img_size)
        if (Path(directory) / EMA_WEIGHTS_FILE).exists():
            MlflowClient(tracking_uri).log_artifact(run_id, str(Path(directory) / EMA_WEIGHTS_FILE))


def _model_summary(cfg: ExperimentConfig, num_classes: int) -> str:
    from models.measure import count_params, params_by_module
    from pipeline.modeling import build_model

    model = build_model(cfg.model, num_classes, device="meta")
    total = count_params(model)
    lines = [f"{cfg.model.name} {cfg.model.args} img_size={cfg.model.img_size} num_classes={num_classes}",
             f"total parameters: {total:,}", ""]
    lines += [f"{name:<40}{count:>12,}" for name, count in params_by_module(model, depth=2)]
    return "\n".join(lines) + "\n\n" + repr(model) + "\n"
