"""Model building: a config's model section -> a timm model from vitsweep's registry."""
from __future__ import annotations

from contextlib import nullcontext

import timm
import torch
from torch import nn

import models  # noqa: F401  (registers vitsweep's variants with timm)
from pipeline.config import ModelConfig
from pipeline.errors import ConfigError


def build_model(cfg: ModelConfig, num_classes: int, device: str | torch.device | None = None) -> nn.Module:
    """``timm.create_model(cfg.name, **cfg.args)`` at the configured resolution.

    Constructor errors (an unknown override, an invalid combination) become a ConfigError naming
    ``model.args`` so they surface before any cluster work starts.
    """
    try:
        with torch.device(device) if device is not None else nullcontext():
            return timm.create_model(
                cfg.name,
                num_classes=num_classes,
                img_size=cfg.img_size,
                drop_path_rate=cfg.drop_path_rate,
                **cfg.args,
            )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.name={cfg.name!r} with model.args={cfg.args!r} cannot be built: {err}") from None


def check_buildable(cfg: ModelConfig, num_classes: int = 1000) -> int:
    """Build on the meta device (no memory, no compute) to validate the overrides; returns #params."""
    model = build_model(cfg, num_classes, device="meta")
    return sum(p.numel() for p in model.parameters())

