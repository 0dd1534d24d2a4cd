"""DeiT's recipe: timm's RandAugment batched on torch ops (checked against timm's PIL ops), as an FFCV
operation, and BatchAugment with its matching loss."""
import functools
import random

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_sample_image
from timm.data import auto_augment
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from pipeline.config.schema import AugmentConfig, DataConfig
from pipeline.data.augment import BatchAugment
from pipeline.data.rand_augment_operation import RandAugment
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


PHOTOS = [_photo(seed) for seed in range(4)]


# -- every op against timm's own AugmentOp, on natural, low-contrast and flat-region images ----------

SIZES = (32, 224)
MAGNITUDES = (0.0, 3.0, 9.0, 10.0)
SIGNS = (1.0, -1.0)
GEOMETRIC = {"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"}
# Pillow interpolates in C doubles; a Pillow built with fused multiply-adds (e.g. on aarch64) may round a
# value that lands on an integer the other way: geometric ops may differ there, by one level, both ways.
MIN_EQUAL, MAX_LEVELS, MAX_BIAS = 0.9999, 1, 1e-5
# timm negates an op's argument when random.random() > 0.5: a seed for each outcome.
SEED_FOR_SIGN = {sign: next(s for s in range(100) if (random.Random(s).random() > 0.5) == (sign < 0)) for sign in SIGNS}


@functools.cache
def _test_images(size: int) -> tuple[np.ndarray, ...]:
    """Two photographs (scikit-learn's sample images), a low-contrast one, and flat colour blocks."""
    photos = []
    for name in ("china.jpg", "flower.jpg"):
        photo = load_sample_image(name)  # 427 x 640
        side = photo.shape[0]
        left = (photo.shape[1] - side) // 2
        photos.append(np.asarray(Image.fromarray(photo[:, left:left + side]).resize((size, size), Image.BICUBIC)))
    low_contrast = photos[0] // 8 + 112  # 32 levels around mid-grey
    blocks = np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    flat = np.asarray(Image.fromarray(blocks).resize((size, size), Image.NEAREST))
    return (*photos, low_contrast, flat)


def _timm_augment_op(name: str, image: np.ndarray, magnitude: float, sign: float, hparams: dict) -> np.ndarray:
    if name.startswith("Posterize") and auto_augment.LEVEL_TO_ARG[name](magnitude, hparams)[0] == 0:
        return np.zeros_like(image)  # timm's intent; Pillow >= 10 refuses 0 bits (test below)
    op = auto_augment.AugmentOp(name, prob=1.0, magnitude=magnitude, hparams=hparams)
    random.seed(SEED_FOR_SIGN[sign])
    return np.asarray(op(Image.fromarray(image)))


def _assert_close_to_pillow(name: str, ours: np.ndarray, expected: np.ndarray) -> None:
    difference = ours - expected
    equal, largest, bias = (difference == 0).mean(), np.abs(difference).max(), difference.mean()
    assert equal >= MIN_EQUAL and largest <= MAX_LEVELS and abs(bias) <= MAX_BIAS, (name, equal, largest, bias)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_equals_timms_augment_op(name, size):
    # Magnitudes 0, 3, 9, 10 with both signs, each on every test image: one batch per op.
    hparams = timm_hparams(size, MEAN)
    cases = [(magnitude, sign, image) for magnitude in MAGNITUDES for sign in SIGNS for image in _test_images(size)]
    expected = np.stack([_timm_augment_op(name, image, m, s, hparams) for m, s, image in cases]).astype(int)
    magnitudes, signs = (torch.tensor([case[i] for case in cases], dtype=torch.float64) for i in (0, 1))
    op, level = OPS[name]
    out = op(_batch_of([image for _, _, image in cases]).float(), level(magnitudes, signs, hparams), FILL)
    # The op's own values, unrounded: BatchRandAugment casts them to uint8 as they are.
    assert torch.equal(out, out.round()) and out.min() >= 0 and out.max() <= 255, name
    ours = out.permute(0, 2, 3, 1).numpy().astype(int)
    if name in GEOMETRIC:
        _assert_close_to_pillow(name, ours, expected)
    else:
        np.testing.assert_array_equal(ours, expected, err_msg=name)


def _pillow_affine(image: np.ndarray, matrix: tuple) -> np.ndarray:
    pil = Image.fromarray(image)
    return np.asarray(pil.transform(pil.size, Image.AFFINE, matrix, Image.BICUBIC, fillcolor=HPARAMS["img_mean"]))


