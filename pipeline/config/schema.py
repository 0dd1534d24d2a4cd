"""The experiment config's schema: one validated object, the source of truth for every run.

Each section is a pydantic model whose fields carry their defaults and limits; a config never holds an
invalid value (unknown keys, out-of-range numbers and unusable paths are refused on load and on
assignment: ``pipeline.config.fields``). Everything downstream (DeepSpeed JSON, Ray scaling, FFCV
pipelines, MLflow params) is derived from this object, never re-typed. Defaults follow the DeiT recipe the
papers train with. Reading it from presets, YAML files and ``--set`` overrides is ``pipeline.config.loading``'s.
"""
from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipeline import uris
from pipeline.config.fields import (SECRET_VALUE_ERROR, Section, check_directory, check_file, check_location,
    check_registered)
from pipeline.config.specs import MetricTarget, ReportedMetric, profiled_steps
from pipeline.uris import uri_password_problem


class ModelConfig(Section):
    """Which registered model to build, and the keyword overrides it is built with."""

    name: str = "xcit_nano_12_p16"
    # Keyword overrides for timm.create_model(name, **args): qkv, code_size, head, mgcrp_heads, ...
    args: dict[str, Any] = Field(default_factory=dict)
    img_size: int = Field(32, ge=8, le=1024)
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0)
    # Trained weights to start from (``pipeline.trained.transfer``), any model source: a run's name under
    # run.storage_path or its directory, a checkpoint directory, a .safetensors or torch state dict file,
    # runs:/RUN_ID/model, models:/MODEL_ID, models:/NAME/VERSION or models:/NAME@ALIAS. null: random init.
    init_from: str | None = Field(None, min_length=1)
    init_ema: bool = False  # start from the source's EMA weights
    # fnmatch globs of weights left at their fresh initialisation on purpose (e.g. "head.*": a new head
    # for another task with the same class count); besides these, the head is new when the class count
    # differs and position embeddings are resampled to a new token grid.
    init_exclude: tuple[str, ...] = ()
    # backbone: a linear probe, only the classifier head (get_classifier()) trains; the rest stays as
    # loaded and runs in eval mode (no dropout, BatchNorm on its running statistics).
    freeze: Literal["none", "backbone"] = "none"

    _usable_source = field_validator("init_from")(check_location)

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


class AugmentConfig(Section):
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


class ProgressiveResolutionConfig(Section):
    """Progressive resizing (ffcv-imagenet's ``resolution`` section): the training crops grow from
    ``start_size`` to ``model.img_size``, linearly from epoch ``start_epoch`` (its last epoch at
    ``start_size``) to ``end_epoch`` (its first at ``model.img_size``), each size rounded to the model's
    patch; the epochs from ``end_epoch`` on and every evaluation run at ``model.img_size``. Epochs count
    from 1, as the console counts them (``pipeline.data.progressive_resolution``)."""

    start_size: int = Field(ge=8, le=1024)
    start_epoch: int = Field(1, ge=1)
    end_epoch: int = Field(ge=2)

    @model_validator(mode="after")
    def _ramp_goes_forward(self) -> ProgressiveResolutionConfig:
        if self.start_epoch >= self.end_epoch:
            raise ValueError(f"start_epoch={self.start_epoch} must come before end_epoch={self.end_epoch}: the "
                             "crops grow between them")
        return self


class DataConfig(Section):
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
    # Repeated augmentation (DeiT's and XCiT's RASampler, pipeline.data.repeated_augmentation): each image
    # this many times per epoch, on different ranks, in an epoch of the dataset's length; null: off. XCiT: 3.
    repeated_augmentation: int | None = Field(None, ge=2)
    # Training crops that grow over the epochs up to model.img_size (ProgressiveResolutionConfig); null: every
    # epoch at model.img_size.
    progressive: ProgressiveResolutionConfig | None = None
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

    _usable_locations = field_validator("train", "val")(check_file)
    _usable_cache = field_validator("cache_dir")(check_directory)

    @model_validator(mode="after")
    def _repeats_are_shuffled(self) -> DataConfig:
        if self.repeated_augmentation is not None and self.order != "random":
            raise ValueError(f"repeated_augmentation={self.repeated_augmentation} shuffles the epoch itself, so it "
                             f"takes the place of order={self.order!r}: leave data.order at 'random'")
        return self

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


