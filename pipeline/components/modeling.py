"""Model building: a config's model section -> a timm model from vitsweep's registry."""
from __future__ import annotations

from contextlib import nullcontext

import timm
import torch
from torch import nn

import models  # noqa: F401  (registers vitsweep's variants with timm)
from pipeline.config.schema import ModelConfig, ProgressiveResolutionConfig
from pipeline.data.progressive_resolution import describe_sizes, training_sizes
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
    problem = size_problem(module, cfg.img_size)
    if problem:
        raise _Unbuildable(f"{cfg.name} builds but its forward pass fails at img_size={cfg.img_size}: {problem}")
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


def patch_step(model: nn.Module) -> int:
    """Pixels along a side per token of the model's patch grid: a crop size that is a multiple of it tiles
    whole patches (timm's ``patch_embed.patch_size``; EIT's overlapping stem: image over grid)."""
    embed = model.patch_embed
    patch = getattr(embed, "patch_size", None)
    if patch is not None:
        return patch if isinstance(patch, int) else patch[0]
    return embed.img_size[0] // embed.grid_size[0]


def size_problem(model: nn.Module, size: int) -> str | None:
    """Why ``model`` (on the meta device) cannot run a batch of ``size`` px images, else None."""
    try:
        with torch.no_grad():
            model.eval()(torch.empty(2, 3, size, size, device="meta"))
    except NotImplementedError:
        return None  # an op without a meta kernel: the meta device can say no more (the build passed)
    except Exception as err:  # noqa: BLE001  (timm's forward passes assert; any failure is a bad config)
        hint = (" (timm's ViTs take other sizes with model.args.dynamic_img_size=true)"
                if "doesn't match model" in str(err) else "")
        return f"{_reason(err)}{hint}"
    return None


def checked_training_sizes(cfg: ModelConfig, progressive: ProgressiveResolutionConfig, epochs: int) -> list[int]:
    """Each epoch's crop size under ``data.progressive``, the model built and run at every one of them on the
    meta device; a ConfigError naming the first size it cannot train at (a ViT's fixed position table, ...)."""
    model = checked_model(cfg)
    sizes = training_sizes(progressive, cfg.img_size, epochs, patch_step(model))
    for size in sorted(set(sizes)):
        problem = size_problem(model, size)
        if problem:
            raise ConfigError(f"data.progressive: {cfg.name} cannot train at {size} px, the crop size of epoch "
                              f"{sizes.index(size) + 1} (sizes: {describe_sizes(sizes)}): {problem}")
    return sizes


def training_sizes_problem(cfg: ModelConfig, progressive: ProgressiveResolutionConfig | None, epochs: int) -> str | None:
    """Why the model cannot train at one of ``data.progressive``'s sizes (``checked_training_sizes``), else None."""
    try:
        if progressive is not None:
            checked_training_sizes(cfg, progressive, epochs)
    except ConfigError as err:
        return str(err)
    return None