def test_rotate_by_quarter_turns_equals_pillows_transposes():
    # Reachable with a spec's mmax; Pillow takes its transpose fast paths there.
    degrees = [90.0, 180.0, 270.0, -90.0, 360.0]
    expected = [np.asarray(Image.fromarray(PHOTOS[0]).rotate(angle, Image.BICUBIC)) for angle in degrees]
    out = OPS["Rotate"][0](_batch_of(PHOTOS[:1] * 5).float(), torch.tensor(degrees, dtype=torch.float64), FILL)
    np.testing.assert_array_equal(out.permute(0, 2, 3, 1).numpy(), np.stack(expected))


def test_translate_by_just_under_a_whole_pixel_equals_pillow():
    # (x + 0.5) + shift rounds onto the next pixel centre: Pillow samples that pixel at fraction 0.
    width = 200
    image = np.random.default_rng(1).integers(0, 256, (4, width, 3), dtype=np.uint8)
    fractions = [np.nextafter(-3 / width, -1.0), np.nextafter(7 / width, 0.0), np.nextafter(0.5, 0.0), 0.9 * 0.45]
    expected = np.stack([_pillow_affine(image, (1, 0, float(f) * width, 0, 1, 0)) for f in fractions])  # timm's pixels
    out = OPS["TranslateXRel"][0](_batch_of([image] * 4).float(), torch.tensor(fractions, dtype=torch.float64), FILL)
    np.testing.assert_array_equal(out.permute(0, 2, 3, 1).numpy(), expected)


def test_posterize_to_zero_bits_is_black_where_timms_op_raises():
    # PosterizeIncreasing reaches 0 bits at magnitude 10 (2.3 % of its layers under DeiT's m9 std 0.5);
    # Pillow >= 10 refuses 0 bits, so timm's op would raise in a DataLoader worker: black is timm's intent.
    with pytest.raises(ValueError, match="bits"):
        auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10, hparams=HPARAMS)(Image.fromarray(PHOTOS[0]))
    op, level = OPS["PosterizeIncreasing"]
    ten = torch.full((len(PHOTOS),), 10.0, dtype=torch.float64)
    assert (op(_batch_of(PHOTOS).float(), level(ten, torch.ones_like(ten), HPARAMS), FILL) == 0).all()


def test_timms_posterize_made_black_at_zero_bits_for_the_benchmarks_keeps_its_other_levels(monkeypatch):
    from pipeline.data.rand_augment import use_timms_posterize_as_intended

    timms = auto_augment.posterize
    monkeypatch.setattr(auto_augment, "NAME_TO_OP", dict(auto_augment.NAME_TO_OP))  # restored after the test
    use_timms_posterize_as_intended()
    black = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10, hparams=HPARAMS)(
        Image.fromarray(PHOTOS[0]))
    assert not np.asarray(black).any()
    for bits in (1, 4, 8):
        ours = auto_augment.NAME_TO_OP["PosterizeIncreasing"](Image.fromarray(PHOTOS[0]), bits)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(timms(Image.fromarray(PHOTOS[0]), bits)))


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


def _timm_op(name: str, image: np.ndarray, argument) -> np.ndarray:
    kwargs = dict(fillcolor=HPARAMS["img_mean"], resample=Image.BICUBIC)
    arguments = () if argument is None else (argument,)
    return np.asarray(auto_augment.NAME_TO_OP[name](Image.fromarray(image), *arguments, **kwargs)).astype(int)


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


# -- the draws beyond DeiT's spec, and histogram ops on the images where PIL's special cases apply -----

def test_a_uniform_magnitude_spec_draws_each_magnitude_in_zero_to_m():
    # timm: mstd above 100 means uniform in [0, m] (random.uniform), drawn per sample and layer
    draws = BatchRandAugment("rand-m9-mstd101", 32, MEAN).draw(20_000)
    magnitudes = draws.magnitudes
    assert magnitudes.shape == (20_000, 2) and magnitudes.dtype == torch.float64
    assert magnitudes.min().item() >= 0.0 and magnitudes.max().item() <= 9.0
    assert abs(magnitudes.mean().item() - 4.5) < 0.05 and len(magnitudes.unique()) > 30_000
    again = BatchRandAugment("rand-m9-mstd101", 32, MEAN).draw(20_000).magnitudes
    assert torch.equal(magnitudes, again)  # from the seeded generator