class ScheduleConfig(Section):
    """Per-step learning-rate schedule: linear warmup, then cosine decay (DeiT recipe).

    The schedule peaks at the run's learning rate (``optim.lr``, or ``optim.lr_per_512`` scaled to
    the global batch); ``warmup_lr`` and ``min_lr`` are absolute rates, not scaled, as in DeiT.
    """

    name: Literal["cosine", "constant"] = "cosine"
    warmup_epochs: float = Field(5.0, ge=0.0)
    warmup_lr: float = Field(1e-6, ge=0.0)  # the warmup rises linearly from here to the peak
    min_lr: float = Field(1e-5, ge=0.0)  # the cosine falls from the peak to here
    # The last epochs held at min_lr after the cosine has reached it (timm's --cooldown-epochs: SoT's
    # main.py trains its 300-epoch cosine plus 10 such epochs, the 310 of its Table S-3). cosine only.
    cooldown_epochs: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _cooldown_follows_a_cosine(self) -> ScheduleConfig:
        if self.cooldown_epochs and self.name != "cosine":
            raise ValueError(f"cooldown_epochs={self.cooldown_epochs:g} holds the rate at min_lr after a cosine; "
                             f"name={self.name!r} has none: set name=cosine or cooldown_epochs=0")
        return self


# The two values a run derives from its optim section and world size (pipeline.components.lr_scaling), under the
# dotted keys MLflow records them by beside the config's own; paper recipes (pipeline.config.papers) cite them.
EFFECTIVE_LR_PARAM = "optim.lr_effective"
GLOBAL_BATCH_PARAM = "optim.global_batch_size"
LR_REFERENCE_BATCH = 512  # optim.lr_per_512 is the rate at this global batch (DeiT: 5e-4 per 512)


class OptimConfig(Section):
    """AdamW and the batch geometry; global batch = micro_batch_size x grad_accum_steps x world size.

    The learning rate is given one way: ``lr`` (absolute) or ``lr_per_512`` (per 512 images of
    global batch, scaled to the run's batch by ``lr_scaling``); ``pipeline.components.lr_scaling`` computes the
    rate a run trains at. A config whose global batch depends on the cluster (``cluster/jobs/``)
    gives ``lr_per_512``, so changing ``scaling.num_workers`` or the micro batch needs no lr edit.
    """

    # AdamW's rate, absolute: the same whatever the global batch. null when lr_per_512 gives the
    # rate; with neither given, DeiT's 5e-4 (pipeline.components.lr_scaling.DEFAULT_LR), absolute.
    lr: float | None = Field(None, gt=0.0)
    # DeiT's convention (5e-4 per 512): the rate at a global batch of 512 images; the run trains at
    # this rate scaled to its global batch by lr_scaling (pipeline.components.lr_scaling).
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

    @model_validator(mode="after")
    def _schedule_fits_the_epochs(self) -> OptimConfig:
        schedule = self.schedule
        if schedule.cooldown_epochs and schedule.warmup_epochs + schedule.cooldown_epochs >= self.epochs:
            raise ValueError(f"schedule.warmup_epochs={schedule.warmup_epochs:g} + schedule.cooldown_epochs="
                             f"{schedule.cooldown_epochs:g} leave no epoch of the {self.epochs} for the cosine: lower either")
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


