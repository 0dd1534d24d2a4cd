"""Every invalid input is refused by `vitsweep config validate` with exit 2 and a message naming it:
before Ray starts, before anything is written."""
import subprocess

import pytest

from conftest import VITSWEEP, vitsweep_env
from pipeline.cli import EXIT_INVALID_INPUT, EXIT_OK, main
from pipeline.config.loading import load_config, load_yaml
from pipeline.errors import ConfigError


def _validate(capsys, *overrides: str, config: str = "smoke") -> tuple[int, str]:
    args = ["config", "validate", "--config", config]
    for override in overrides:
        args += ["--set", override]
    code = main(args)
    return code, capsys.readouterr().err


def test_a_config_file_that_is_not_utf8_exits_2_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("optim:\n  lr: 1.0e-3  # café\n".encode("latin-1"))
    result = subprocess.run([VITSWEEP, "config", "validate", "--config", str(path)],
                            capture_output=True, text=True, env=vitsweep_env())
    assert result.returncode == EXIT_INVALID_INPUT, result.stderr
    assert "not UTF-8" in result.stderr and "0xe9" in result.stderr and "line 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_search_space_file_that_is_not_utf8_exits_2(tmp_path, capsys):
    path = tmp_path / "space.yaml"
    path.write_bytes("params:\n  optim.lr: [1.0e-3]  # café\n".encode("latin-1"))
    code = main(["tune", "--config", "smoke", "--space", str(path), "--set", f"run.storage_path={tmp_path / 'runs'}"])
    assert code == EXIT_INVALID_INPUT
    assert "search space file" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"], ids=["no_bytes", "only_comments", "empty_mapping"])