def test_draws_are_float64_as_timms_python_floats_and_signs_are_exactly_plus_or_minus_one():
    # a float32 magnitude can round a level (posterize's bits, a solarize threshold) off timm's value
    draws = BatchRandAugment(DEIT, 32, MEAN).draw(1000)
    assert draws.magnitudes.dtype == torch.float64
    assert set(draws.signs.unique().tolist()) == {-1.0, 1.0}


def test_magnitudes_below_zero_are_clipped_to_zero_as_timm_clips_them():
    magnitudes = BatchRandAugment("rand-m1-mstd5", 32, MEAN).draw(20_000).magnitudes
    assert magnitudes.min().item() == 0.0
    assert abs((magnitudes == 0).double().mean().item() - 0.42) < 0.02  # P(N(1, 5) < 0) = 0.42


def test_the_weighted_choice_follows_the_seed():
    ops = [BatchRandAugment("rand-m9-n3-tweights", 32, MEAN, seed=seed).draw(64).ops for seed in (5, 5, 6)]
    assert torch.equal(ops[0], ops[1]) and not torch.equal(ops[0], ops[2])


def _edge_case_images() -> list[np.ndarray]:
    """Images where PIL's equalize and autocontrast take their special branches: a flat channel, two
    adjacent levels, two levels far apart, too few pixels for a step (8x8: step 0), a step of 1 (16x16),
    and a brightest level used by one pixel only."""
    rng = np.random.default_rng(0)
    images = []
    for size in (8, 16, 20):
        image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        image[..., 0] = 77  # flat
        image[..., 1] = np.where(rng.random((size, size)) < 0.5, 100, 101)  # two adjacent levels
        images.append(image)
        lonely = rng.integers(0, 200, (size, size, 3), dtype=np.uint8)
        lonely[..., 1] = 50  # with the pixel below: one level and a single other pixel
        lonely[..., 2] = np.where(rng.random((size, size)) < 0.8, 10, 240)  # two levels far apart
        lonely[0, 0] = 255  # the last used level has one pixel
        images.append(lonely)
    return images


def _op_on(name: str, image: np.ndarray, argument: float | None) -> np.ndarray:
    """Our op ``name`` on one HWC image at ``argument`` (the level's output), as an HWC int array."""
    op, _ = OPS[name]
    arguments = None if argument is None else torch.tensor([argument], dtype=torch.float64)
    return op(_batch_of([image]).float(), arguments, FILL)[0].permute(1, 2, 0).numpy().astype(int)


@pytest.mark.parametrize("name", ["Equalize", "AutoContrast"])
def test_histogram_ops_match_pil_where_its_special_cases_apply(name):
    for image in _edge_case_images():
        np.testing.assert_array_equal(_op_on(name, image, None), _timm_op(name, image, None), err_msg=f"{image.shape}")


def test_color_matches_pil_on_every_rgb_value_whose_grayscale_pil_rounds_up():
    # PIL's L = (19595 R + 38470 G + 7471 B + 32768) >> 16: these 247 colours sit one short of the next level
    r, g, b = np.meshgrid(np.arange(256), np.arange(256), np.arange(256), indexing="ij")
    edge = ((r * 19595 + g * 38470 + b * 7471 + 32768) % 65536) == 65535
    colours = np.stack([r[edge], g[edge], b[edge]], axis=-1).astype(np.uint8)
    image = np.resize(colours, (16 * 16, 3)).reshape(16, 16, 3)
    np.testing.assert_array_equal(_op_on("Color", image, 0.1), _timm_op("Color", image, 0.1))


@pytest.mark.parametrize("name", ["TranslateXRel", "TranslateYRel"])
def test_relative_translations_scale_by_their_own_side_on_a_non_square_image(name):
    image = _photo(0, size=48)[:32]  # 32 high, 48 wide
    np.testing.assert_array_equal(_op_on(name, image, 0.3), _timm_op(name, image, 0.3))


def test_a_one_channel_uint8_batch_is_refused_naming_its_shape():
    with pytest.raises(ValueError, match=r"uint8 \[B, 3, H, W\] batch, got torch.uint8 \(2, 1, 8, 8\)"):
        BatchRandAugment(DEIT, 32, MEAN)(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))


def test_a_spec_that_is_not_randaugment_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"not a timm RandAugment spec: 'augmix-m5'"):
        parse_policy("augmix-m5", 32, MEAN)


def test_the_fill_colour_follows_the_configs_mean():
    assert BatchRandAugment(DEIT, 32, (0.1, 0.2, 0.3)).fill.tolist() == [26.0, 51.0, 76.0]  # round(255 x mean)