class DeepSpeedConfig(Section):
    """The DeepSpeed engine: ZeRO stage and precision (the JSON is derived from the whole config)."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer state to CPU (stages 1-3)
    # GPUs: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa, ~8x IEEE fp32 on
    # A100), as timm and DeiT train; false keeps IEEE fp32. Ignored on CPU.
    tf32: bool = True
    # torch.compile the model through DeepSpeed's engine.compile(): a one-off compile of tens of
    # seconds per worker for faster steps; see benchmarks/RESULTS.md.
    compile: bool = False
    # its backend, as timm's --torchcompile names it: inductor generates fused kernels; cudagraphs
    # replays CUDA graphs; aot_eager captures and differentiates the same graphs without generating
    # code (seconds, not a minute: a check that the model compiles).
    compile_backend: Literal["inductor", "cudagraphs", "aot_eager"] = "inductor"
    # Under bf16/fp16, sum the gradients across ranks in fp32 (DeepSpeed's communication_data_type):
    # DeepSpeed's default reduces in the training precision, whose 8 significant bits (bf16) drop a
    # small rank's share of a 64-rank sum. The cost: twice the bytes each step sends. No effect in fp32.
    reduce_in_fp32: bool = True

    @model_validator(mode="after")
    def _backend_needs_compile(self) -> DeepSpeedConfig:
        if self.compile_backend != "inductor" and not self.compile:  # the default's value, not whether set: a
            # dumped config (a worker's, a checkpoint's) holds every key
            raise ValueError(f"compile_backend={self.compile_backend} needs compile=true: nothing is compiled")
        return self

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> DeepSpeedConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3, got zero_stage=0")
        return self


class ScalingConfig(Section):
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


class TrackingConfig(Section):
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


class RunConfig(Section):
    """Identity, storage, checkpointing and fault tolerance of one training run."""

    name: str | None = None
    storage_path: str = "./vitsweep-runs"
    seed: int = Field(0, ge=0)
    checkpoint_every: int = Field(1, ge=1)  # epochs between checkpoints
    checkpoint_every_steps: int | None = Field(None, ge=1)  # also within epochs (a restart resumes mid-epoch)
    num_to_keep: int = Field(2, ge=1)
    checkpoint_score: ReportedMetric = "val_top1"
    max_failures: int = Field(0, ge=-1)  # -1: retry forever
    # Steps between logging steps, each one all_gather of the step-health window (the divergence check,
    # the progress line, the health/ step metrics): syncing the host with the device every step would stall the GPU.
    log_every_steps: int = Field(20, ge=1)
    # A logging window whose max loss exceeds this x the running median of the windows' mean losses is a
    # loss spike (logged: health/loss_spikes, and a line); after max_loss_spikes of them the run stops as
    # diverged (null: never).
    loss_spike_factor: float = Field(5.0, gt=1.0)
    max_loss_spikes: int | None = Field(None, ge=1)
    # steps:N: a torch profiler trace of N training steps on rank 0 (pipeline.components.profiling),
    # logged as the run's profile/ artifacts. null: no profiler.
    profile: str | None = None
    # METRIC>=VALUE or METRIC<=VALUE (e.g. val_top1>=75): the first epoch that reaches it logs the wall
    # time and accelerator-hours it took (pipeline.training.cost). null: no target.
    target_metric: str | None = None

    _usable_storage = field_validator("storage_path")(check_directory)

    @field_validator("target_metric", mode="before")
    @classmethod
    def _target_spec(cls, spec: Any) -> Any:
        if spec is not None:
            MetricTarget.parse(str(spec))
        return spec

    @property
    def target(self) -> MetricTarget | None:
        return None if self.target_metric is None else MetricTarget.parse(self.target_metric)

    @field_validator("profile", mode="before")
    @classmethod
    def _profile_spec(cls, spec: Any) -> Any:
        if spec is not None:  # `--set run.profile=5` reads as a number: said the same way as any other spec
            profiled_steps(spec if isinstance(spec, str) else str(spec))
        return spec

    @property
    def profile_steps(self) -> int | None:
        """The training steps ``run.profile`` asks to trace, or None."""
        return None if self.profile is None else profiled_steps(self.profile)


class TuneConfig(Section):
    """A Ray Tune sweep (`vitsweep tune`): searcher, scheduler, budget. `vitsweep train` ignores it.

    Every trial trains with this config's `scaling` (its own Ray Train workers) plus a trial function
    that drives them: on a head's trial slot where the cluster offers them, else holding ``trial_cpus``;
    see README "Sweeps" for how that is sized.
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
    # CPUs held by each trial's function beside its workers; unused where the head offers trial slots
    trial_cpus: float = Field(1.0, gt=0.0)
    seed: int | None = Field(None, ge=0)  # sampling seed; default: run.seed
    # Accelerator-hours (GPU-hours; CPU-core-hours on CPU) the sweep may spend: once its trials' spend
    # reaches it, no further trial starts, the running ones finish, and the sweep ends resumable
    # (`vitsweep tune --resume DIR --set tune.budget_hours=MORE`). null: no budget.
    budget_hours: float | None = Field(None, gt=0.0)

    _usable_storage = field_validator("storage_path")(check_directory)

    @property
    def mode(self) -> Literal["max", "min"]:
        return "min" if self.metric.endswith("loss") else "max"