def test_an_empty_config_file_is_refused_with_how_to_start_from_a_preset(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert main(["config", "validate", "--config", str(path)]) == EXIT_INVALID_INPUT
    message = capsys.readouterr().err
    assert "is empty" in message and "vitsweep config show --config default > my.yaml" in message


def test_an_image_size_the_patch_does_not_divide_exits_2(capsys):
    code, message = _validate(capsys, "model.img_size=30")
    assert code == EXIT_INVALID_INPUT
    assert "model.img_size=30" in message and "patch_size" in message


def test_heads_that_do_not_divide_the_channels_exit_2_from_the_meta_forward_pass(capsys):
    code, message = _validate(capsys, "model.args.num_heads=5")
    assert code == EXIT_INVALID_INPUT
    assert "'num_heads': 5" in message and "forward pass fails" in message


def test_a_valid_model_is_built_and_run(capsys):
    assert main(["config", "validate", "--config", "smoke"]) == EXIT_OK
    assert "builds and runs" in capsys.readouterr().out


@pytest.mark.parametrize("override,key", [
    ("optim.lr=1e400", "optim.lr"),
    ("optim.weight_decay=.inf", "optim.weight_decay"),
    ("optim.weight_decay=.nan", "optim.weight_decay"),
    ("optim.schedule.min_lr=-.inf", "optim.schedule.min_lr"),
    ("data.crop_scale=[.nan, 1.0]", "data.crop_scale"),
    ("data.augment.mixup_alpha=.inf", "data.augment.mixup_alpha"),
    ("model.args.svpn_alpha=.inf", "model.args"),
], ids=["lr_1e400", "weight_decay_inf", "weight_decay_nan", "min_lr_minus_inf", "nan_in_a_tuple", "mixup_inf",
        "inf_in_model_args"])
def test_a_non_finite_float_anywhere_exits_2_naming_its_key(capsys, override, key):
    code, message = _validate(capsys, override)
    assert code == EXIT_INVALID_INPUT
    assert key in message and ("finite" in message)


@pytest.mark.parametrize("override,key", [
    ("run.seed=4294967296", "run.seed"),
    ("tune.seed=99999999999999999999", "tune.seed"),
    ("optim.micro_batch_size=9223372036854775808", "optim.micro_batch_size"),
    ("optim.epochs=3000000000", "optim.epochs"),
    ("model.args.depth=9223372036854775808", "model.args"),
], ids=["seed_past_uint32", "tune_seed_past_int64", "batch_past_int64", "epochs_past_int32", "huge_int_in_model_args"])
def test_an_integer_too_large_for_the_loaders_exits_2_naming_the_bound(capsys, override, key):
    code, message = _validate(capsys, override)
    assert code == EXIT_INVALID_INPUT
    assert key in message and "2147483647" in message


def test_the_largest_allowed_seed_is_accepted():
    assert load_config("smoke", ["run.seed=2147483647"]).run.seed == 2**31 - 1


def test_quasi_random_order_with_several_workers_is_refused_before_any_worker_exists():
    with pytest.raises(ConfigError, match="quasi_random.*scaling.num_workers=2"):
        load_config("smoke", ["data.order=quasi_random", "scaling.num_workers=2"])


def test_quasi_random_order_on_one_worker_is_accepted():
    assert load_config("smoke", ["data.order=quasi_random", "scaling.num_workers=1"]).data.order == "quasi_random"


@pytest.mark.parametrize("key", ["run.storage_path", "tune.storage_path", "data.cache_dir", "data.train"])
def test_a_location_below_an_existing_file_exits_2_and_creates_nothing(tmp_path, capsys, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, message = _validate(capsys, f"{key}={blocker / 'below' / 'x.beton'}")
    assert code == EXIT_INVALID_INPUT
    assert key in message and f"{str(blocker)!r} is a file" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.parametrize("key", ["run.storage_path", "tune.storage_path", "data.cache_dir"])
def test_a_directory_location_that_is_an_existing_file_exits_2(tmp_path, capsys, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code, message = _validate(capsys, f"{key}={blocker}")
    assert code == EXIT_INVALID_INPUT
    assert key in message and "a directory is needed" in message


@pytest.mark.parametrize("key", ["data.train", "data.val", "distill.teacher_checkpoint"])
def test_a_directory_given_for_a_file_exits_2_saying_it_is_a_directory(tmp_path, capsys, key):
    teacher = ["distill.teacher=xcit_nano_12_p8"] if key.startswith("distill") else []
    code, message = _validate(capsys, f"{key}={tmp_path}", *teacher)
    assert code == EXIT_INVALID_INPUT
    assert f"{key}: {str(tmp_path)!r} is a directory, and a file is needed here" in message


def test_a_config_file_that_is_a_directory_exits_2_saying_so(tmp_path, capsys):
    (tmp_path / "my.yaml").mkdir()
    code, message = _validate(capsys, config=str(tmp_path / "my.yaml"))
    assert code == EXIT_INVALID_INPUT
    assert f"{str(tmp_path / 'my.yaml')!r} is a directory, and a file is needed here" in message


def test_a_search_space_file_that_is_a_directory_exits_2_saying_so(tmp_path, capsys):
    (tmp_path / "space.yaml").mkdir()
    code = main(["tune", "--config", "smoke", "--space", str(tmp_path / "space.yaml"),
                 "--set", f"run.storage_path={tmp_path / 'runs'}"])
    assert code == EXIT_INVALID_INPUT
    assert "search space file: " in (message := capsys.readouterr().err) and "is a directory" in message


def test_a_key_given_twice_in_a_config_file_exits_2_naming_the_key_and_both_lines(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  name: xcit_nano_12_p8\noptim:\n  lr: 1.0e-3\n  epochs: 3\n  lr: 2.0e-3\n")
    code, message = _validate(capsys, config=str(path))
    assert code == EXIT_INVALID_INPUT
    assert "optim.lr is given twice (lines 4 and 6)" in message


def test_a_key_given_twice_in_an_override_value_exits_2_naming_it(capsys):
    code, message = _validate(capsys, "model.args={depth: 1, depth: 2}")
    assert code == EXIT_INVALID_INPUT
    assert "depth is given twice (line 1)" in message


def test_a_key_given_twice_in_a_search_space_file_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "space.yaml"
    path.write_text("params:\n  optim.lr: {values: [1.0e-3]}\n  optim.lr: {values: [5.0e-4]}\n")
    code = main(["tune", "--config", "smoke", "--space", str(path), "--set", f"run.storage_path={tmp_path / 'runs'}"])
    assert code == EXIT_INVALID_INPUT
    assert "params.optim.lr is given twice (lines 2 and 3)" in capsys.readouterr().err


def test_yaml_merge_keys_may_still_be_overridden():
    assert load_yaml("base: &b {lr: 1, epochs: 2}\noptim:\n  <<: *b\n  lr: 3\n")["optim"] == {"lr": 3, "epochs": 2}


@pytest.mark.parametrize("model", ["xcit_nano_12_p16", "deit_tiny_p16", "vit_mini_p4", "eit16_4_3_mini", "sot_tiny"])
@pytest.mark.parametrize("depth", [0, 2.5])
def test_a_depth_without_blocks_exits_2_naming_the_key_and_the_valid_range(capsys, model, depth):
    code, message = _validate(capsys, f"model.name={model}", f"model.args.depth={depth}", "model.img_size=32")
    assert code == EXIT_INVALID_INPUT
    assert f"depth={depth} is out of range for {model}" in message and "integer >= 1" in message


def test_a_train_and_val_whose_labels_name_other_classes_exit_2_before_ray(digits16, tmp_path, capsys):
    """`data write --classes 6,7,...` labels in the order given: the same classes in another order for the
    val split would score every 6 as a 7 and back, with equal class counts."""
    import json
    import shutil

    from conftest import refused_in_process, train_command
    from pipeline.data.sidecar import sidecar_path

    val = tmp_path / "val.beton"
    shutil.copy(digits16["val"], val)
    sidecar = json.loads(sidecar_path(digits16["val"]).read_text())
    classes = sidecar["classes"]
    classes[6], classes[7] = classes[7], classes[6]
    sidecar["counts_per_class"] = {name: sidecar["counts_per_class"][name] for name in classes}
    sidecar_path(val).write_text(json.dumps(sidecar))
    err = refused_in_process(train_command(tmp_path / "runs", {"train": digits16["train"], "val": val})[1:], capsys)
    assert "label 6 is class '6' in data.train but '7' in data.val (2 label(s) differ)" in err
    assert not (tmp_path / "runs").exists()


def test_a_training_set_too_small_for_one_optimizer_step_per_worker_exits_2_before_ray(digits16, tmp_path, capsys):
    """1,437 images on 2 workers: 719 each (DistributedSampler's ceil), 2 whole micro-batches of 256, fewer than
    the 4 a step accumulates: the workers' loaders would have no step to train."""
    from conftest import refused_in_process, train_command

    err = refused_in_process(train_command(tmp_path / "runs", digits16, "optim.micro_batch_size=256",
                                           "optim.grad_accum_steps=4", "scaling.num_workers=2")[1:], capsys)
    assert ("data.train's 1437 images make no optimizer step on each of 2 worker(s): a step takes 256 x 4 "
            "(optim.micro_batch_size x grad_accum_steps) of its share") in err
    assert not (tmp_path / "runs").exists()


def test_the_steps_counted_before_training_are_the_loaders_own(digits16):
    """``train_steps_per_epoch`` against ffcv's loader itself (one process: the whole set, whole batches)."""
    from pipeline.data.loaders import build_train_loader, train_steps_per_epoch
    from pipeline.data.sidecar import read_sidecar

    data = load_config("smoke").data
    images = read_sidecar(digits16["train"]).num_samples
    for batch, per_step in ((32, 1), (100, 3), (500, 3)):
        loader = build_train_loader(data, digits16["train"], batch, 16, "cpu", batches_per_step=per_step)
        assert train_steps_per_epoch(images, data, batch, per_step, 1) == len(loader) // per_step


def test_more_decoding_threads_than_this_machine_runs_exit_2_before_a_local_ray(digits16, tmp_path, capsys):
    import numba

    from conftest import refused_in_process, train_command

    err = refused_in_process(train_command(tmp_path / "runs", digits16, "data.num_workers=256")[1:], capsys)
    assert (f"data.num_workers=256 exceeds the {numba.config.NUMBA_NUM_THREADS} decoding threads this node can run"
            in err)
    assert not (tmp_path / "runs").exists()
