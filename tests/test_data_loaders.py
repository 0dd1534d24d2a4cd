"""FFCV loaders per split: batches, thread count, and exact coverage over 2 real gloo ranks."""
import json
from collections import Counter

import numba
import numpy as np
import pytest
import torch
import torch.multiprocessing as torch_mp

from conftest import free_port, gloo_rank
from pipeline.config.schema import AugmentConfig, DataConfig
from pipeline.data.loaders import build_train_loader, build_val_loader, rank_sample_count
from pipeline.data.sources import DigitsSource, ImageSource
from pipeline.data.writing import write_beton
from pipeline.errors import InvalidInputError

PLAIN = AugmentConfig(rand_augment=None, hflip=0.0, mixup_alpha=0.0, cutmix_alpha=0.0, random_erasing=0.0)


class IndexLabelledSource(ImageSource):
    """Sample i has label i (one class per sample), so a batch's labels say which samples it holds."""

    kind, location, split = "imagefolder", "memory", None

    def __init__(self, count: int):
        self.labels = np.arange(count, dtype=np.int64)
        self.classes = [str(i) for i in range(count)]
        self.sizes = np.full((count, 2), 8)
        self.skipped = []

    def load_image(self, index):
        return np.full((8, 8, 3), index % 256, dtype=np.uint8)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits") / "val.beton"
    write_beton(DigitsSource("val", 16), path, num_workers=1)
    return path


