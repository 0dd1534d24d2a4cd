"""Checkpoints: DeepSpeed engine state + our training state, loaded with weights-only semantics.

A checkpoint directory holds DeepSpeed's files under the tag ``state`` (every rank writes its
ZeRO shards; Ray Train merges the ranks' directories into one), ``vitsweep_checkpoint.json``
(which model it belongs to, the epoch, the world size, and for one taken within an epoch
(``run.checkpoint_every_steps``) the optimizer steps of that epoch it holds) and, at the end of a run,
``model.safetensors`` (full fp32 weights). Nothing is ever unpickled beyond tensors and plain
containers.

Each rank writes last a manifest of its files (name, size, SHA-256), ``vitsweep_manifest_rank<r>.json``:
``verify_checkpoint`` names the file a truncated or overwritten checkpoint lost, and
``checkpoint_to_resume`` falls back to the newest intact checkpoint instead of failing on the same
bad file at every restart.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import pickle
import random
import sys
import zipfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config.schema import ModelConfig
from pipeline.console import library_prints
from pipeline.atomic import write_text_atomically
from pipeline.data.sidecar import sha256_of
from pipeline.errors import InvalidInputError

DEEPSPEED_TAG = "state"
META_FILE = "vitsweep_checkpoint.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_PREFIX = "vitsweep_manifest_rank"
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load's switch making every load weights-only
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # its opposite, which torch refuses beside it
log = logging.getLogger(__name__)


class CheckpointMismatchError(InvalidInputError):
    """A checkpoint of another model (name, overrides, resolution or classes) than the config's."""


class CorruptCheckpointError(InvalidInputError):
    """A checkpoint file is missing, truncated or overwritten: its bytes are not what its rank wrote."""


def weights_only_checkpoint_engine(config_params=None):
    """DeepSpeed's torch checkpoint engine, but loading with ``weights_only=True``.

    DeepSpeed's own engine unpickles arbitrary objects; a checkpoint from shared storage must
    not be able to run code. Tensors, numbers, strings and containers load; anything else fails.
    (Built on demand: importing DeepSpeed costs seconds the driver does not need to spend.)
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(deepspeed_state_types()):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine(config_params)


def deepspeed_state_types() -> list[type]:
    """The plain state holders ZeRO-1/2 optimizer shards pickle: the only classes a weights-only
    load of DeepSpeed's files allows besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def use_weights_only_loading(engine) -> None:
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine._config)


def model_identity(cfg: ModelConfig, num_classes: int) -> dict[str, Any]:
    return {"name": cfg.name, "args": cfg.args, "img_size": cfg.img_size, "num_classes": num_classes}


def read_meta(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / META_FILE
    if not path.is_file():
        raise InvalidInputError(f"{checkpoint_dir} is not a vitsweep checkpoint (no {META_FILE})")
    return _read_json(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"checkpoint file {str(path)!r} is not readable JSON ({err})") from None
    if not isinstance(record, dict):
        raise CorruptCheckpointError(f"checkpoint file {str(path)!r} holds {type(record).__name__}, not a record")
    return record


def check_same_model(meta: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    if meta["model"] != expected:
        changed = {k: (meta["model"].get(k), v) for k, v in expected.items() if meta["model"].get(k) != v}
        details = "; ".join(f"{k}: checkpoint {old!r} vs config {new!r}" for k, (old, new) in changed.items())
        raise CheckpointMismatchError(
            f"checkpoint {where} belongs to another model ({details}); use a new run.name to start afresh"
        )


RNG_FILE_PREFIX = "rng_rank"


def rng_state() -> dict[str, Any]:
    """Every RNG a training step draws from, as tensors and ints (weights-only loadable)."""
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "numpy": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_pos": int(numpy_state[2]),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"]))


STEPS_DONE = "steps_done"  # a mid-epoch checkpoint's optimizer steps of its epoch (metadata, client state)
INITIAL_METRICS = "initial_metrics"  # ... and in epoch 0, the initial weights' metrics, not yet reported


def checkpoint_score_order(score: str) -> str:
    """Ray's order for ``run.checkpoint_score``: a loss is better lower, any other metric higher."""
    return "min" if score.endswith("loss") else "max"


