"""DeiT's recipe: timm's RandAugment as an FFCV operation, BatchAugment and its matching loss."""
import random

import numpy as np
import pytest
import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from pipeline.config import AugmentConfig, DataConfig
from pipeline.data.augment import BatchAugment, RandAugment, timm_rand_augment
from pipeline.data.loaders import build_train_loader
from pipeline.data.sources import DigitsSource
from pipeline.data.writing import write_beton
from PIL import Image

from ffcv.pipeline.state import State

OFF = dict(rand_augment=None, mixup_alpha=0.0, cutmix_alpha=0.0, random_erasing=0.0, label_smoothing=0.0)


def _images(count=8, size=16, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def test_rand_augment_operation_changes_images_and_keeps_their_shape_and_dtype():
    operation = RandAugment("rand-m9-mstd0.5-inc1", 16, (0.485, 0.456, 0.406))
    state, allocation = operation.declare_state_and_memory(
        State(jit_mode=True, device=torch.device("cpu"), shape=(16, 16, 3), dtype=np.dtype("u1")))
    assert not state.jit_mode and allocation.shape == (16, 16, 3)
    images = _images(32)
    random.seed(0)  # timm's RandAugment draws from Python's `random`
    augmented = operation.generate_code()(images.copy(), np.empty_like(images))
    assert augmented.shape == images.shape and augmented.dtype == np.uint8
    changed = [not np.array_equal(a, b) for a, b in zip(augmented, images)]
    assert sum(changed) > 16  # two ops at p=0.5 each: about 1 in 4 images left as they were


def test_rand_augment_at_magnitude_ten_survives_posterize_to_zero_bits():
    # m10 without noise: PosterizeIncreasing keeps 0 bits, which Pillow 13 rejects on its own.
    transform = timm_rand_augment("rand-m10-n1-p1.0-inc1-mstd0", 16, (0.5, 0.5, 0.5))
    random.seed(0)
    outputs = [np.asarray(transform(Image.fromarray(image))) for image in _images(300, seed=1)]
    assert any((output == 0).all() for output in outputs)  # posterize to 0 bits: black, as timm intends


def test_train_loader_applies_rand_augment_from_the_config(tmp_path):
    path = tmp_path / "digits.beton"
    write_beton(DigitsSource("val", 16), path, num_workers=1)
    no_crop = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), num_workers=1, order="sequential")
    plain = DataConfig(**no_crop, augment=AugmentConfig(**OFF, hflip=0.0))
    augmented = DataConfig(**no_crop, augment=AugmentConfig(**{**OFF, "rand_augment": "rand-m9-n2-p1.0"}, hflip=0.0))
    random.seed(0)
    plain_batch = next(iter(build_train_loader(plain, path, 64, 16, "cpu")))[0].clone()
    augmented_batch = next(iter(build_train_loader(augmented, path, 64, 16, "cpu")))[0].clone()
    differing = [not torch.allclose(a, b) for a, b in zip(plain_batch, augmented_batch)]
    assert sum(differing) > 48


def _batch(count=8):
    torch.manual_seed(0)
    return torch.randn(count, 3, 8, 8), torch.arange(count) % 4


def test_mixup_produces_soft_smoothed_targets_and_soft_target_loss():
    augment = BatchAugment(AugmentConfig(**{**OFF, "mixup_alpha": 0.8, "cutmix_alpha": 1.0, "label_smoothing": 0.1}), 4)
    images, targets = augment(*_batch())
    assert targets.shape == (8, 4) and torch.allclose(targets.sum(1), torch.ones(8))
    assert targets.min() > 0  # smoothing spreads 0.1 over every class
    assert isinstance(augment.loss(), SoftTargetCrossEntropy)
    assert augment.loss()(torch.randn(8, 4), targets).ndim == 0


def test_without_mixup_labels_stay_indices_and_the_loss_smooths_them():
    augment = BatchAugment(AugmentConfig(**{**OFF, "label_smoothing": 0.1}), 4)
    images, labels = _batch()
    out_images, targets = augment(images.clone(), labels)
    assert torch.equal(targets, labels) and torch.equal(out_images, images)
    assert isinstance(augment.loss(), LabelSmoothingCrossEntropy)


def test_without_mixup_or_smoothing_the_loss_is_plain_cross_entropy():
    assert isinstance(BatchAugment(AugmentConfig(**OFF), 4).loss(), torch.nn.CrossEntropyLoss)


def test_random_erasing_at_probability_one_erases_a_patch_of_every_image():
    augment = BatchAugment(AugmentConfig(**{**OFF, "random_erasing": 1.0}), 4)
    images = torch.zeros(8, 3, 16, 16)
    erased, _ = augment(images.clone(), torch.zeros(8, dtype=torch.long))
    assert all((image != 0).any() for image in erased)
    assert all((image == 0).any() for image in erased)  # a patch, not the whole image


def test_an_odd_batch_with_mixup_is_refused_naming_its_size():
    augment = BatchAugment(AugmentConfig(**{**OFF, "mixup_alpha": 0.8}), 4)
    with pytest.raises(ValueError, match="even, got 7"):
        augment(*_batch(7))


def test_a_misspelt_rand_augment_spec_is_a_config_error():
    with pytest.raises(ValueError, match="rand-m9-mstd0.5-inc1"):
        AugmentConfig(rand_augment="rand-x9")
