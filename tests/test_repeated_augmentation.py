"""Repeated augmentation's epoch order against DeiT's RASampler, and what it promises per rank (the two-rank
ffcv loaders: tests/test_data_loaders.py)."""
import math
from collections import Counter

import numpy as np
import pytest

from pipeline.config.schema import DataConfig
from pipeline.data.repeated_augmentation import repeated_order


def _deits_rasampler(permutation: list[int], num_repeats: int, rank: int, world_size: int) -> list[int]:
    """DeiT's samplers.py RASampler.__iter__ on a given permutation, without its cut to a multiple of 256:
    repeat, pad to a multiple of the world, take every world-th from the rank, keep the epoch's share."""
    indices = [index for index in permutation for _ in range(num_repeats)]
    total = math.ceil(len(permutation) * num_repeats / world_size) * world_size
    indices += indices[: total - len(indices)]
    return indices[rank:total:world_size][: len(permutation) // world_size]


@pytest.mark.parametrize(("num_samples", "world_size"), [(48, 2), (45, 3), (100, 8), (7, 1)])
def test_each_ranks_order_is_deits_rasampler_on_the_epochs_permutation(num_samples, world_size):
    permutation = np.random.default_rng(11 + 4).permutation(num_samples).tolist()  # seed 11, epoch 4
    for rank in range(world_size):
        assert repeated_order(num_samples, 3, rank, world_size, seed=11, epoch=4).tolist() == _deits_rasampler(
            permutation, 3, rank, world_size)


@pytest.mark.parametrize("world_size", [3, 8])
def test_with_as_many_ranks_as_repeats_each_image_is_seen_once_per_rank(world_size):
    shards = [repeated_order(96, 3, rank, world_size, seed=0, epoch=0).tolist() for rank in range(world_size)]
    assert all(len(shard) == 96 // world_size for shard in shards)
    assert all(max(Counter(shard).values()) == 1 for shard in shards)  # no rank sees an image twice
    counts = Counter(index for shard in shards for index in shard)
    assert set(counts.values()) <= {1, 2, 3} and sum(counts.values()) == 96 // world_size * world_size
    assert sum(1 for count in counts.values() if count == 3) >= 96 // 3 - 1  # the cut may split one image's repeats


def test_the_order_is_a_function_of_the_seed_and_the_epoch():
    assert repeated_order(48, 3, 0, 2, seed=7, epoch=1).tolist() == repeated_order(48, 3, 0, 2, seed=7, epoch=1).tolist()
    assert repeated_order(48, 3, 0, 2, seed=7, epoch=1).tolist() != repeated_order(48, 3, 0, 2, seed=7, epoch=2).tolist()


def test_repeated_augmentation_takes_the_place_of_another_order():
    with pytest.raises(ValueError, match="takes the place of order='sequential'"):
        DataConfig(repeated_augmentation=3, order="sequential")
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        DataConfig(repeated_augmentation=1)