def unranked_score(score: str) -> float:
    """The score a checkpoint within an epoch reports (it has no epoch's metrics): the worst finite one in the
    score's order, so Ray ranks it below every scored checkpoint. Not NaN: Ray's record of its checkpoints
    writes NaN as null, which it cannot rank once a re-run reads the record back."""
    return -sys.float_info.max if checkpoint_score_order(score) == "max" else sys.float_info.max


@dataclass(frozen=True)
class ResumePoint:
    """Where a run goes on from a checkpoint: ``epoch`` (0-based), after ``steps_done`` of its optimizer
    steps (a checkpoint taken within the epoch; 0: the epoch from its start); ``initial_metrics``: what the
    run measured of its initial weights, saved within epoch 0 for that epoch's report."""

    epoch: int
    steps_done: int = 0
    initial_metrics: dict[str, float] = field(default_factory=dict)


def resume_point(meta: dict[str, Any]) -> ResumePoint:
    """A checkpoint's metadata (or client state): one taken at an epoch's end resumes at the next epoch."""
    epoch = int(meta["epoch"])
    if STEPS_DONE not in meta:
        return ResumePoint(epoch + 1)
    return ResumePoint(epoch, int(meta[STEPS_DONE]), dict(meta.get(INITIAL_METRICS, {})))


def save_checkpoint(engine, directory: Path, *, epoch: int, identity: dict[str, Any], rank: int, ema=None,
                    card: dict[str, Any] | None = None, steps_done: int | None = None,
                    initial_metrics: dict[str, float] | None = None) -> None:
    """Every rank calls this (ZeRO shards are per rank); rank 0 also writes the metadata, with the
    model's ``card`` (``ModelCard.as_dict()``: what a model source started from it needs). Each rank
    writes its RNG state to a file of its own: under ZeRO 0-2 DeepSpeed keeps only rank 0's client state.
    ``steps_done``: a checkpoint within ``epoch``, after that many of its optimizer steps (None: at its end),
    with ``initial_metrics`` not yet reported (a run from trained weights, within its first epoch)."""
    within = {} if steps_done is None else {STEPS_DONE: steps_done}
    client_state = {"epoch": epoch, **within, **({INITIAL_METRICS: initial_metrics} if initial_metrics else {})}
    if ema is not None:
        client_state["ema"] = ema.module.state_dict()
    engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state=client_state)
    torch.save(rng_state(), directory / f"{RNG_FILE_PREFIX}{rank}.pt")
    if rank == 0:
        meta = {"model": identity, "epoch": epoch, **within, "world_size": engine.world_size,
                **({"card": card} if card is not None else {})}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
    write_manifest(directory, rank)


def load_checkpoint(engine, directory: Path, *, identity: dict[str, Any], rank: int, ema=None) -> ResumePoint:
    """Restore model, optimizer, scheduler, EMA and RNG state; returns where training goes on."""
    check_same_model(read_meta(directory), identity, str(directory))
    if not any((Path(directory) / DEEPSPEED_TAG).glob("*model_states.pt")):  # DeepSpeed's own check: a bare assert
        raise InvalidInputError(f"checkpoint {directory} has no DeepSpeed state under tag {DEEPSPEED_TAG!r}")
    _, client_state = engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG)  # with a tag: never None
    if ema is not None:
        if "ema" not in client_state:
            raise InvalidInputError(f"checkpoint {directory} has no EMA weights, but optim.ema_decay is set")
        ema.module.load_state_dict(client_state["ema"])
    own_rng = Path(directory) / f"{RNG_FILE_PREFIX}{rank}.pt"
    if own_rng.is_file():  # absent when resuming with more workers than the checkpoint had
        set_rng_state(torch.load(own_rng, weights_only=True))
    elif f"rng_rank{rank}" in client_state:  # a checkpoint written before the per-rank files: rank 0's
        set_rng_state(client_state[f"rng_rank{rank}"])
    return resume_point(client_state)


EMA_WEIGHTS_FILE = "model_ema.safetensors"


