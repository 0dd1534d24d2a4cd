"""`vitsweep evaluate`: a trained model on any ``.beton``, through training's own validation path.

1. ``plan_evaluation``: everything that can be wrong, before anything is written or started (exit 2):
   the source resolves (``pipeline.trained.model_source``), the dataset verifies against its sidecar and has
   the model's class count, the preprocessing (the model's own validation's, or ``--img-size`` /
   ``--crop-ratio``) is valid and the model runs with it, the MLflow store answers.
2. ``evaluate_here`` (one process) or ``evaluate_on_ray`` (``--workers N`` Ray Train workers, each
   reading its shard; every sample counted once, as training's validation counts them): the val
   loader (``build_val_loader``), ``pipeline.training.worker.evaluate`` (the ``Tally`` training reports) and,
   in the same pass, the confusion matrix and each sample's top-1 prediction.
3. ``record_evaluation``: an MLflow run of its own in the source's experiment, tagged
   ``vitsweep.role=evaluation`` and linked to the source run; its metrics are also the source's
   logged model's (MLflow 3 model metrics, with the dataset as the run's input), so the UI lists the
   evaluation beside the training runs and on the model's page.
"""
from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.trained import evaluation_report as report
from pipeline import uris
from pipeline.config.schema import DataConfig, ExperimentConfig
from pipeline.console import active_console
from pipeline.data.verification import verify_dataset
from pipeline.data.loaders import build_val_loader
from pipeline.data.sidecar import Sidecar
from pipeline.data.staging import cache_dir_for, stage_dataset
from pipeline.errors import InvalidInputError, RunFailed
from pipeline.components.metrics import ConfusionTally
from pipeline.components.model_card import EvalPreprocessing
from pipeline.trained.model_source import ModelSource, Provenance, resolve_model_source
from pipeline.tracking.store import MlflowRun, MlflowStore, command_line, dataset_reference, run_origin
from pipeline.tracking.connection import require_reachable, resolve_tracking_uri

ROLE_TAG, ROLE = "vitsweep.role", "evaluation"
SOURCE_RUN_TAG, SOURCE_MODEL_TAG = "vitsweep.source_run_id", "vitsweep.source_model_id"
EVALUATION_CONTEXT = "evaluation"  # the dataset input's context


@dataclass(frozen=True)
class EvaluationPlan:
    """What an evaluation needs, every part checked."""

    source: ModelSource
    data: DataConfig  # the loader's settings: data.val is the dataset, its crop, mean and std the preprocessing's
    sidecar: Sidecar
    preprocessing: EvalPreprocessing
    workers: int  # 0: this process; N: N Ray Train workers
    batch_size: int  # per process
    cache_dir: Path  # where a dataset given as a URI is staged
    tracking_uri: str
    experiment: str  # the source's experiment where MLflow records it, else the config's
    flip_tta: bool = False  # each image's logits averaged with its mirror image's (FlipAveraged)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.sidecar.classes)

    @property
    def metric_suffix(self) -> str:
        """Training's names for the EMA's metrics: val_top1_ema, ..."""
        return "_ema" if self.source.provenance.ema else ""


@dataclass(frozen=True)
class Evaluation:
    """Loss, top-1 and top-5 (percent, ``worker.evaluate``'s), the confusion matrix (true x predicted),
    and each sample's label, top-1 class and its probability, in the dataset's order."""

    metrics: dict[str, float]
    confusion: np.ndarray
    labels: np.ndarray
    predicted: np.ndarray
    probability: np.ndarray


def plan_evaluation(given: str, data_location: str, cfg: ExperimentConfig, *, ema: bool = False,
                    img_size: int | None = None, crop_ratio: float | None = None, workers: int = 0,
                    batch_size: int = 64, flip_tta: bool = False) -> EvaluationPlan:
    """Check everything (InvalidInputError naming what is wrong); nothing is written or started."""
    if workers < 0:
        raise InvalidInputError(f"--workers {workers}: give 1 or more Ray workers, or leave it out (this process)")
    if batch_size < 1:
        raise InvalidInputError(f"--batch-size {batch_size}: need at least 1 image per batch")
    cfg = cfg.with_absolute_paths()
    source = resolve_model_source(given, storage_path=cfg.run.storage_path, tracking_uri=resolve_tracking_uri(cfg),
                                  ema=ema)
    card = source.require_card()
    sidecar = verify_dataset(data_location, streams=cfg.data.stage_streams, storage_path=cfg.run.storage_path)
    if sidecar.num_classes != card.num_classes:
        raise InvalidInputError(
            f"model source {given!r} classifies {card.num_classes} classes but dataset {data_location!r} has "
            f"{sidecar.num_classes} ({', '.join(sidecar.classes[:5])}{', ...' if sidecar.num_classes > 5 else ''}); "
            "evaluate it on data of the classes it was trained on"
        )
    preprocessing = card.eval_preprocessing(cfg.data, img_size, crop_ratio)
    source.build(preprocessing.img_size)  # the weights fit, and the model runs, at that size
    provenance = source.provenance
    tracking_uri = provenance.tracking_uri or resolve_tracking_uri(cfg)
    require_reachable(tracking_uri)
    data = cfg.data.model_copy(update={"val": uris.absolute(data_location), "val_crop_ratio": preprocessing.crop_ratio,
                                       "mean": preprocessing.mean, "std": preprocessing.std})
    return EvaluationPlan(source, data, sidecar, preprocessing, workers, batch_size,
                          cache_dir_for(cfg.data, cfg.run.storage_path), tracking_uri,
                          _experiment(tracking_uri, provenance) or cfg.tracking.experiment, flip_tta)