def test_train_batches_are_normalised_float_images_and_int_labels_of_the_configured_size(digits):
    data = DataConfig(num_workers=1, augment=PLAIN, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    loader = build_train_loader(data, digits, batch_size=32, img_size=12, device="cpu")
    batches = [(images.clone(), labels.clone()) for images, labels in loader]
    assert len(batches) == 360 // 32  # drop_last: no short batch
    images, labels = batches[0]
    assert images.shape == (32, 3, 12, 12) and images.dtype == torch.float32 and images.is_contiguous()
    assert labels.shape == (32,) and labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 10
    # (x / 255 - 0.5) / 0.25 maps black to -2 and white to +2
    assert images.min() >= -2.0 - 1e-5 and images.max() <= 2.0 + 1e-5 and images.min() < -1.9


def test_val_batches_are_every_sample_in_file_order_center_cropped(digits):
    data = DataConfig(num_workers=1, augment=PLAIN, mean=(0, 0, 0), std=(1 / 255, 1 / 255, 1 / 255))
    val = build_val_loader(data, digits, batch_size=64, img_size=16, device="cpu")
    images, labels, counted = [], [], 0
    for batch_images, batch_labels, num_real in val:
        images.append(batch_images.clone())
        labels.append(batch_labels.clone())
        counted += num_real
    source = DigitsSource("val", 16)
    assert counted == val.num_samples == len(source) == 360
    assert torch.equal(torch.cat(labels), torch.from_numpy(source.labels))
    # crop ratio 1.0 on a square 16 px image at 16 px output is the image itself
    expected = torch.from_numpy(source.load_image(5).copy()).permute(2, 0, 1).float()
    assert torch.allclose(torch.cat(images)[5], expected, atol=1e-3)


def test_building_and_iterating_loaders_keeps_the_callers_torch_thread_count(digits):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loader = build_train_loader(DataConfig(num_workers=2, augment=PLAIN), digits, 64, 8, "cpu")
        assert torch.get_num_threads() == 1  # ffcv alone would have set it to num_workers
        for _ in loader:
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_more_loader_workers_than_decoding_threads_is_invalid_input_naming_both(digits):
    too_many = numba.config.NUMBA_NUM_THREADS + 1
    with pytest.raises(InvalidInputError, match=rf"data.num_workers={too_many}.*1\.\.{too_many - 1}"):
        build_val_loader(DataConfig(num_workers=too_many, augment=PLAIN), digits, 64, 8, "cpu")


def test_rank_sample_counts_cover_the_dataset_exactly():
    for size in (1, 7, 45, 48):
        for world in (1, 2, 3, 8):
            counts = [rank_sample_count(size, rank, world) for rank in range(world)]
            assert sum(counts) == size and max(counts) - min(counts) <= 1


def _rank(rank, world_size, port, train_path, val_path, out_dir):
    with gloo_rank(rank, world_size, port):
        data = DataConfig(num_workers=1, augment=PLAIN, order="random", drop_last=True)
        train = build_train_loader(data, train_path, batch_size=8, img_size=8, device="cpu", distributed=True, seed=7)
        epochs = [[int(label) for _, labels in train for label in labels] for _ in range(2)]
        val = build_val_loader(data, val_path, batch_size=8, img_size=8, device="cpu", distributed=True)
        real, padded = [], 0
        for _, labels, num_real in val:
            real += [int(label) for label in labels[:num_real]]
            padded += len(labels) - num_real
        # repeated augmentation (3 repeats): two epochs, then epoch 1 again as a run resumed there reads it
        repeated = data.model_copy(update={"repeated_augmentation": 3})
        ra = build_train_loader(repeated, train_path, batch_size=8, img_size=8, device="cpu", distributed=True, seed=7)
        ra_epochs = [[int(label) for _, labels in ra for label in labels] for _ in range(2)]
        resumed = build_train_loader(repeated, train_path, batch_size=8, img_size=8, device="cpu", distributed=True,
                                     seed=7)
        resumed.next_epoch = 1
        ra_resumed = [int(label) for _, labels in resumed for label in labels]
        # ... and from a checkpoint taken after epoch 1's first batch, as a worker resumed there reads it
        resumed.next_epoch = 1
        resumed.resume_within_epoch(1)
        ra_resumed_mid_epoch = [[int(label) for label in labels] for _, labels in resumed]
        ra_next_epoch = [int(label) for _, labels in resumed for label in labels]
        quasi_random_error = None
        try:
            build_train_loader(data.model_copy(update={"order": "quasi_random"}), train_path, 8, 8, "cpu",
                               distributed=True)
        except InvalidInputError as err:
            quasi_random_error = str(err)
        record = {"epochs": epochs, "val_real": real, "val_padded": padded, "quasi_random_error": quasi_random_error,
                  "repeated_epochs": ra_epochs, "repeated_resumed": ra_resumed,
                  "repeated_resumed_mid_epoch": ra_resumed_mid_epoch, "repeated_after_resumed_epoch": ra_next_epoch}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two real processes in a gloo process group on loopback, each reading its shard."""
    root = tmp_path_factory.mktemp("distributed")
    write_beton(IndexLabelledSource(48), root / "train.beton", num_workers=1)
    write_beton(IndexLabelledSource(45), root / "val.beton", num_workers=1)  # odd: ffcv pads one rank
    torch_mp.spawn(_rank, args=(2, free_port(), root / "train.beton", root / "val.beton", root), nprocs=2)
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_distributed_train_loader_covers_every_index_exactly_once_per_epoch(two_ranks):
    for epoch in range(2):
        shards = [rank["epochs"][epoch] for rank in two_ranks]
        assert len(shards[0]) == len(shards[1]) == 24
        assert sorted(shards[0] + shards[1]) == list(range(48))


def test_distributed_train_order_is_reshuffled_every_epoch(two_ranks):
    assert two_ranks[0]["epochs"][0] != two_ranks[0]["epochs"][1]


def test_distributed_validation_counts_every_sample_exactly_once_despite_padding(two_ranks):
    assert sorted(two_ranks[0]["val_real"] + two_ranks[1]["val_real"]) == list(range(45))
    assert two_ranks[0]["val_padded"] + two_ranks[1]["val_padded"] == 1  # 45 samples, 2 ranks of 23


def test_repeated_augmentation_shows_each_drawn_image_three_times_across_two_ranks_in_an_epoch_of_the_datasets_length(
        two_ranks):
    for epoch in range(2):
        shards = [rank["repeated_epochs"][epoch] for rank in two_ranks]
        assert len(shards[0]) == len(shards[1]) == 24  # 48 images: the epoch keeps the dataset's length
        counts = Counter(shards[0] + shards[1])
        assert set(counts.values()) == {3} and len(counts) == 16  # 16 images, each 3 times
        # 3 repeats on 2 ranks: every image reaches both, and no rank holds more than 2 of its 3 copies
        for image in counts:
            assert sorted(shard.count(image) for shard in shards) == [1, 2], image
    assert two_ranks[0]["repeated_epochs"][0] != two_ranks[0]["repeated_epochs"][1]  # a new draw each epoch
    assert all(rank["repeated_resumed"] == rank["repeated_epochs"][1] for rank in two_ranks)  # resumed at epoch 1


def test_repeated_augmentation_resumed_mid_epoch_reads_the_rest_of_the_epochs_order_on_each_rank(two_ranks):
    for rank in two_ranks:
        # 24 images a rank in batches of 8: after the first batch, the other two, as the epoch had them
        assert rank["repeated_resumed_mid_epoch"] == [rank["repeated_epochs"][1][8:16], rank["repeated_epochs"][1][16:]]
    # still 3 copies of each drawn image across the ranks: the first batches' and the rest's together
    whole = [image for rank in two_ranks for image in rank["repeated_epochs"][1][:8] + sum(
        rank["repeated_resumed_mid_epoch"], [])]
    assert set(Counter(whole).values()) == {3}
    # the epoch after a resumed one is whole again
    assert all(len(rank["repeated_after_resumed_epoch"]) == 24 for rank in two_ranks)


def test_quasi_random_order_is_refused_when_distributed(two_ranks):
    assert "quasi_random" in two_ranks[0]["quasi_random_error"]