class DistillConfig(Section):
    """DeiT's distillation (papers 000, 002, 003 report distilled results): the student learns from
    (1 - alpha)·task loss + alpha·distillation loss, hard (CE to the teacher's argmax) or soft (KL to
    the teacher's softmax at temperature tau). No teacher: off."""

    teacher: str | None = None  # a registered timm model name, e.g. regnety_160 (DeiT's teacher)
    teacher_args: dict[str, Any] = Field(default_factory=dict)  # its constructor overrides
    teacher_checkpoint: str | None = None  # its weights: .safetensors or a torch state dict
    # Or the teacher as a trained model, any model source (a run's name or directory, a checkpoint directory,
    # runs:/RUN_ID/model, models:/MODEL_ID, models:/NAME/VERSION or @ALIAS, a downloaded MLflow model): its card
    # names the architecture and the normalisation it was trained with (pipeline.trained.teacher).
    teacher_from: str | None = Field(None, min_length=1)
    teacher_ema: bool = False  # teacher_from's EMA weights (as model.init_ema)
    kind: Literal["hard", "soft"] = "hard"  # DeiT's --distillation-type
    alpha: float = Field(0.5, gt=0.0, le=1.0)  # DeiT: 0.5
    tau: float = Field(1.0, gt=0.0)  # soft only; DeiT's main.py: 1.0 (its paper's soft row: 3.0 with alpha 0.1)

    _usable_checkpoint = field_validator("teacher_checkpoint")(check_file)
    _usable_source = field_validator("teacher_from")(check_location)

    @property
    def enabled(self) -> bool:
        """Whether the run distils: a teacher is given, either way."""
        return self.teacher is not None or self.teacher_from is not None

    @field_validator("teacher")
    @classmethod
    def _registered_teacher(cls, name: str | None) -> str | None:
        return None if name is None else check_registered(name)

    @model_validator(mode="after")
    def _teacher_needs_weights(self) -> DistillConfig:
        if self.teacher_ema and self.teacher_from is None:
            raise ValueError("teacher_ema takes the EMA weights of distill.teacher_from, which is not set")
        if self.teacher_from is not None and (self.teacher or self.teacher_checkpoint or self.teacher_args):
            raise ValueError("teacher_from gives the teacher whole (its card names the model); teacher, teacher_args "
                             "and teacher_checkpoint give it as a timm name and a weights file: give one of the two")
        if self.teacher is not None and self.teacher_checkpoint is None:
            raise ValueError(f"teacher={self.teacher!r} needs teacher_checkpoint (a random teacher teaches nothing)")
        if self.teacher is None and (self.teacher_checkpoint or self.teacher_args):
            raise ValueError("teacher_checkpoint / teacher_args are set but distill.teacher is not")
        if self.kind == "hard" and self.tau != type(self).model_fields["tau"].default:  # a written-out config holds the default
            raise ValueError(f"tau={self.tau:g} applies to kind=soft only (hard distillation takes the teacher's "
                             "argmax): set distill.kind=soft, or leave tau out")
        return self


class ExperimentConfig(Section):
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
    def _distillation_token_needs_a_teacher(self) -> ExperimentConfig:
        from models import VARIANTS

        facts = VARIANTS.get(self.model.name)
        if facts is not None and facts.distillation_token and not self.distill.enabled:
            raise ValueError(f"model.name={self.model.name} has DeiT's distillation token, which learns from a "
                             "teacher: set distill.teacher_from, or distill.teacher and distill.teacher_checkpoint, or "
                             "train the model without the token")
        return self

    @model_validator(mode="after")
    def _progressive_resolution_ends_at_the_models_size(self) -> ExperimentConfig:
        progressive = self.data.progressive
        if progressive is None:
            return self
        if progressive.start_size >= self.model.img_size:
            raise ValueError(f"data.progressive.start_size={progressive.start_size} must be below model.img_size="
                             f"{self.model.img_size}, the size the crops grow to")
        if progressive.end_epoch > self.optim.epochs:
            raise ValueError(f"data.progressive.end_epoch={progressive.end_epoch} is past optim.epochs="
                             f"{self.optim.epochs}: the run would end before training at model.img_size")
        return self

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
    def _ema_metrics_are_reported(self) -> ExperimentConfig:
        target, score = self.run.target.metric if self.run.target else "", self.run.checkpoint_score
        for key, metric in (("target_metric", target), ("checkpoint_score", score)):
            if metric.endswith("_ema") and self.optim.ema_decay is None:
                raise ValueError(f"run.{key} names the EMA's {metric}, but optim.ema_decay is null (no EMA); set "
                                 f"optim.ema_decay or use {metric.removesuffix('_ema')}")
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
