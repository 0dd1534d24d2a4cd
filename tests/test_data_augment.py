"""DeiT's recipe: timm's RandAugment batched on torch ops (checked against timm's PIL ops), as an FFCV
operation, and BatchAugment with its matching loss."""
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from pipeline.config import AugmentConfig, DataConfig
from pipeline.data.augment import BatchAugment, RandAugment
from pipeline.data.loaders import NormalizeToFloat, build_train_loader, train_pipelines
from pipeline.data.rand_augment import OPS, BatchRandAugment, Draws, parse_policy, timm_hparams
from pipeline.data.sources import DigitsSource
from pipeline.data.writing import write_beton

from ffcv.pipeline.state import State

OFF = dict(rand_augment=None, mixup_alpha=0.0, cutmix_alpha=0.0, random_erasing=0.0, label_smoothing=0.0)
DEIT = "rand-m9-mstd0.5-inc1"
MEAN = (0.485, 0.456, 0.406)
HPARAMS = timm_hparams(32, MEAN)
FILL = torch.tensor(HPARAMS["img_mean"], dtype=torch.float32)


def _photo(seed: int, size: int = 32) -> np.ndarray:
    """A smooth RGB image with edges (bicubic-upsampled 8x8 noise): what interpolation sees in photos."""
    small = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return np.array(Image.fromarray(small).resize((size, size), Image.BICUBIC))


