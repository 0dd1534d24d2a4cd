"""Progressive resolution (data.progressive): each epoch's crop size as ffcv-imagenet computes it, rounded to
the model's patch; a real ffcv loader decoding each epoch at its size with the augmentations on; the model
run at every size before Ray starts. The end-to-end run is test_training's two-epoch run (8 px, then 16)."""
import shlex

import numpy as np
import pytest

from conftest import readme_block

from pipeline.components.modeling import checked_training_sizes
from pipeline.config.loading import load_config
from pipeline.config.schema import AugmentConfig, DataConfig, ModelConfig, ProgressiveResolutionConfig
from pipeline.data.loaders import build_train_loader, build_val_loader
from pipeline.data.progressive_resolution import describe_sizes, set_training_size, training_sizes
from pipeline.cli import main
from pipeline.errors import ConfigError


def ffcv_imagenet_resolution(epoch, min_res, max_res, end_ramp, start_ramp, multiple):
    """ffcv-imagenet's train_imagenet.py get_resolution, written out (its epochs count from 0, its sizes
    round to 32: here to ``multiple``)."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / multiple)) * multiple


@pytest.mark.parametrize("start, final, start_epoch, end_epoch, epochs, step", [
    (160, 192, 66, 77, 88, 32),  # ffcv-imagenet's rn50 88-epoch config: 160 -> 192, ramp over epochs 65-76
    (128, 224, 1, 10, 12, 16),
    (96, 384, 5, 300, 400, 8),
    (8, 16, 1, 2, 2, 8),  # test_training's run
])
def test_each_epochs_size_is_ffcv_imagenets_rounded_to_the_patch(start, final, start_epoch, end_epoch, epochs, step):
    progressive = ProgressiveResolutionConfig(start_size=start, start_epoch=start_epoch, end_epoch=end_epoch)
    expected = [ffcv_imagenet_resolution(e - 1, start, final, end_epoch - 1, start_epoch - 1, step)
                for e in range(1, epochs + 1)]
    assert training_sizes(progressive, final, epochs, step) == expected
    assert expected[-1] == final and expected[end_epoch - 1:] == [final] * (epochs - end_epoch + 1)


def test_a_start_size_between_patches_is_rounded_to_one():
    progressive = ProgressiveResolutionConfig(start_size=20, end_epoch=3)
    assert training_sizes(progressive, 32, 3, 8) == [16, 24, 32]  # 20 / 8 = 2.5, rounded to even: 2 patches


def test_no_crop_is_larger_than_the_models_size_when_it_is_not_a_multiple_of_the_patch():
    # EIT16/4/3's stem: 12 px per token, and 224 = 18.7 tokens; 128 px rounds to 132 (11 tokens)
    progressive = ProgressiveResolutionConfig(start_size=128, start_epoch=1, end_epoch=50)
    sizes = training_sizes(progressive, 224, 50, 12)
    assert ffcv_imagenet_resolution(48, 132, 224, 49, 0, 12) == 228  # epoch 49 by the ramp alone: 18.5 tokens
    assert sizes[48] == 224 and max(sizes) == 224
    assert all(size % 12 == 0 for size in sizes if size != 224)


def test_an_ffcv_loader_decodes_each_epoch_at_its_size_with_the_augmentations_on(digits16):
    # RandAugment and flips batched on the device, random erasing after them: all must follow the new size.
    data = DataConfig(num_workers=1, augment=AugmentConfig(mixup_alpha=0.0, cutmix_alpha=0.0))
    loader = build_train_loader(data, digits16["train"], batch_size=32, img_size=16, device="cpu")
    val = build_val_loader(data, digits16["val"], batch_size=64, img_size=16, device="cpu")
    seen = []
    for size in (8, 12, 16):
        set_training_size(loader, size)
        seen.append({tuple(images.shape[1:]) for images, _ in loader})
    assert seen == [{(3, 8, 8)}, {(3, 12, 12)}, {(3, 16, 16)}]
    assert {tuple(images.shape[1:]) for images, _, _ in val} == {(3, 16, 16)}  # validation stays at img_size


def test_the_model_runs_at_every_size_before_ray_or_the_size_is_named():
    progressive = ProgressiveResolutionConfig(start_size=32, end_epoch=4)
    assert checked_training_sizes(ModelConfig(name="xcit_nano_12_p16", img_size=64), progressive, 5) == [
        32, 48, 48, 64, 64]
    vit = ModelConfig(name="deit_tiny_p16", img_size=64, args={"depth": 1})
    with pytest.raises(ConfigError, match=r"deit_tiny_p16 cannot train at 32 px, the crop size of epoch 1 \(sizes: "
                                          r"32 px epoch 1, 48 px epochs 2-3, 64 px epochs 4-5\).*"
                                          r"model.args.dynamic_img_size=true"):
        checked_training_sizes(vit, progressive, 5)
    dynamic = vit.model_copy(update={"args": {"depth": 1, "dynamic_img_size": True}})
    assert checked_training_sizes(dynamic, progressive, 5) == [32, 48, 48, 64, 64]
    assert describe_sizes([8, 8, 16]) == "8 px epochs 1-2, 16 px epoch 3"


@pytest.mark.parametrize("overrides, message", [
    (["data.progressive.start_size=16", "data.progressive.end_epoch=2", "optim.epochs=2"],
     "data.progressive.start_size=16 must be below model.img_size=16"),
    (["data.progressive.start_size=8", "data.progressive.end_epoch=3", "optim.epochs=2"],
     "data.progressive.end_epoch=3 is past optim.epochs=2"),
    (["data.progressive.start_size=8", "data.progressive.start_epoch=2", "data.progressive.end_epoch=2",
      "optim.epochs=2"], "start_epoch=2 must come before end_epoch=2"),
    (["data.progressive.end_epoch=2", "optim.epochs=2"], "data.progressive.start_size: missing"),
])
def test_a_schedule_that_does_not_end_at_the_models_size_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("smoke", overrides)


def test_the_readmes_progressive_resolution_check_runs_as_written_and_lists_the_sizes(capsys):
    (command,) = readme_block("a model that cannot take a size is named with it):")
    program, *argv = shlex.split(command)
    assert program == "vitsweep" and main(argv) == 0  # in this process: the CLI's own entry
    # 8 px to epoch 1, 16 from epoch 3; epoch 2 halfway (12 px) rounds to 2 patches of 8
    assert capsys.readouterr().out.rstrip().endswith("training crops 8 px epoch 1, 16 px epochs 2-4")


def test_a_sweep_prunes_the_trials_whose_model_cannot_take_a_crop_size_before_any_starts():
    from pipeline.config.loading import with_dotted
    from pipeline.sweeps.planning import plan_trials
    from pipeline.sweeps.spaces import parse_space

    # A ViT with a fixed position table takes no crop but its own, with dynamic_img_size it takes them all; a
    # start of 24 px rounds to 2 patches of 16, the model's own 32 px: no smaller crop at all.
    space = parse_space("params:\n  model.args.dynamic_img_size: {values: [false, true]}\n"
                        "  data.progressive.start_size: {values: [16, 24]}\n", "test", "test.yaml")
    base = with_dotted(load_config("smoke", ["model.name=deit_tiny_p16", "model.img_size=32", "optim.epochs=2",
                                             "data.progressive.start_size=16", "data.progressive.end_epoch=2"]
                                   ).model_dump(mode="json"), space.fixed)
    plan = plan_trials(space, base, "grid", None, seed=0)
    assert len(plan.variants) == 3 and {"model.args.dynamic_img_size": False,
                                        "data.progressive.start_size": 16} not in plan.variants
    (pruned,) = plan.pruned
    assert pruned["knobs"] == {"model.args.dynamic_img_size": False, "data.progressive.start_size": 16}
    assert "deit_tiny_p16 cannot train at 16 px, the crop size of epoch 1" in pruned["reason"]
