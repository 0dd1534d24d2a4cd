"""Progressive resizing: each epoch's training crop size (ffcv-imagenet's ``get_resolution``), set on a
train loader's decoder between epochs.

The size holds at ``start_size`` up to epoch ``start_epoch``, rises linearly to the final size at
``end_epoch`` and holds there (``data.progressive``, epochs counted from 1); ffcv-imagenet rounds each
size to a multiple of 32, vitsweep to the model's patch (``step``), so every crop tiles whole patches.
ffcv's decoders allocate their output per epoch from ``output_size``, so a new size needs no recompile.
"""
from __future__ import annotations

from ffcv.loader import Loader

from pipeline.config.schema import ProgressiveResolutionConfig


def training_size(epoch: int, progressive: ProgressiveResolutionConfig, final_size: int, step: int) -> int:
    """The crop size of 1-based ``epoch``: a multiple of ``step``, ``final_size`` from ``end_epoch`` on."""
    if epoch >= progressive.end_epoch:
        return final_size
    start = max(step, round(progressive.start_size / step) * step)
    if epoch <= progressive.start_epoch:
        return start
    fraction = (epoch - progressive.start_epoch) / (progressive.end_epoch - progressive.start_epoch)
    return round((start + fraction * (final_size - start)) / step) * step


def training_sizes(progressive: ProgressiveResolutionConfig, final_size: int, epochs: int, step: int) -> list[int]:
    """Every epoch's crop size, epoch 1 first."""
    return [training_size(epoch, progressive, final_size, step) for epoch in range(1, epochs + 1)]


def set_training_size(loader: Loader, size: int) -> None:
    """The crops ``loader``'s next epoch decodes: its image decoder's output size (a square)."""
    loader.pipeline_specs["image"].decoder.output_size = (size, size)
