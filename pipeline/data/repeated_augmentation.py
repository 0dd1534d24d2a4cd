"""Repeated augmentation (``data.repeated_augmentation``): the order DeiT's and XCiT's ``RASampler``
give an epoch, as an ffcv traversal order.

Each epoch permutes the dataset (from the run's seed and the epoch), repeats every index
``num_repeats`` times in a row and deals the stream to the ranks in turn (position p to rank
p mod W), so an image's repeats land on different ranks while there are at least as many ranks as
repeats (fewer ranks: some rank gets two of them). The epoch keeps the dataset's length: each
rank reads N // W of its share, so an epoch shows about N / ``num_repeats`` images, each
``num_repeats`` times, in differently augmented copies. (DeiT's sampler also rounds the epoch
down to a multiple of 256 samples; this order keeps every whole share.) The order is a function
of (seed, epoch) alone: a run resumed at an epoch reads that epoch's order.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch.distributed as dist

import pipeline.data.runtime  # noqa: F401  (first: imports ffcv keeping torch's thread count)

# ffcv after pipeline.data.runtime, which imports it keeping torch's thread count
from ffcv.traversal_order.base import TraversalOrder


def repeated_order(num_samples: int, num_repeats: int, rank: int, world_size: int, seed: int,
                   epoch: int) -> np.ndarray:
    """The positions (into the dataset's indices) rank ``rank`` of ``world_size`` reads in ``epoch``."""
    permutation = np.random.default_rng(seed + epoch).permutation(num_samples)
    stream = np.repeat(permutation, num_repeats)  # each index num_repeats times in a row
    return stream[rank::world_size][: num_samples // world_size]


class RepeatedAugmentation(TraversalOrder):
    """``repeated_order`` over the loader's indices, on this process's rank.

    ffcv 1.0.2 calls an order given as a ``TraversalOrder`` instance with its loader (``order(loader)``),
    so the instance built from the config alone makes the one bound to the loader."""

    def __init__(self, num_repeats: int, loader=None):
        self.num_repeats = num_repeats
        if loader is not None:
            super().__init__(loader)
            self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)

    def __call__(self, loader) -> RepeatedAugmentation:
        return RepeatedAugmentation(self.num_repeats, loader)

    def sample_order(self, epoch: int) -> Sequence[int]:
        positions = repeated_order(len(self.indices), self.num_repeats, self.rank, self.world_size, self.seed or 0,
                                   epoch)
        return self.indices[positions]