def save_final_weights(engine, directory: Path, rank: int, ema=None) -> None:
    """Full fp32 weights as safetensors on rank 0; every rank calls this (the gathers are collective).

    Each parameter is the optimizer's fp32 master copy where it keeps one: under bf16 (or fp16) the
    module holds only a rounded copy of it. Buffers, and the parameters of plain fp32 training, are
    the module's (gathered from all ranks under ZeRO-3)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_model

    named = list(engine.module.named_parameters())
    masters = {name: safe_get_full_fp32_param(param) for name, param in named}  # None: no master copy
    with deepspeed.zero.GatheredParameters([param for _, param in named], modifier_rank=None,
                                           enabled=engine.zero_optimization_stage() == 3):
        if rank == 0:
            final = copy.deepcopy(engine.module).float()
            with torch.no_grad():
                for name, param in final.named_parameters():
                    if masters[name] is not None:
                        param.copy_(masters[name].detach().cpu())
            # save_model de-duplicates tensors shared between blocks (F-SNE, P-SNE).
            save_model(final, str(directory / WEIGHTS_FILE))
            if ema is not None:
                save_model(ema.module, str(directory / EMA_WEIGHTS_FILE))
            write_manifest(directory, rank)  # again: the weights are this rank's files too


def checkpoint_state_dict(directory: str | Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint's DeepSpeed state, loaded weights-only on the CPU.

    ZeRO 1-3: the fp32 master weights, consolidated from every rank's optimizer shard by
    DeepSpeed's own ``zero_to_fp32``. No ZeRO: the module's state as saved (in the training
    precision). ``ema``: the EMA's fp32 weights from rank 0's client state (stages 0-2; ZeRO-3
    trains no EMA). Verify the checkpoint first (``verify_checkpoint``): this reads what is there.
    """
    directory = Path(directory)
    state = directory / DEEPSPEED_TAG
    model_states = state / "mp_rank_00_model_states.pt"  # rank 0's, stages 0-2: module and client state
    try:
        if ema:
            client_state = _load_deepspeed_file(model_states) if model_states.is_file() else {}
            if "ema" not in client_state:
                raise InvalidInputError(f"checkpoint {str(directory)!r} holds no EMA weights: it was trained "
                                        "without optim.ema_decay")
            return client_state["ema"]
        if any(state.glob("*_optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with _weights_only_loads(), library_prints():
                return get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DEEPSPEED_TAG)
        return _load_deepspeed_file(model_states)["module"]
    except InvalidInputError:
        raise
    except (OSError, EOFError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as err:
        raise CorruptCheckpointError(
            f"checkpoint {str(directory)!r}: its DeepSpeed state under {DEEPSPEED_TAG!r} cannot be read as weights "
            f"({type(err).__name__}: {err})"
        ) from None


def _load_deepspeed_file(path: Path) -> dict[str, Any]:
    with torch.serialization.safe_globals(deepspeed_state_types()):
        return torch.load(path, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` in the block weights-only, DeepSpeed's state holders allowed: zero_to_fp32
    asks for ``weights_only=False``, which torch's own switch overrides (process-wide, for the block).
    A user's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is lifted for the block: torch fails every load with both set."""
    previous = {name: os.environ.pop(name, None) for name in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_state_types()):
            yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def write_manifest(directory: Path, rank: int) -> Path:
    """Record every file in ``directory`` (this rank's own, before Ray merges the ranks') with its
    size and SHA-256; written last and atomically, so a manifest vouches for complete files."""
    manifest = directory / f"{MANIFEST_PREFIX}{rank}.json"
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(MANIFEST_PREFIX))
    entries = [{"name": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "sha256": sha256_of(p)}
               for p in files]
    write_text_atomically(manifest, json.dumps({"rank": rank, "files": entries}, indent=1) + "\n")
    return manifest


def verify_checkpoint(directory: str | Path) -> None:
    """Raise a CorruptCheckpointError naming the file unless every rank's files are as it wrote them.

    A checkpoint written before manifests existed is checked by the CRC-32 of every entry of its
    torch archives (what torch's reader would trip over), and its metadata's JSON.
    """
    directory = Path(directory)
    meta = read_meta(directory)
    manifests = sorted(directory.glob(f"{MANIFEST_PREFIX}*.json"))
    if not manifests:
        for archive in sorted(directory.rglob("*.pt")):
            _check_torch_archive(archive)
        return
    world_size = meta.get("world_size")
    if world_size is not None and len(manifests) != world_size:
        found = sorted(p.name for p in manifests)
        raise CorruptCheckpointError(
            f"checkpoint {str(directory)!r} was written by {world_size} ranks but holds the manifests of "
            f"{len(manifests)} ({found}): a rank's files are missing"
        )
    for manifest in manifests:
        entries = _read_json(manifest).get("files")
        if not isinstance(entries, list):  # a manifest vouching for nothing must not pass as intact
            raise CorruptCheckpointError(f"checkpoint file {str(manifest)!r} lists no files: it is not a manifest "
                                         "vitsweep wrote")
        for entry in entries:
            _check_entry(directory, entry, manifest.name)


def _check_entry(directory: Path, entry: dict[str, Any], manifest: str) -> None:
    path = directory / entry["name"]
    if not path.is_file():
        raise CorruptCheckpointError(f"checkpoint file {str(path)!r} is missing (listed in {manifest})")
    size = path.stat().st_size
    if size != entry["size"]:
        raise CorruptCheckpointError(
            f"checkpoint file {str(path)!r} is {size} bytes, {entry['size']} were written (truncated or "
            f"overwritten; listed in {manifest})"
        )
    if sha256_of(path) != entry["sha256"]:
        raise CorruptCheckpointError(
            f"checkpoint file {str(path)!r} does not hash to the SHA-256 its rank recorded in {manifest}: "
            "its bytes changed after writing"
        )


def _check_torch_archive(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CorruptCheckpointError(f"checkpoint file {str(path)!r} is not a whole torch archive ({err})") from None
    if bad is not None:
        raise CorruptCheckpointError(f"checkpoint file {str(path)!r}: entry {bad!r} fails its CRC-32 check")


def checkpoints_newest_first(run_dir: str | Path, ignore: Collection[Path] = ()) -> list[Path]:
    """The vitsweep checkpoints in a Ray Train run directory (leaving out ``ignore``), the furthest into
    training first (an epoch's end after its mid-epoch ones; then latest written)."""
    def progress(directory: Path) -> tuple[float, float]:
        try:
            point = resume_point(read_meta(directory))
        except (InvalidInputError, KeyError, TypeError, ValueError):
            return -1, -1  # unreadable metadata sorts last; verification names the problem
        return (point.epoch, point.steps_done) if point.steps_done else (point.epoch - 1, math.inf)

    found = [d for d in Path(run_dir).iterdir() if d.is_dir() and (d / META_FILE).exists() and d not in ignore]
    return sorted(found, key=lambda d: (*progress(d), (d / META_FILE).stat().st_mtime_ns), reverse=True)


def latest_intact_checkpoint(run_dir: str | Path, ignore: Collection[Path] = ()) -> Path | None:
    """The newest checkpoint in ``run_dir`` that passes ``verify_checkpoint``; each newer one that
    does not is named in a warning. None when there is none."""
    if not Path(run_dir).is_dir():
        return None
    for directory in checkpoints_newest_first(run_dir, ignore):
        try:
            verify_checkpoint(directory)
        except CorruptCheckpointError as err:
            log.warning("skipping a corrupt checkpoint: %s", err)
            continue
        return directory
    return None


def checkpoint_to_resume(handed: str | Path | None, run_dir: str | Path | None) -> Path | None:
    """The checkpoint a (re)started worker should load: the one Ray handed it if intact, else the
    newest intact one beside it, with a warning; None (start afresh, with a warning) when no
    intact one is left, so that a restart never fails again on the same bad file."""
    if handed is None:
        return None
    try:
        verify_checkpoint(handed)
        return Path(handed)
    except CorruptCheckpointError as err:
        fallback = latest_intact_checkpoint(run_dir) if run_dir is not None else None
        if fallback is not None:
            log.warning("%s; resuming from the newest intact checkpoint %s instead", err, fallback)
        else:
            log.warning("%s; no intact checkpoint is left, so training starts again from epoch 0", err)
        return fallback


def check_run_checkpoints(run_dir: str | Path, ignore: Collection[Path] = ()) -> Path | None:
    """Before any worker starts: the newest intact checkpoint (leaving out ``ignore``) a re-run of
    ``run_dir`` can resume from (newer corrupt ones are named in warnings), None when it has no checkpoint, and a
    CorruptCheckpointError when it has checkpoints but none is intact."""
    if not Path(run_dir).is_dir():
        return None
    found = checkpoints_newest_first(run_dir, ignore)
    if not found:
        return None
    intact = latest_intact_checkpoint(run_dir, ignore)
    if intact is None:
        try:
            verify_checkpoint(found[0])
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(
                f"none of the {len(found)} checkpoints of run {str(run_dir)!r} is intact (the newest: {err}); "
                "choose a new run.name to start afresh, or remove the run directory"
            ) from None
    return intact
