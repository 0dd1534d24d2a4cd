"""The experiment config: one validated object, the source of truth for every run.

Loaded from a YAML preset shipped in ``pipeline/presets/`` or a user's YAML file, then
overridden with dotted keys (``--set optim.lr=1e-3``). Everything downstream (DeepSpeed JSON,
Ray scaling, FFCV pipelines, MLflow params) is derived from this object, never re-typed.
Defaults follow the DeiT recipe the papers train with.
"""
from __future__ import annotations

import copy
import difflib
import math
import os
import re
import tempfile
from pathlib import Path
import typing
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipeline import uris
from pipeline.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"
# The largest integer any config value may hold: torch, numpy, numba (ffcv's loaders) and Optuna
# all take 32-bit counts and seeds; a larger one overflows inside a worker, long after validation.
MAX_INT = 2**31 - 1


def number_problem(value: Any) -> str | None:
    """Why a number inside a free-form value (``model.args``) cannot be passed on, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{value} is outside +-{MAX_INT}, the 32-bit range torch, numpy and ffcv take"
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((problem for item in value if (problem := number_problem(item))), None)
    return None


class _Section(BaseModel):
    # Unknown keys are errors (a misspelt key must never be silently ignored); values are
    # re-validated when assigned so a config never holds an invalid value. inf and nan are
    # refused in every float field (lr=1e400 would train, then "diverge").
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_fit_the_libraries(cls, value: Any) -> Any:
        problem = number_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def check_registered(name: str) -> str:
    """``name`` if timm (with vitsweep's variants) can build it, else a ValueError with close names."""
    import timm

    import models  # noqa: F401  (registers vitsweep's variants)

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; did you mean one of {close}" if close else ""
        raise ValueError(f"{name!r} is not a registered model{hint} (see `vitsweep models list`)")
    return name


# Error type of a value that must not be echoed back (it holds a secret).
SECRET_VALUE_ERROR = "secret_value"


def uri_password_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be an MLflow tracking URI (malformed, or carries a credential), else None.

    Never quotes the credential."""
    try:
        urlsplit(uri).port  # noqa: B018  (parsing the port is what rejects a malformed authority)
    except ValueError:
        return f"is not a valid URI ({uris.redact(uri).partition('://')[2] or 'malformed host'})"
    credential = uris.credentials_in(uri)
    if credential is None:
        return None
    return (f"embeds {credential}, which would be logged as an MLflow param, saved in config.yaml and "
            "printed; give the URI without it and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
            "(or MLFLOW_TRACKING_TOKEN) for an MLflow server, PGPASSWORD / ~/.pgpass for a PostgreSQL store")


def location_problem(location: str | Path | None, kind: Literal["file", "directory"] | None = None,
                     create: bool = False) -> str | None:
    """Why a local path or URI cannot be used as given, else None: a URI carrying a credential; a local
    path below an existing file (nothing can ever be created there); an existing path of the wrong
    ``kind`` (a directory given for a file, or a file for a directory); with ``create``, a path where
    this process cannot create or write a directory (a read-only or virtual filesystem, no permission)."""
    if location is None:
        return None
    location = str(location)
    if uris.is_uri(location):
        credential = uris.credentials_in(location)
        if credential:
            return (f"the URI embeds {credential}, which would be printed, logged and saved in config.yaml; "
                    "give it without, and the credentials to the filesystem instead (AWS_* / "
                    "GOOGLE_APPLICATION_CREDENTIALS variables, ~/.netrc, or fsspec's config)")
        return None
    path = Path(location).expanduser().absolute()
    if kind == "directory" and path.exists() and not path.is_dir():
        return f"{str(path)!r} is a file, and a directory is needed here; choose another path"
    if kind == "file" and path.is_dir():
        return f"{str(path)!r} is a directory, and a file is needed here; name the file inside it"
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        return f"{str(blocking)!r} is a file, so nothing can exist below it; choose a path under a directory"
    if create:
        return _creation_problem(path.parent if kind == "file" else path)
    return None


def _creation_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written in, found by creating (and removing at once) a
    directory in it or its nearest existing ancestor: root passes every permission check, yet cannot
    create anything in /proc or on a read-only mount."""
    existing = next(candidate for candidate in (directory, *directory.parents) if candidate.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vitsweep-probe-", dir=existing))
    except OSError as err:
        reason = err.strerror or str(err)
        if existing == directory:
            return f"{str(directory)!r} is not writable: the system refuses to create anything in it ({reason})"
        return (f"{str(directory)!r} cannot be created: the system refuses to create a directory in "
                f"{str(existing)!r} ({reason})")
    return None


def _refuse(problem: str | None) -> None:
    if problem:
        # Neither the value nor the input is echoed: it may hold a secret.
        raise PydanticCustomError(SECRET_VALUE_ERROR, problem)


def _check_file(location: str | None) -> str | None:
    _refuse(location_problem(location, kind="file"))
    return location


def _check_directory(location: str | None) -> str | None:
    _refuse(location_problem(location, kind="directory"))
    return location


def _check_location(location: str | None) -> str | None:
    """A file or a directory (``model.init_from`` names either)."""
    _refuse(location_problem(location))
    return location


class ModelConfig(_Section):
    """Which registered model to build, and the keyword overrides it is built with."""

    name: str = "xcit_nano_12_p16"
    # Keyword overrides for timm.create_model(name, **args): qkv, code_size, head, mgcrp_heads, ...
    args: dict[str, Any] = Field(default_factory=dict)
    img_size: int = Field(32, ge=8, le=1024)
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0)
    # Trained weights to start from (``pipeline.transfer``), any model source: a run's name under
    # run.storage_path or its directory, a checkpoint directory, a .safetensors or torch state dict file,
    # runs:/RUN_ID/model, models:/NAME/VERSION or models:/NAME@ALIAS. null: random initialisation.
    init_from: str | None = Field(None, min_length=1)
    init_ema: bool = False  # start from the source's EMA weights
    # fnmatch globs of weights left at their fresh initialisation on purpose (e.g. "head.*": a new head
    # for another task with the same class count); besides these, the head is new when the class count
    # differs and position embeddings are resampled to a new token grid.
    init_exclude: tuple[str, ...] = ()
    # backbone: a linear probe, only the classifier head (get_classifier()) trains; the rest stays as
    # loaded and runs in eval mode (no dropout, BatchNorm on its running statistics).
    freeze: Literal["none", "backbone"] = "none"

    _usable_source = field_validator("init_from")(_check_location)

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        return check_registered(name)

    @model_validator(mode="after")
    def _init_options_need_a_source(self) -> ModelConfig:
        if self.init_from is None and (self.init_ema or self.init_exclude):
            raise ValueError("model.init_ema / model.init_exclude choose what to take from model.init_from, "
                             "which is not set")
        return self

    @field_validator("args")
    @classmethod
    def _args_are_not_top_level_fields(cls, args: dict[str, Any]) -> dict[str, Any]:
        reserved = {"img_size", "drop_path_rate", "num_classes", "pretrained"} & args.keys()
        if reserved:
            raise ValueError(f"set {sorted(reserved)} as model.<key>, not inside model.args")
        return args


class AugmentConfig(_Section):
    """DeiT's batch recipe (papers 000-004 all train with it); 0 / null switches a part off.

    RandAugment runs batched on the training device, inside the FFCV train pipeline (per-sample ops
    and magnitudes, timm's semantics); random erasing, Mixup/CutMix and label smoothing run on the
    normalised batch on the training device (``pipeline.data.augment``).
    """

    rand_augment: str | None = "rand-m9-mstd0.5-inc1"  # timm RandAugment spec: magnitude 9, std 0.5
    mixup_alpha: float = Field(0.8, ge=0.0)
    cutmix_alpha: float = Field(1.0, ge=0.0)
    mixup_prob: float = Field(1.0, ge=0.0, le=1.0)
    mixup_switch_prob: float = Field(0.5, ge=0.0, le=1.0)
    random_erasing: float = Field(0.25, ge=0.0, le=1.0)
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    hflip: float = Field(0.5, ge=0.0, le=1.0)

    @field_validator("rand_augment")
    @classmethod
    def _timm_rand_augment_spec(cls, spec: str | None) -> str | None:
        # A typo here would otherwise surface as an error in a loader thread mid-epoch.
        if spec is None:
            return spec
        from pipeline.data.rand_augment import parse_policy

        try:
            parse_policy(spec)
        except (AssertionError, KeyError):
            raise ValueError(
                "not a timm RandAugment spec; valid: 'rand' then '-'-separated m<int> (magnitude), n<int> (ops), "
                "mstd<float>, mmax<int>, p<float>, inc<0|1>, t<set>, e.g. 'rand-m9-mstd0.5-inc1'; or null to switch off"
            ) from None
        return spec


class DataConfig(_Section):
    """FFCV datasets and loader options; paths may be local or URIs (s3://, gs://, file://).

    A plain path is read in place; a URI is copied once per node into ``cache_dir`` and read there.
    Every ``.beton`` has a JSON sidecar (``<file>.json``) that training reads the class count from.
    """

    train: str = "vitsweep-runs/data/digits_32_train.beton"
    val: str = "vitsweep-runs/data/digits_32_val.beton"
    # Write the offline `digits` dataset to `train`/`val` when they do not exist yet (demo, tests).
    prepare: Literal["digits"] | None = None
    num_workers: int = Field(2, ge=1, le=256)  # FFCV decoding threads per process
    # quasi_random reads pages in a RAM-sized window, but ffcv 1.0.2 cannot shard it across ranks.
    order: Literal["random", "sequential", "quasi_random"] = "random"
    os_cache: bool = True
    batches_ahead: int = Field(2, ge=1, le=64)
    drop_last: bool = True  # train only: validation always sees every sample exactly once
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    val_crop_ratio: float = Field(1.0, gt=0.0, le=1.0)  # XCiT evaluates at 1.0, DeiT at 0.875
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    cache_dir: str | None = None  # node-local staging directory; default: $VITSWEEP_CACHE_DIR, else under run.storage_path
    # Byte ranges a node reads at once while staging a URI (one 64 MiB sidecar chunk each, held in
    # memory until verified): one object-store connection gives ~100 MB/s, a GPU node's NIC 10-100x that.
    stage_streams: int = Field(16, ge=1, le=256)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)

    _usable_locations = field_validator("train", "val")(_check_file)
    _usable_cache = field_validator("cache_dir")(_check_directory)

    @field_validator("crop_scale", "crop_ratio")
    @classmethod
    def _ordered_positive_range(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        low, high = bounds
        if not 0 < low <= high:
            raise ValueError(f"need 0 < low <= high, got ({low}, {high})")
        return bounds

    @field_validator("crop_scale")
    @classmethod
    def _scale_at_most_one(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if bounds[1] > 1.0:
            raise ValueError(f"a crop covers at most the whole image (scale <= 1.0), got {bounds[1]}")
        return bounds

    @field_validator("std")
    @classmethod
    def _std_positive(cls, std: tuple[float, float, float]) -> tuple[float, float, float]:
        if not all(s > 0 for s in std):
            raise ValueError(f"each channel's std divides the image, so it must be > 0, got {std}")
        return std


class ScheduleConfig(_Section):
    """Per-step learning-rate schedule: linear warmup, then cosine decay (DeiT recipe).

    The schedule peaks at the run's learning rate (``optim.lr``, or ``optim.lr_per_512`` scaled to
    the global batch); ``warmup_lr`` and ``min_lr`` are absolute rates, not scaled, as in DeiT.
    """

    name: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = Field(5.0, ge=0.0)
    warmup_lr: float = Field(1e-6, ge=0.0)  # the warmup rises linearly from here to the peak
    min_lr: float = Field(1e-5, ge=0.0)  # the cosine falls from the peak to here


class OptimConfig(_Section):
    """AdamW and the batch geometry; global batch = micro_batch_size x grad_accum_steps x world size.

    The learning rate is given one way: ``lr`` (absolute) or ``lr_per_512`` (per 512 images of
    global batch, scaled to the run's batch by ``lr_scaling``); ``pipeline.lr_scaling`` computes the
    rate a run trains at. A config whose global batch depends on the cluster (``cluster/jobs/``)
    gives ``lr_per_512``, so changing ``scaling.num_workers`` or the micro batch needs no lr edit.
    """

    # AdamW's rate, absolute: the same whatever the global batch. null when lr_per_512 gives the
    # rate; with neither given, DeiT's 5e-4 (pipeline.lr_scaling.DEFAULT_LR), absolute.
    lr: float | None = Field(None, gt=0.0)
    # DeiT's convention (5e-4 per 512): the rate at a global batch of 512 images; the run trains at
    # this rate scaled to its global batch by lr_scaling (pipeline.lr_scaling).
    lr_per_512: float | None = Field(None, gt=0.0)
    # How lr_per_512 follows the global batch B: linear (x B/512, DeiT and XCiT) or sqrt (linear up
    # to B = 1,024, where DeiT and XCiT trained, then x sqrt(B/1,024), for larger batches).
    lr_scaling: Literal["linear", "sqrt"] = "linear"
    weight_decay: float = Field(0.05, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    epochs: int = Field(300, ge=1)
    micro_batch_size: int = Field(64, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    grad_clip: float | None = Field(None, gt=0.0)  # max grad norm; null = no clipping
    # Exponential moving average of the weights, updated every optimizer step (DeiT: 0.99996);
    # evaluated beside the model each epoch (val_top1_ema, ...). null: no EMA.
    ema_decay: float | None = Field(None, gt=0.0, lt=1.0)
    # Layer-wise learning-rate decay (BEiT's, timm's --layer-decay): the head trains at lr, each layer
    # below at layer_decay times the one above (groups from the model's group_matcher). null: off.
    layer_decay: float | None = Field(None, gt=0.0, le=1.0)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)

    @model_validator(mode="after")
    def _one_learning_rate(self) -> OptimConfig:
        if self.lr is not None and self.lr_per_512 is not None:
            raise ValueError(
                f"optim.lr={self.lr:g} and optim.lr_per_512={self.lr_per_512:g} both give the learning rate; keep "
                "one and set the other to null: optim.lr is absolute, optim.lr_per_512 is scaled to the global "
                "batch (micro batch x accumulation x workers) by optim.lr_scaling"
            )
        if self.lr_per_512 is None and self.lr_scaling != "linear":
            given = f"given absolutely (optim.lr={self.lr:g})" if self.lr is not None else "not given"
            raise ValueError(
                f"optim.lr_scaling={self.lr_scaling!r} scales optim.lr_per_512, which is {given}; give "
                "optim.lr_per_512 (and optim.lr=null) for a rate that follows the global batch"
            )
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _warmup_within_training(self) -> OptimConfig:
        if self.schedule.warmup_epochs > self.epochs:
            raise ValueError(
                f"schedule.warmup_epochs={self.schedule.warmup_epochs} exceeds epochs={self.epochs}"
            )
        return self


class DeepSpeedConfig(_Section):
    """The DeepSpeed engine: ZeRO stage and precision (the JSON is derived from the whole config)."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer state to CPU (stages 1-3)
    # GPUs: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa, ~8x IEEE fp32 on
    # A100), as timm and DeiT train; false keeps IEEE fp32. Ignored on CPU.
    tf32: bool = True
    # torch.compile the model through DeepSpeed's engine.compile() (inductor): a one-off compile of
    # tens of seconds per worker for faster steps; see benchmarks/RESULTS.md.
    compile: bool = False

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> DeepSpeedConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3, got zero_stage=0")
        return self


class ScalingConfig(_Section):
    """Ray Train workers; on a GPU cluster, one worker per GPU."""

    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    gpus_per_worker: float = Field(0.0, ge=0.0)
    cpus_per_worker: float = Field(1.0, gt=0.0)
    # Ray's placement group strategy for the workers: PACK fills a node first (one 8-GPU node per
    # 8 workers), SPREAD puts them on as many nodes as possible; STRICT_* fail rather than bend.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _gpus_consistent(self) -> ScalingConfig:
        if self.use_gpu and self.gpus_per_worker == 0:
            raise ValueError("use_gpu=true needs gpus_per_worker > 0")
        if not self.use_gpu and self.gpus_per_worker > 0:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker} needs use_gpu=true")
        if self.use_gpu and self.gpus_per_worker != 1:
            # DeepSpeed puts the model on cuda:LOCAL_RANK, FFCV and Ray the data on
            # ray.train.torch.get_device(): with 2+ GPUs they differ, with < 1 ranks share a GPU (NCCL refuses).
            raise ValueError(
                f"gpus_per_worker={self.gpus_per_worker} with use_gpu=true: vitsweep runs one worker per GPU "
                "(gpus_per_worker=1, num_workers = the GPUs to train on). With more GPUs per worker DeepSpeed "
                "(cuda:LOCAL_RANK) and the data (Ray's device) land on different GPUs; with a fraction two "
                "ranks share one GPU, which NCCL refuses")
        return self


class TrackingConfig(_Section):
    """MLflow: where runs are recorded. No URI: a SQLite file under run.storage_path."""

    mlflow_uri: str | None = None
    experiment: str = Field("vitsweep", min_length=1)

    @field_validator("mlflow_uri")
    @classmethod
    def _no_password(cls, uri: str | None) -> str | None:
        problem = None if uri is None else uri_password_problem(uri)
        if problem:
            raise PydanticCustomError(SECRET_VALUE_ERROR, problem)
        return uri


class RunConfig(_Section):
    """Identity, storage, checkpointing and fault tolerance of one training run."""

    name: str | None = None
    storage_path: str = "./vitsweep-runs"
    seed: int = Field(0, ge=0)
    checkpoint_every: int = Field(1, ge=1)  # epochs between checkpoints
    num_to_keep: int = Field(2, ge=1)
    checkpoint_score: str = "val_top1"
    max_failures: int = Field(0, ge=-1)  # -1: retry forever
    # Steps between the loss's all-reduce (its divergence check and the progress line): syncing the
    # host with the device every step would stall the GPU.
    log_every_steps: int = Field(20, ge=1)

    _usable_storage = field_validator("storage_path")(_check_directory)


class TuneConfig(_Section):
    """A Ray Tune sweep (`vitsweep tune`): searcher, scheduler, budget. `vitsweep train` ignores it.

    Every trial trains with this config's `scaling` (its own Ray Train workers) plus ``trial_cpus``
    for the trial function that drives them; see README "Sweeps" for how that is sized.
    """

    name: str | None = None  # sweep directory and MLflow parent run; default: <space>-<time>
    storage_path: str | None = None  # local path or URI (s3://, gs://); default: run.storage_path
    searcher: Literal["grid", "random", "tpe"] = "grid"  # tpe: Optuna's TPE via Ray Tune's OptunaSearch
    # random / tpe: trials to sample (default 10); grid: must stay unset (the grid is run once).
    num_samples: int | None = Field(None, ge=1)
    scheduler: Literal["asha", "fifo"] = "asha"
    metric: Literal["val_top1", "val_top5", "val_loss", "train_loss"] = "val_top1"  # losses are minimised
    grace_period: int = Field(1, ge=1)  # ASHA: epochs every trial trains before it can be stopped
    reduction_factor: float = Field(2.0, gt=1.0)  # ASHA: keep the best 1/reduction_factor at each rung
    max_concurrent_trials: int | None = Field(None, ge=1)  # default: as many as the cluster's CPUs/GPUs fit
    trial_cpus: float = Field(1.0, gt=0.0)  # CPUs held by each trial's driver function, on top of its workers
    seed: int | None = Field(None, ge=0)  # sampling seed; default: run.seed

    _usable_storage = field_validator("storage_path")(_check_directory)

    @property
    def mode(self) -> Literal["max", "min"]:
        return "min" if self.metric.endswith("loss") else "max"


class DistillConfig(_Section):
    """DeiT hard-label distillation (papers 000, 002, 003 report distilled results): the student
    learns from (1 - alpha)·task loss + alpha·CE(student, argmax teacher). No teacher: off."""

    teacher: str | None = None  # a registered timm model name, e.g. regnety_160 (DeiT's teacher)
    teacher_args: dict[str, Any] = Field(default_factory=dict)  # its constructor overrides
    teacher_checkpoint: str | None = None  # its weights: .safetensors or a torch state dict
    alpha: float = Field(0.5, gt=0.0, le=1.0)  # DeiT: 0.5

    _usable_checkpoint = field_validator("teacher_checkpoint")(_check_file)

    @field_validator("teacher")
    @classmethod
    def _registered_teacher(cls, name: str | None) -> str | None:
        return None if name is None else check_registered(name)

    @model_validator(mode="after")
    def _teacher_needs_weights(self) -> DistillConfig:
        if self.teacher is not None and self.teacher_checkpoint is None:
            raise ValueError(f"teacher={self.teacher!r} needs teacher_checkpoint (a random teacher teaches nothing)")
        if self.teacher is None and (self.teacher_checkpoint or self.teacher_args):
            raise ValueError("teacher_checkpoint / teacher_args are set but distill.teacher is not")
        return self


class ExperimentConfig(_Section):
    """Everything one training run needs; sections mirror the pipeline's components."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)

    @model_validator(mode="after")
    def _ema_needs_whole_parameters(self) -> ExperimentConfig:
        if self.optim.ema_decay is not None and self.deepspeed.zero_stage == 3:
            raise ValueError(
                "optim.ema_decay needs every rank to hold whole parameters; deepspeed.zero_stage=3 "
                "partitions them: use zero_stage 0-2 with EMA"
            )
        return self

    @model_validator(mode="after")
    def _quasi_random_on_one_worker(self) -> ExperimentConfig:
        if self.data.order == "quasi_random" and self.scaling.num_workers > 1:
            raise ValueError(
                f"data.order='quasi_random' cannot be sharded across ranks by ffcv 1.0.2, and "
                f"scaling.num_workers={self.scaling.num_workers}: use data.order='random' (with data.os_cache=true "
                "on a node-local copy) or scaling.num_workers=1"
            )
        return self

    @model_validator(mode="after")
    def _precision_fits_hardware(self) -> ExperimentConfig:
        if self.deepspeed.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError(
                "deepspeed.precision='fp16' needs GPUs (scaling.use_gpu=true); on CPU use 'bf16' or 'fp32'"
            )
        return self

    def with_absolute_paths(self) -> ExperimentConfig:
        """A copy whose local paths are absolute: Ray workers run in another working directory."""
        distill = self.distill.model_copy(update={"teacher_checkpoint": uris.absolute(self.distill.teacher_checkpoint)})
        data = self.data.model_copy(update={key: uris.absolute(getattr(self.data, key))
                                            for key in ("train", "val", "cache_dir")})
        run = self.run.model_copy(update={"storage_path": uris.absolute(self.run.storage_path)})
        tune = self.tune.model_copy(update={"storage_path": uris.absolute(self.tune.storage_path)})
        return self.model_copy(update={"data": data, "run": run, "distill": distill, "tune": tune})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Every resolved value under its dotted key (MLflow params, sweep keys)."""
        return flatten(self.model_dump(mode="json"))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(source: str) -> dict[str, Any]:
    """A preset name (``smoke``) or a path to a YAML file."""
    path = Path(source)
    if path.suffix not in (".yaml", ".yml"):
        if source not in available_presets():
            raise ConfigError(
                f"config {source!r} is neither a preset ({', '.join(available_presets())}) nor a .yaml file"
            )
        path = PRESET_DIR / f"{source}.yaml"
    problem = location_problem(path, kind="file")
    if problem:
        raise ConfigError(f"config file: {problem}")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = load_yaml(read_utf8(path, "config file"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if not tree:
        # The schema's defaults are no preset's (300 epochs of another model): never run them by accident.
        raise ConfigError(
            f"config file {str(path)!r} is empty: it sets nothing. Start from a preset, e.g. "
            "`vitsweep config show --config default > my.yaml`, then edit it"
        )
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; a ConfigError naming the first undecodable byte if it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} "
            f"(line {line}); save it as UTF-8"
        ) from None


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives one key twice (PyYAML would keep the last value silently)."""


def load_yaml(text: str) -> Any:
    """``text`` read as ``yaml.safe_load`` reads it, but a key given twice in one mapping is a
    DuplicateKeyError naming the key (dotted from the top) and both lines: YAML requires unique keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias to a node already checked (or an anchor inside itself)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}.{index}" if path else str(index), seen)
    if not isinstance(node, yaml.MappingNode):
        return
    first_lines: dict[tuple[str, Any], int] = {}
    for key_node, value_node in node.value:
        key = (key_node.tag, key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node))
        dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
        line = key_node.start_mark.line + 1
        if key_node.tag != "tag:yaml.org,2002:merge" and key in first_lines:  # `<<:` merges may be overridden
            lines = f"line {line}" if first_lines[key] == line else f"lines {first_lines[key]} and {line}"
            raise DuplicateKeyError(f"{dotted} is given twice ({lines}); keep one (YAML would silently use the last)")
        first_lines[key] = line
        _refuse_duplicate_keys(value_node, dotted, seen)


# YAML 1.1 reads 1e-3 (no dot) as a string; a learning rate should be a number.
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def yaml_number(value: Any) -> Any:
    """``value`` with scientific-notation strings read as floats, in lists and mappings too."""
    if isinstance(value, str) and _SCIENTIFIC.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [yaml_number(v) for v in value]
    if isinstance(value, dict):
        return {k: yaml_number(v) for k, v in value.items()}
    return value


def parse_override(assignment: str) -> tuple[str, Any]:
    """``optim.lr=1e-3`` -> ("optim.lr", 0.001). Values are read as YAML scalars/lists."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    if any(not part for part in key.split(".")):
        raise ConfigError(f"override key {key!r} has an empty part")
    try:
        value = load_yaml(raw)
    except DuplicateKeyError as err:
        raise ConfigError(f"override {assignment!r}: {err}") from None
    except yaml.YAMLError:
        value = raw
    return key, yaml_number(value)


def get_dotted(tree: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value at dotted ``key`` of a config tree (``key.N``: list element N), else ``default``."""
    node: Any = tree
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in a config tree in place, creating sections on the way; ``key.N`` sets
    element N of a list-valued key (``model.args.mha_ratio_range.0``)."""
    head, _, tail = key.rpartition(".")
    if head and tail.isdigit() and not isinstance(get_dotted(tree, head), dict):
        current = get_dotted(tree, head)
        elements = list(current) if isinstance(current, (list, tuple)) else []
        elements += [None] * (int(tail) + 1 - len(elements))
        elements[int(tail)] = value
        key, value = head, elements
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def with_dotted(tree: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` with each dotted key of ``values`` set."""
    tree = copy.deepcopy(tree)
    for key, value in values.items():
        set_dotted(tree, key, value)
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for assignment in overrides:
        key, value = parse_override(assignment)
        try:
            set_dotted(tree, key, value)
        except ConfigError as err:
            raise ConfigError(f"override {assignment!r}: {str(err).partition(': ')[2]}") from None
    return tree


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def schema_problem(key: str) -> str | None:
    """Why dotted ``key`` names no value of the experiment config (valid keys listed), else None.

    ``model.args.<name>`` names a model constructor argument (checked by building the model); a
    trailing ``.N`` names element N of a tuple-valued key.
    """
    parts = key.split(".")
    if any(not part for part in parts):
        return f"{key!r} has an empty part; keys look like optim.lr or model.args.code_size"
    section: type[BaseModel] = ExperimentConfig
    for depth, part in enumerate(parts):
        fields = section.model_fields
        if part not in fields:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {'.'.join([*parts[:depth], close[0]])!r}?)" if close else ""
            return f"{key!r} is not a config key{hint}; valid keys under {prefix or 'the config'}: {', '.join(fields)}"
        annotation = fields[part].annotation
        if _is_section(annotation):
            section = annotation
            continue
        rest, here = parts[depth + 1:], ".".join(parts[:depth + 1])
        if typing.get_origin(annotation) is dict:  # model.args: the model's constructor arguments
            if not rest or not rest[0].isidentifier() or not all(p.isdigit() for p in rest[1:]):
                return (f"{key!r} must name one argument under {here}, e.g. {here}.code_size "
                        "(a trailing .N sets list element N)")
            return None
        if rest and not (len(rest) == 1 and rest[0].isdigit() and typing.get_origin(annotation) in (tuple, list)):
            return f"{key!r}: {here} is a value, not a section"
        return None
    return f"{key!r} is a whole section; name one of its keys: {', '.join(f'{key}.{name}' for name in section.model_fields)}"


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section holding ``loc`` (for 'unknown key' errors)."""
    section: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        if field is None or not _is_section(field.annotation):
            return []
        section = field.annotation
    return list(section.model_fields)


def describe_error(error: dict[str, Any], key: str, valid_keys: list[str]) -> str:
    """One pydantic error as a line naming the key, the value and what is allowed (configs, search spaces)."""
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key.rpartition(".")[2], valid_keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{key}: unknown key{hint}; valid keys here: {', '.join(valid_keys)}"
    if error["type"] == "missing":
        return f"{key}: missing; it is required"
    if error["type"] == SECRET_VALUE_ERROR:
        return f"{key}: {message}"
    return f"{key} = {uris.redact(repr(error['input']))}: {message}"


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "<config>"
    if error["type"] != "extra_forbidden" and _section_keys((*error["loc"], None)):
        return f"{key}: {error['msg'].removeprefix('Value error, ')}"  # a check across a section: its message names the keys
    return describe_error(error, key, _section_keys(error["loc"]))


def validate(tree: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as err:
        lines = [_describe(e) for e in err.errors(include_url=False)]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def load_config(source: str | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a preset or YAML file (default preset: ``default``), apply ``--set`` overrides, validate."""
    tree = _read_yaml(source or "default")
    return validate(apply_overrides(tree, list(overrides or [])))
