"""Checkpoints: DeepSpeed engine state + our training state, loaded with weights-only semantics.

A checkpoint directory holds DeepSpeed's files under the tag ``state`` (every rank writes its
ZeRO shards; Ray Train merges the ranks' directories into one), ``vitsweep_checkpoint.json``
(which model it belongs to, the epoch) and, at the end of a run, ``model.safetensors`` (full fp32
weights). Nothing is ever unpickled beyond tensors and plain containers.
"""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import ModelConfig
from pipeline.errors import InvalidInputError

DEEPSPEED_TAG = "state"
META_FILE = "vitsweep_checkpoint.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointMismatchError(InvalidInputError):
    """A checkpoint of another model (name, overrides, resolution or classes) than the config's."""


def weights_only_checkpoint_engine(config_params=None):
    """DeepSpeed's torch checkpoint engine, but loading with ``weights_only=True``.

    DeepSpeed's own engine unpickles arbitrary objects; a checkpoint from shared storage must
    not be able to run code. Tensors, numbers, strings and containers load; anything else fails.
    (Built on demand: importing DeepSpeed costs seconds the driver does not need to spend.)
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # ZeRO-1/2 optimizer shards pickle these plain state holders; only they are allowed besides
    # tensors and containers.
    deepspeed_state_types = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(deepspeed_state_types):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine(config_params)


def use_weights_only_loading(engine) -> None:
    engine.checkpoint_engine = weights_only_checkpoint_engine(engine._config)


def model_identity(cfg: ModelConfig, num_classes: int) -> dict[str, Any]:
    return {"name": cfg.name, "args": cfg.args, "img_size": cfg.img_size, "num_classes": num_classes}


def read_meta(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / META_FILE
    if not path.is_file():
        raise InvalidInputError(f"{checkpoint_dir} is not a vitsweep checkpoint (no {META_FILE})")
    return json.loads(path.read_text())


def check_same_model(meta: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    if meta["model"] != expected:
        changed = {k: (meta["model"].get(k), v) for k, v in expected.items() if meta["model"].get(k) != v}
        details = "; ".join(f"{k}: checkpoint {old!r} vs config {new!r}" for k, (old, new) in changed.items())
        raise CheckpointMismatchError(
            f"checkpoint {where} belongs to another model ({details}); use a new run.name to start afresh"
        )


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


def save_checkpoint(engine, directory: Path, *, epoch: int, identity: dict[str, Any], rank: int, ema=None) -> None:
    """Every rank calls this (ZeRO shards are per rank); rank 0 also writes the metadata."""
    client_state = {"epoch": epoch, f"rng_rank{rank}": rng_state()}
    if ema is not None:
        client_state["ema"] = ema.module.state_dict()
    engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state=client_state)
    if rank == 0:
        (directory / META_FILE).write_text(json.dumps({"model": identity, "epoch": epoch}, indent=2))


def load_checkpoint(engine, directory: Path, *, identity: dict[str, Any], rank: int, ema=None) -> int:
    """Restore model, optimizer, scheduler, EMA and RNG state; returns the epoch to start from."""
    check_same_model(read_meta(directory), identity, str(directory))
    _, client_state = engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG)
    if client_state is None:
        raise InvalidInputError(f"checkpoint {directory} has no DeepSpeed state under tag {DEEPSPEED_TAG!r}")
    if ema is not None:
        if "ema" not in client_state:
            raise InvalidInputError(f"checkpoint {directory} has no EMA weights, but optim.ema_decay is set")
        ema.module.load_state_dict(client_state["ema"])
    own_rng = client_state.get(f"rng_rank{rank}")
    if own_rng is not None:  # absent when resuming with more workers than the checkpoint had
        set_rng_state(own_rng)
    return int(client_state["epoch"]) + 1


EMA_WEIGHTS_FILE = "model_ema.safetensors"


def save_final_weights(engine, directory: Path, rank: int, ema=None) -> None:
    """Full fp32 weights as safetensors on rank 0 (gathered from all ranks under ZeRO-3)."""
    import deepspeed
    from safetensors.torch import save_model

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        if rank == 0:
            # save_model de-duplicates tensors shared between blocks (F-SNE, P-SNE).
            save_model(copy.deepcopy(engine.module).float(), str(directory / WEIGHTS_FILE))
            if ema is not None:
                save_model(ema.module, str(directory / EMA_WEIGHTS_FILE))