def _experiment(tracking_uri: str, provenance: Provenance) -> str | None:
    if provenance.experiment_id is None:
        return None
    found = MlflowStore(tracking_uri).client.get_experiment(provenance.experiment_id)
    return found.name


def class_name_differences(plan: EvaluationPlan) -> list[str]:
    """'model name != data name' for each label whose names differ (the same count, other classes?)."""
    trained = plan.source.card.class_names
    if trained is None:
        return []
    return [f"{mine!r} != {theirs!r}" for mine, theirs in zip(trained, plan.classes) if mine != theirs]


# -- computing ---------------------------------------------------------------------------------------


class SampleRecorder:
    """``worker.evaluate``'s observer: the confusion matrix and each real sample's top-1 class and probability."""

    def __init__(self, num_classes: int):
        self.confusion = ConfusionTally(num_classes)
        self.labels: list[torch.Tensor] = []
        self.predicted: list[torch.Tensor] = []
        self.probability: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.confusion.add(logits, labels)
        probability, predicted = logits.softmax(dim=1).max(dim=1)
        self.labels.append(labels.cpu().clone())  # the loader reuses its buffers
        self.predicted.append(predicted.cpu())
        self.probability.append(probability.cpu())

    def samples(self) -> dict[str, list]:
        return {name: torch.cat(getattr(self, name)).tolist() if getattr(self, name) else []
                for name in ("labels", "predicted", "probability")}


class FlipAveraged(torch.nn.Module):
    """Flip test-time augmentation: the mean of the model's logits for each image and its mirror image
    (left-right, the flip training augments with)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (self.model(images) + self.model(images.flip(-1))) / 2


def _evaluate_shard(source: ModelSource, data: DataConfig, path: Path, preprocessing: EvalPreprocessing,
                    batch_size: int, device: torch.device, distributed: bool,
                    flip_tta: bool) -> tuple[dict, torch.Tensor, dict]:
    from pipeline.components.metrics import validation_metrics

    model = source.build(preprocessing.img_size).to(device)
    if flip_tta:
        model = FlipAveraged(model)
    loader = build_val_loader(data, path, batch_size, preprocessing.img_size, device, distributed=distributed)
    recorder = SampleRecorder(source.card.num_classes)
    metrics = validation_metrics(model, loader, torch.float32, device, observe=recorder)
    return metrics, recorder.confusion.reduced(device), recorder.samples()


def evaluate_here(plan: EvaluationPlan) -> Evaluation:
    """In this process, on its first GPU where it has one."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = stage_dataset(plan.data.val, plan.cache_dir)
    metrics, confusion, samples = _evaluate_shard(plan.source, plan.data, path, plan.preprocessing, plan.batch_size,
                                                  device, distributed=False, flip_tta=plan.flip_tta)
    return _evaluation(metrics, confusion.numpy(), samples)


def _evaluation(metrics: dict[str, float], confusion: np.ndarray, samples: dict[str, list]) -> Evaluation:
    return Evaluation(metrics, np.asarray(confusion, dtype=np.int64), np.asarray(samples["labels"], dtype=np.int64),
                      np.asarray(samples["predicted"], dtype=np.int64),
                      np.asarray(samples["probability"], dtype=np.float64))


