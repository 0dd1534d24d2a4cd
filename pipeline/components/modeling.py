"""Model building: a config's model section -> a timm model from vitsweep's registry."""
from __future__ import annotations

from contextlib import nullcontext

import timm
import torch
from torch import nn

import models  # noqa: F401  (registers vitsweep's variants with timm)
from pipeline.config.schema import ModelConfig
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


class _Unbuildable(Exception):
    """Why a model section cannot train (a message without the section, shown beside the knobs)."""


def _checked_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """The model on the meta device, built *and* run (shapes only, no memory, no compute).

    The build catches bad arguments (``svpn_alpha=1.5``, an unknown ``code_sise``); the forward
    pass the constraints a constructor cannot see (``num_heads=5`` not dividing the channels, an
    ``img_size`` the patch size does not divide).
    """
    try:
        module = build_model(cfg, num_classes, device="meta")
    except Exception as err:  # noqa: BLE001  (timm's constructors also assert; any failure is a bad config)
        # build_model's message repeats the whole model section; callers show the knobs beside it.
        raise _Unbuildable(f"{cfg.name} cannot be built: "
                           f"{str(err).partition(' cannot be built: ')[2] or _reason(err)}") from None
    try:
        with torch.no_grad():
            module.eval()(torch.empty(2, 3, cfg.img_size, cfg.img_size, device="meta"))
    except NotImplementedError:
        pass  # an op without a meta kernel: the successful build is the whole check
    except Exception as err:  # noqa: BLE001
        raise _Unbuildable(f"{cfg.name} builds but its forward pass fails at img_size={cfg.img_size}: "
                           f"{_reason(err)}") from None
    return module.train()


def model_problem(cfg: ModelConfig, num_classes: int = 1000) -> str | None:
    """Why this model section cannot train, or None (see ``checked_model``)."""
    try:
        _checked_model(cfg, num_classes)
    except _Unbuildable as err:
        return str(err)
    return None


def _reason(err: Exception) -> str:
    return str(err) or type(err).__name__


def checked_model(cfg: ModelConfig, num_classes: int = 1000) -> nn.Module:
    """The model on the meta device, built and run once; a ConfigError naming ``model.*`` if it cannot train."""
    try:
        return _checked_model(cfg, num_classes)
    except _Unbuildable as err:
        raise ConfigError(
            f"model.name={cfg.name!r}, model.img_size={cfg.img_size}, model.args={cfg.args!r}: {err}"
        ) from None


def check_model(cfg: ModelConfig, num_classes: int = 1000) -> int:
    """Raise a ConfigError naming ``model.*`` unless the model builds and runs; returns its parameter count."""
    return sum(p.numel() for p in checked_model(cfg, num_classes).parameters())