def _batch_of(images: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def _timm_op(name: str, image: np.ndarray, argument) -> np.ndarray:
    kwargs = dict(fillcolor=HPARAMS["img_mean"], resample=Image.BICUBIC)
    arguments = () if argument is None else (argument,)
    return np.asarray(auto_augment.NAME_TO_OP[name](Image.fromarray(image), *arguments, **kwargs)).astype(int)


def _batched_op(name: str, images: list[np.ndarray], argument) -> np.ndarray:
    op, _ = OPS[name]
    arguments = torch.full((len(images),), 0.0 if argument is None else float(argument), dtype=torch.float64)
    out = op(_batch_of(images).float(), arguments, FILL)
    # The op's own values, unrounded: BatchRandAugment casts them to uint8 as they are.
    assert torch.equal(out, out.round()) and out.min() >= 0 and out.max() <= 255, name
    return out.permute(0, 2, 3, 1).numpy().astype(int)


# (op, arguments over its range): colour ops must equal PIL's output; geometric ops within tolerance.
EXACT = [("AutoContrast", None), ("Equalize", None), ("Invert", None)] + [
    (name, argument)
    for name, arguments in {
        "Posterize": [1, 2, 4, 8], "Solarize": [0, 100, 128, 256], "SolarizeAdd": [0, 50, 110],
        "Color": [0.1, 0.55, 1.9], "Contrast": [0.1, 1.37, 1.9], "Brightness": [0.1, 1.3, 1.9],
        "Sharpness": [0.1, 0.5, 1.9],
    }.items()
    for argument in arguments
]
SHIFTS = [("ShearX", -0.3), ("ShearX", 0.27), ("ShearY", 0.3), ("ShearY", -0.1),
          ("TranslateXRel", 0.45), ("TranslateXRel", -0.2), ("TranslateYRel", -0.45), ("TranslateYRel", 0.1)]
ROTATIONS = [("Rotate", -30.0), ("Rotate", 12.5), ("Rotate", 30.0)]
PHOTOS = [_photo(seed) for seed in range(4)]


@pytest.mark.parametrize("name, argument", EXACT)
def test_colour_ops_equal_timms_pil_ops(name, argument):
    expected = np.stack([_timm_op(name, image, argument) for image in PHOTOS])
    np.testing.assert_array_equal(_batched_op(name, PHOTOS, argument), expected)


@pytest.mark.parametrize("name, argument", SHIFTS)
def test_translate_and_shear_equal_timms_pil_ops_up_to_float32_rounding(name, argument):
    # Same a=-1 cubic as Pillow's affine filter, in float32 where Pillow uses double: a value that
    # lands within rounding of an integer may truncate one level lower.
    difference = np.abs(_batched_op(name, PHOTOS, argument) - np.stack([_timm_op(name, i, argument) for i in PHOTOS]))
    assert difference.max() <= 1 and (difference > 0).mean() < 0.01


@pytest.mark.parametrize("name, argument", ROTATIONS)
def test_rotate_matches_timms_pil_op_up_to_the_interpolation_kernel(name, argument):
    # torch's 2D bicubic (a=-0.75) vs Pillow's (a=-1): on these high-contrast 32 px images the
    # difference averages about 1 level of 255 and stays below 8 (measured: mean 1.0, max 6).
    difference = np.abs(_batched_op(name, PHOTOS, argument) - np.stack([_timm_op(name, i, argument) for i in PHOTOS]))
    assert difference.mean() < 1.5 and difference.max() <= 8


def test_posterize_to_zero_bits_is_black():
    # timm's PosterizeIncreasing reaches 0 bits at magnitude 10; Pillow 13 rejects 0 where older
    # Pillow returned black, as timm intends.
    assert (_batched_op("Posterize", PHOTOS, 0) == 0).all()


@pytest.mark.parametrize("name", sorted(OPS))
def test_level_arguments_equal_timms_level_functions(name):
    _, level = OPS[name]
    timm_level = auto_augment.LEVEL_TO_ARG[name]
    magnitudes = torch.linspace(0, 10, 41, dtype=torch.float64)
    random.seed(0)
    for magnitude in magnitudes.tolist():
        # timm negates at random (Python's `random`): collect both outcomes.
        expected = {timm_level(magnitude, HPARAMS)[0] for _ in range(64)} if timm_level else {0.0}
        f64 = dict(dtype=torch.float64)
        ours = {float(level(torch.tensor([magnitude], **f64), torch.tensor([sign], **f64), HPARAMS)[0])
                for sign in (1.0, -1.0)}
        assert ours == {float(value) for value in expected}, (name, magnitude)


def test_the_deit_spec_parses_to_timms_increasing_ops_two_layers_at_half_probability():
    policy = parse_policy(DEIT)
    assert policy.ops == tuple(auto_augment._RAND_INCREASING_TRANSFORMS)
    assert (policy.num_layers, policy.prob, policy.magnitude, policy.magnitude_std) == (2, 0.5, 9.0, 0.5)
    assert policy.choice_weights is None and policy.hparams["img_mean"] == (124, 116, 104)


# Per sample, three layers of (op, applied, magnitude, sign): colour ops, whose batched results equal
# PIL's exactly, so a whole chain can be compared pixel for pixel with timm's ops applied in order.
CHAINS = [
    [("ColorIncreasing", True, 9.0, 1.0), ("ColorIncreasing", True, 3.0, -1.0), ("SolarizeIncreasing", True, 5.0, 1.0)],
    [("PosterizeIncreasing", True, 2.0, 1.0), ("Invert", False, 9.0, 1.0), ("ContrastIncreasing", True, 8.0, -1.0)],
    [("SolarizeAdd", True, 7.0, 1.0), ("BrightnessIncreasing", True, 6.0, 1.0), ("SharpnessIncreasing", True, 9.0, -1.0)],
    [("Equalize", True, 9.0, 1.0), ("BrightnessIncreasing", True, 9.5, -1.0), ("AutoContrast", True, 9.0, 1.0)],
    [("ContrastIncreasing", True, 4.0, 1.0), ("SharpnessIncreasing", True, 2.5, 1.0), ("ColorIncreasing", True, 7.0, -1.0)],
    [("Invert", False, 9.0, 1.0), ("ColorIncreasing", False, 9.0, 1.0), ("Equalize", False, 9.0, 1.0)],
]


def _timm_argument(name: str, magnitude: float, sign: float):
    """timm's level function at ``magnitude``, with the sign timm's random negation would have drawn."""
    timm_level = auto_augment.LEVEL_TO_ARG[name]
    if timm_level is None:
        return None
    random.seed(0)
    outcomes = {timm_level(magnitude, HPARAMS)[0] for _ in range(64)}  # timm negates with Python's random
    return max(outcomes) if sign > 0 else min(outcomes)


def test_each_sample_runs_its_layers_in_order_each_on_the_previous_layers_result():
    augment = BatchRandAugment("rand-m9-n3-mstd0.5-inc1", 32, MEAN)
    index = {name: i for i, name in enumerate(augment.policy.ops)}
    draws = Draws(
        ops=torch.tensor([[index[op] for op, *_ in chain] for chain in CHAINS]),
        applied=torch.tensor([[applied for _, applied, *_ in chain] for chain in CHAINS]),
        magnitudes=torch.tensor([[m for *_, m, _ in chain] for chain in CHAINS], dtype=torch.float64),
        signs=torch.tensor([[sign for *_, sign in chain] for chain in CHAINS], dtype=torch.float64),
    )
    images = [PHOTOS[i % len(PHOTOS)] for i in range(len(CHAINS))]
    expected = []
    for image, chain in zip(images, CHAINS):
        for name, applied, magnitude, sign in chain:
            if applied:
                image = _timm_op(name, image.astype(np.uint8), _timm_argument(name, magnitude, sign))
        expected.append(image)
    augmented = augment.augment_(_batch_of(images), draws)
    np.testing.assert_array_equal(augmented.permute(0, 2, 3, 1).numpy(), np.stack(expected))


def test_each_sample_draws_its_own_ops():
    draws = BatchRandAugment(DEIT, 32, MEAN).draw(4096)
    first_layer = draws.ops[:, 0]
    counts = torch.bincount(first_layer, minlength=15)
    assert len(counts) == 15 and counts.min() > 4096 / 15 * 0.8  # uniform over timm's 15 ops
    assert (draws.ops[:, 0] != draws.ops[:, 1]).float().mean() > 0.9  # layers draw independently


def test_magnitudes_are_drawn_per_sample_around_m_with_timms_noise_and_clipped():
    magnitudes = BatchRandAugment(DEIT, 32, MEAN).draw(20_000).magnitudes.flatten()
    assert abs(magnitudes.mean().item() - 9.0) < 0.02 and abs(magnitudes.std().item() - 0.5) < 0.03
    assert magnitudes.max().item() == 10.0 and magnitudes.min().item() >= 0.0  # clipped at timm's 10
    assert len(magnitudes.unique()) > 10_000


def test_each_op_runs_with_probability_p_and_signs_are_even():
    draws = BatchRandAugment("rand-m9-mstd0.5-inc1-p0.3", 32, MEAN).draw(20_000)
    assert abs(draws.applied.double().mean().item() - 0.3) < 0.02
    assert abs((draws.signs > 0).double().mean().item() - 0.5) < 0.02


def test_weighted_choice_never_draws_an_op_twice_for_one_sample():
    # timm's 'tweights' chooses without replacement (np.random.choice(replace=False)).
    draws = BatchRandAugment("rand-m9-n3-tweights", 32, MEAN).draw(2000)
    assert all(len(set(row)) == 3 for row in draws.ops.tolist())


def test_different_samples_of_one_batch_get_different_augmentations():
    same = _batch_of([PHOTOS[0]] * 64)
    augmented = BatchRandAugment("rand-m9-mstd0.5-inc1-p1.0", 32, MEAN)(same)
    assert len({tuple(image.flatten().tolist()) for image in augmented}) > 32


def test_the_same_seed_gives_the_same_augmentations_and_another_seed_others():
    batch = _batch_of(PHOTOS * 8)
    first = BatchRandAugment(DEIT, 32, MEAN, seed=3)(batch)
    assert torch.equal(first, BatchRandAugment(DEIT, 32, MEAN, seed=3)(batch))
    assert not torch.equal(first, BatchRandAugment(DEIT, 32, MEAN, seed=4)(batch))


def test_dtype_shape_and_device_are_kept_and_the_input_is_untouched():
    batch = _batch_of(PHOTOS * 4).contiguous(memory_format=torch.channels_last)
    before = batch.clone()
    augmented = BatchRandAugment(DEIT, 32, MEAN)(batch)
    assert augmented.dtype == torch.uint8 and augmented.shape == batch.shape and augmented.device == batch.device
    assert torch.equal(batch, before) and not torch.equal(augmented, before)


def test_probability_zero_is_the_identity():
    batch = _batch_of(PHOTOS * 4)
    assert torch.equal(BatchRandAugment("rand-m9-mstd0.5-inc1-p0", 32, MEAN)(batch), batch)


def test_a_float_batch_is_refused_naming_what_it_takes():
    with pytest.raises(ValueError, match="uint8"):
        BatchRandAugment(DEIT, 32, MEAN)(torch.zeros(2, 3, 8, 8))


def test_a_spec_selecting_ops_not_batched_here_is_a_config_error_naming_them():
    with pytest.raises(ValueError, match="GaussianBlur"):
        AugmentConfig(rand_augment="rand-m9-t3a")


def test_rand_augment_operation_takes_uint8_images_after_to_torch_image():
    operation = RandAugment(DEIT, 16, MEAN)
    state, allocation = operation.declare_state_and_memory(
        State(jit_mode=False, device=torch.device("cpu"), shape=(3, 16, 16), dtype=torch.uint8))
    assert not state.jit_mode and allocation.shape == (3, 16, 16) and allocation.dtype == torch.uint8
    with pytest.raises(ValueError, match="after ToTorchImage"):
        operation.declare_state_and_memory(
            State(jit_mode=True, device=torch.device("cpu"), shape=(16, 16, 3), dtype=np.dtype("u1")))


def test_rand_augment_runs_on_the_device_batch_before_normalising():
    from ffcv.transforms import ToDevice, ToTorchImage

    image = train_pipelines(DataConfig(), 16, torch.device("cpu"))["image"]
    kinds = [type(operation) for operation in image]
    assert kinds.index(ToDevice) < kinds.index(ToTorchImage) < kinds.index(RandAugment) < kinds.index(NormalizeToFloat)


def test_train_loader_applies_rand_augment_from_the_config(tmp_path):
    path = tmp_path / "digits.beton"
    write_beton(DigitsSource("val", 16), path, num_workers=1)
    no_crop = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), num_workers=1, order="sequential")
    plain = DataConfig(**no_crop, augment=AugmentConfig(**OFF, hflip=0.0))
    augmented = DataConfig(**no_crop, augment=AugmentConfig(**{**OFF, "rand_augment": "rand-m9-n2-p1.0"}, hflip=0.0))
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
