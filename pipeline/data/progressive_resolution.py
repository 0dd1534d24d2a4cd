"""Progressive resizing: each epoch's training crop size (ffcv-imagenet's ``get_resolution``), set on a
train loader's decoder between epochs.

The size holds at ``start_size`` up to epoch ``start_epoch``, rises linearly to the final size at
``end_epoch`` and holds there (``data.progressive``, epochs counted from 1); ffcv-imagenet rounds each
size to a multiple of 32, vitsweep to the model's patch (``step``), so every crop tiles whole patches.
ffcv's decoders allocate their output per epoch from ``output_size``, so a new size needs no recompile.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config.schema import ProgressiveResolutionConfig

if TYPE_CHECKING:
    from ffcv.loader import Loader


def training_size(epoch: int, progressive: ProgressiveResolutionConfig, final_size: int, step: int) -> int:
    """The crop size of 1-based ``epoch``: a multiple of ``step``, ``final_size`` from ``end_epoch`` on, never
    above it (a final size between two multiples rounds the ramp's last sizes down to it)."""
    if epoch >= progressive.end_epoch:
        return final_size
    start = max(step, round(progressive.start_size / step) * step)
    if epoch > progressive.start_epoch:
        fraction = (epoch - progressive.start_epoch) / (progressive.end_epoch - progressive.start_epoch)
        start = round((start + fraction * (final_size - start)) / step) * step
    return min(start, final_size)


def training_sizes(progressive: ProgressiveResolutionConfig, final_size: int, epochs: int, step: int) -> list[int]:
    """Every epoch's crop size, epoch 1 first."""
    return [training_size(epoch, progressive, final_size, step) for epoch in range(1, epochs + 1)]


def set_training_size(loader: Loader, size: int) -> None:
    """The crops ``loader``'s next epoch decodes: its image decoder's output size (a square)."""
    loader.pipeline_specs["image"].decoder.output_size = (size, size)


def describe_sizes(sizes: list[int]) -> str:
    """Each epoch's crop size, as runs: "8 px epochs 1-2, 16 px epochs 3-4"."""
    runs: list[tuple[int, int, int]] = []
    for epoch, size in enumerate(sizes, start=1):
        if runs and runs[-1][0] == size:
            runs[-1] = (size, runs[-1][1], epoch)
        else:
            runs.append((size, epoch, epoch))
    return ", ".join(f"{size} px epoch{'s' if first != last else ''} {first}{f'-{last}' if first != last else ''}"
                     for size, first, last in runs)