def evaluation_worker(config: dict[str, Any]) -> None:
    """Ray Train's entry point on every rank: this rank's shard, then every rank's samples gathered in
    the dataset's order (rank r reads positions r, r + W, ...: ffcv's DistributedSampler) on rank 0,
    which hands the whole evaluation to the driver through ``config["results"]`` (a Ray queue: Ray
    Train 2.60 keeps a report's metrics in ``Result.metrics`` only with a checkpoint)."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    data = DataConfig.model_validate(config["data"])
    path = stage_dataset(data.val, config["cache_dir"])
    metrics, confusion, samples = _evaluate_shard(
        ray.get(config["source"]), data, path, EvalPreprocessing.model_validate(config["preprocessing"]),
        config["batch_size"], device, distributed=world_size > 1, flip_tta=config["flip_tta"])
    shards: list[dict[str, list] | None] = [samples] * world_size
    if world_size > 1:
        dist.all_gather_object(shards, samples)
    if rank == 0:
        config["results"].put({"metrics": metrics, "confusion": confusion.tolist(), "samples": in_dataset_order(shards)})


def in_dataset_order(shards: list[dict[str, list]]) -> dict[str, list]:
    """Every rank's samples as one list each, in the dataset's order: rank r of W read positions r, r + W, ...
    (ffcv's DistributedSampler)."""
    world_size = len(shards)
    merged = {name: [None] * sum(len(shard[name]) for shard in shards) for name in shards[0]}
    for shard_rank, shard in enumerate(shards):
        for name, values in shard.items():
            merged[name][shard_rank::world_size] = values
    return merged


def check_workers_fit(workers: int, cpus: float, local: bool) -> None:
    """``--workers N`` on a local Ray of ``cpus`` CPUs: one CPU each (a cluster may grow to fit them)."""
    if local and cpus < workers:
        raise InvalidInputError(f"--workers {workers} need {workers} CPUs; this machine's local Ray has {cpus:g}: "
                                "give fewer, or join a cluster with --address")


def evaluate_on_ray(plan: EvaluationPlan, address: str | None) -> Evaluation:
    """On ``plan.workers`` Ray Train workers (a local Ray, or the cluster at ``address``)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Queue

    from pipeline.ray_connection import start_ray, ray_address
    from pipeline.errors import error_line

    start_ray(address, "evaluate")
    try:
        use_gpu = ray.cluster_resources().get("GPU", 0.0) >= plan.workers
        check_workers_fit(plan.workers, ray.cluster_resources().get("CPU", 0.0), ray_address(address) == "local")
        results = Queue(maxsize=1, actor_options={"num_cpus": 0})  # rank 0's evaluation, on any node
        with tempfile.TemporaryDirectory(prefix="vitsweep-evaluate-") as storage:
            trainer = TorchTrainer(
                evaluation_worker,
                train_loop_config={"source": ray.put(plan.source), "results": results,
                                   "data": plan.data.model_dump(mode="json"),
                                   "preprocessing": plan.preprocessing.model_dump(mode="json"),
                                   "batch_size": plan.batch_size, "cache_dir": str(plan.cache_dir),
                                   "flip_tta": plan.flip_tta},
                torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
                scaling_config=ScalingConfig(num_workers=plan.workers, use_gpu=use_gpu),
                run_config=RunConfig(name=f"evaluate-{uuid.uuid4().hex[:8]}", storage_path=storage),
            )
            try:
                trainer.fit()
            except Exception as err:  # noqa: BLE001  (a worker's error, wrapped by Ray)
                raise RunFailed(f"the evaluation failed on its Ray workers: {error_line(err)}") from err
        reported = results.get(block=False)
        return _evaluation(reported["metrics"], np.asarray(reported["confusion"]), reported["samples"])
    finally:
        ray.shutdown()


# -- recording ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordedEvaluation:
    tracking_uri: str
    experiment_id: str
    run_id: str
    run_name: str


def source_label(source: ModelSource, tracking_uri: str) -> str:
    """A short name for the evaluated model: its run, its registry entry, or its file."""
    p = source.provenance
    if p.kind == "registered_model":
        return f"{p.registered_name}@{p.registered_alias}" if p.registered_alias else f"{p.registered_name}/{p.registered_version}"
    if p.kind in ("mlflow_run", "logged_model") and p.run_id:
        return MlflowRun(tracking_uri, p.run_id).get().info.run_name or p.run_id
    if p.kind == "checkpoint_dir":
        return f"{Path(p.location).parent.name}/{Path(p.location).name}"
    return Path(p.given).name or p.given  # pathlib drops a trailing slash


def record_evaluation(plan: EvaluationPlan, evaluation: Evaluation, log_file: Path | None = None) -> RecordedEvaluation:
    """The evaluation's MLflow run, FINISHED, with everything it found."""
    provenance = plan.source.provenance
    label = source_label(plan.source, plan.tracking_uri)
    data_name = Path(plan.data.val).name
    suffix = plan.metric_suffix
    metrics = {f"{key}{suffix}": value for key, value in evaluation.metrics.items()}
    run_name = f"eval {label} on {data_name.removesuffix('.beton')}{' (ema)' if suffix else ''}"
    store = MlflowStore(plan.tracking_uri)
    tags = {ROLE_TAG: ROLE, "vitsweep.source": provenance.given, **run_origin(describe(plan, metrics, label), command_line())}
    if provenance.run_id:
        tags[SOURCE_RUN_TAG] = provenance.run_id
    if provenance.model_id:
        tags[SOURCE_MODEL_TAG] = provenance.model_id
    run = store.create_run(plan.experiment, run_name, tags)
    run.log_params(evaluation_params(plan))
    run.log_datasets({EVALUATION_CONTEXT: (plan.data.val, plan.sidecar.sha256)})
    if provenance.model_id:
        run.log_model_input(provenance.model_id)
    run.log_metrics(metrics, model_id=provenance.model_id,
                    dataset=dataset_reference(plan.data.val, plan.sidecar.sha256))
    classes = plan.classes
    title = confusion_title(label, bool(suffix), data_name, evaluation.metrics["val_top1"])
    run.log_texts({report.CONFUSION_CSV: report.confusion_csv(evaluation.confusion, classes),
                   report.PER_CLASS_CSV: report.per_class_csv(evaluation.confusion, classes),
                   report.PREDICTIONS_CSV: report.predictions_csv(evaluation.labels, evaluation.predicted,
                                                                  evaluation.probability, classes)})
    with tempfile.TemporaryDirectory() as directory:
        run.log_artifact(report.plot_confusion(evaluation.confusion, classes, title,
                                               Path(directory) / report.CONFUSION_PNG))
    if log_file is not None and log_file.is_file():
        run.log_artifact(log_file)
    run.end("FINISHED", "completed")
    return RecordedEvaluation(plan.tracking_uri, run.get().info.experiment_id, run.run_id, run_name)


def confusion_title(label: str, ema: bool, data_name: str, top1: float) -> str:
    """The confusion matrix plot's title: which model (its EMA?), on what, how well."""
    return f"{label}{' (EMA)' if ema else ''} on {data_name}: top-1 {top1:.2f}%"


def evaluation_params(plan: EvaluationPlan) -> dict[str, Any]:
    p, pre = plan.source.provenance, plan.preprocessing
    params = {"source": p.given, "source.kind": p.kind, "source.location": p.location, "ema": p.ema,
              "model.name": plan.source.card.model.name, "data": plan.data.val, "data.sha256": plan.sidecar.sha256,
              "data.num_samples": plan.sidecar.num_samples, "data.num_classes": plan.sidecar.num_classes,
              "img_size": pre.img_size, "crop_ratio": pre.crop_ratio, "mean": list(pre.mean), "std": list(pre.std),
              "flip_tta": plan.flip_tta, "workers": plan.workers or "this process", "batch_size": plan.batch_size}
    for key in ("run_id", "model_id", "registered_name", "registered_version", "registered_alias"):
        if getattr(p, key):
            params[f"source.{key}"] = getattr(p, key)
    return params


_FLIPPED = ", each image's logits averaged with its mirror image's (flip TTA)"


def describe(plan: EvaluationPlan, metrics: dict[str, float], label: str) -> str:
    """The evaluation run's MLflow description, linking the run that trained the model."""
    p, pre, suffix = plan.source.provenance, plan.preprocessing, plan.metric_suffix
    trained = ""
    if p.run_id and p.experiment_id:
        trained = f" (trained by [run {p.run_id}](#/experiments/{p.experiment_id}/runs/{p.run_id}))"
    return (f"Evaluation of **{label}**{' (its EMA weights)' if p.ema else ''}{trained} on "
            f"`{Path(plan.data.val).name}` ({plan.sidecar.num_samples} images, {plan.sidecar.num_classes} classes) at "
            f"{pre.img_size} px, center crop {pre.crop_ratio:g}{_FLIPPED if plan.flip_tta else ''}: top-1 "
            f"{metrics[f'val_top1{suffix}']:.2f}%, top-5 "
            f"{metrics[f'val_top5{suffix}']:.2f}%, loss {metrics[f'val_loss{suffix}']:.4f}.")


def announce(plan: EvaluationPlan, address_given: bool) -> None:
    """The console's first line: what is evaluated on what, where."""
    p, pre = plan.source.provenance, plan.preprocessing
    where = (f"{plan.workers} Ray worker{'s' if plan.workers > 1 else ''}{' (cluster)' if address_given else ''}"
             if plan.workers else "this process")
    active_console().line(
        f"evaluating {p.given}{' (EMA weights)' if p.ema else ''} [{p.kind}] on {plan.data.val}: "
        f"{plan.sidecar.num_samples} images, {plan.sidecar.num_classes} classes, {pre.img_size} px, "
        f"crop {pre.crop_ratio:g}{_FLIPPED if plan.flip_tta else ''}; {where}")
