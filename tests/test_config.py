"""The experiment config: presets load, overrides apply, YAML round-trips, bad input names its key."""
import pytest
import yaml

from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import available_presets, load_config, parse_override, validate
from pipeline.errors import ConfigError, InvalidInputError


def test_default_preset_is_the_default_config_source():
    assert load_config() == load_config("default")


@pytest.mark.parametrize("preset", available_presets())
def test_every_shipped_preset_validates(preset):
    assert isinstance(load_config(preset), ExperimentConfig)


def test_yaml_round_trip_gives_the_same_object(tmp_path):
    cfg = load_config("smoke", ["optim.lr=3e-4", "model.args.qkv=linear", "data.crop_scale=[0.5, 1.0]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    reloaded = load_config(str(path))
    assert reloaded == cfg
    assert reloaded.to_yaml() == cfg.to_yaml()


def test_dotted_override_sets_nested_value():
    cfg = load_config("default", ["optim.lr=1e-3", "optim.schedule.min_lr=0", "deepspeed.zero_stage=2"])
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.optim.schedule.min_lr == 0
    assert cfg.deepspeed.zero_stage == 2


def test_override_into_model_args_keeps_types():
    cfg = load_config("default", ["model.args.code_size=16", "model.args.qkv=fsne", "model.args.share_codes=false"])
    assert cfg.model.args == {"code_size": 16, "qkv": "fsne", "share_codes": False}


def test_scientific_notation_override_is_a_number():
    assert parse_override("optim.lr=5e-4") == ("optim.lr", 5e-4)


def test_flat_keys_are_stable_dotted_names():
    flat = load_config("default").flat()
    assert flat["optim.lr"] == pytest.approx(1e-3)
    assert flat["deepspeed.zero_stage"] == 1
    assert "optim.schedule.warmup_epochs" in flat
    assert all("." in key for key in flat)


# Each case: overrides applied to the default preset, and the dotted key the error must name.
INVALID = [
    ("unknown_top_level_section", ["optimiser.lr=1"], "optimiser"),
    ("unknown_key_in_section", ["optim.learning_rate=1e-3"], "optim.learning_rate"),
    ("wrong_type_for_lr", ["optim.lr=fast"], "optim.lr"),
    ("negative_lr", ["optim.lr=-0.1"], "optim.lr"),
    ("zero_lr", ["optim.lr=0"], "optim.lr"),
    ("negative_weight_decay", ["optim.weight_decay=-0.05"], "optim.weight_decay"),
    ("zero_epochs", ["optim.epochs=0"], "optim.epochs"),
    ("zero_workers", ["scaling.num_workers=0"], "scaling.num_workers"),
    ("unknown_model_name", ["model.name=xcit_gigantic_99"], "model.name"),
    ("bad_precision", ["deepspeed.precision=fp8"], "deepspeed.precision"),
    ("zero_stage_4", ["deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    ("loss_spike_factor_not_above_1", ["run.loss_spike_factor=1"], "run.loss_spike_factor"),
    ("zero_max_loss_spikes", ["run.max_loss_spikes=0"], "run.max_loss_spikes"),
    ("distillation_temperature_without_soft", ["distill.tau=3"], "applies to kind=soft only"),
    ("unknown_distillation_kind", ["distill.kind=token"], "distill.kind"),
    ("profile_of_zero_steps", ["run.profile=steps:0"], "run.profile"),
    ("profile_by_epochs", ["run.profile=epochs:1"], "run.profile"),
    ("profile_as_a_bare_number", ["run.profile=5"], "run.profile"),
    ("profile_past_its_limit", ["run.profile=steps:21"], "run.profile"),
    ("fp16_on_cpu", ["deepspeed.precision=fp16"], "fp16"),
    ("offload_without_zero", ["deepspeed.zero_stage=0", "deepspeed.offload_optimizer=true"], "offload_optimizer"),
    ("unknown_compile_backend", ["deepspeed.compile=true", "deepspeed.compile_backend=tvm"], "deepspeed.compile_backend"),
    ("compile_backend_without_compile", ["deepspeed.compile_backend=aot_eager"], "compile_backend"),
    ("gpu_without_gpus_per_worker", ["scaling.use_gpu=true"], "gpus_per_worker"),
    ("gpus_without_use_gpu", ["scaling.gpus_per_worker=1"], "gpus_per_worker"),
    ("zero_micro_batch", ["optim.micro_batch_size=0"], "optim.micro_batch_size"),
    ("betas_out_of_range", ["optim.betas=[0.9, 1.5]"], "optim.betas"),
    ("warmup_longer_than_training", ["optim.epochs=2", "optim.schedule.warmup_epochs=5"], "warmup_epochs"),
    ("unknown_schedule", ["optim.schedule.name=step"], "optim.schedule.name"),
    ("crop_scale_reversed", ["data.crop_scale=[1.0, 0.5]"], "data.crop_scale"),
    ("crop_scale_above_one", ["data.crop_scale=[0.5, 2.0]"], "data.crop_scale"),
    ("val_crop_ratio_zero", ["data.val_crop_ratio=0"], "data.val_crop_ratio"),
    ("unknown_loader_order", ["data.order=shuffled"], "data.order"),
    ("no_staging_streams", ["data.stage_streams=0"], "data.stage_streams"),
    ("mixup_prob_above_one", ["data.augment.mixup_prob=1.5"], "data.augment.mixup_prob"),
    ("label_smoothing_of_one", ["data.augment.label_smoothing=1.0"], "data.augment.label_smoothing"),
    ("image_size_too_small", ["model.img_size=2"], "model.img_size"),
    ("drop_path_of_one", ["model.drop_path_rate=1.0"], "model.drop_path_rate"),
    ("img_size_inside_model_args", ["model.args.img_size=64"], "model.args"),
    ("negative_seed", ["run.seed=-1"], "run.seed"),
    ("empty_experiment_name", ["tracking.experiment="], "tracking.experiment"),
    ("max_failures_below_minus_one", ["run.max_failures=-2"], "run.max_failures"),
    ("override_into_a_value", ["optim.lr.value=1"], "optim.lr"),
    ("ema_decay_of_one", ["optim.ema_decay=1.0"], "optim.ema_decay"),
    ("ema_with_zero_stage_3", ["optim.ema_decay=0.999", "deepspeed.zero_stage=3"], "ema_decay"),
    # a score no epoch reports: Ray would log an error to the run's log and keep arbitrary checkpoints
    ("checkpoint_score_no_epoch_reports", ["run.checkpoint_score=val_acc"], "'val_acc' is no metric an epoch reports"),
    ("checkpoint_score_of_the_ema_without_one", ["run.checkpoint_score=val_top1_ema"],
     "run.checkpoint_score names the EMA's val_top1_ema, but optim.ema_decay is null"),
]


@pytest.mark.parametrize("overrides,key", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_config_error_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config("default", overrides)
    assert key in str(err.value)


def test_invalid_value_error_shows_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["deepspeed.zero_stage=4"])
    message = str(err.value)
    assert "4" in message and "0, 1, 2 or 3" in message


def test_a_profile_is_n_training_steps_and_a_bad_one_is_refused_saying_what_is_accepted():
    assert load_config("default").run.profile_steps is None
    assert load_config("default", ["run.profile=steps:1"]).run.profile_steps == 1
    assert load_config("default", ["run.profile=steps:20"]).run.profile_steps == 20
    with pytest.raises(ConfigError) as err:
        load_config("default", ["run.profile=steps:-3"])
    assert "steps:N" in str(err.value) and "1 to 20" in str(err.value)


def test_unknown_key_error_suggests_the_close_valid_key():
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        load_config("default", ["optim.lrr=1e-3"])


def test_unknown_model_error_suggests_close_registered_names():
    with pytest.raises(ConfigError, match="xcit_nano_12_p8"):
        load_config("default", ["model.name=xcit_nano_12_p9"])


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["optim.lr=-1", "scaling.num_workers=0"])
    assert "optim.lr" in str(err.value) and "scaling.num_workers" in str(err.value)


def test_missing_config_file_is_invalid_input(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="smoke"):
        load_config("smok")


def test_malformed_yaml_file_is_invalid_input(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: {lr: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(path))


def test_yaml_file_that_is_not_a_mapping_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(path))


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config("default", ["optim.lr"])


def test_assignment_after_load_is_validated_too():
    cfg = validate({})
    with pytest.raises(ValueError):
        cfg.optim.lr = -1.0


def test_local_paths_become_absolute_and_uris_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("default", ["data.val=s3://bucket/val.beton"]).with_absolute_paths()
    assert cfg.data.train == str(tmp_path / "vitsweep-runs/data/digits_32_train.beton")
    assert cfg.run.storage_path == str(tmp_path / "vitsweep-runs")
    assert cfg.data.val == "s3://bucket/val.beton"


def test_a_tracking_uri_with_a_password_is_rejected_without_echoing_the_password():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["tracking.mlflow_uri=https://alice:s3cret@mlflow.example.com"])
    message = str(err.value)
    assert "tracking.mlflow_uri" in message and "MLFLOW_TRACKING_PASSWORD" in message
    assert "s3cret" not in message


def test_a_tracking_uri_with_a_token_as_its_user_name_is_rejected_without_echoing_it():
    with pytest.raises(ConfigError) as err:
        load_config("default", ["tracking.mlflow_uri=http://s3cret@mlflow.example.com"])
    message = str(err.value)
    assert "tracking.mlflow_uri" in message and "MLFLOW_TRACKING_TOKEN" in message
    assert "s3cret" not in message


def test_a_database_tracking_uri_with_only_an_account_name_is_accepted():
    cfg = load_config("default", ["tracking.mlflow_uri=postgresql://mlflow@db.example.com/mlflow"])
    assert cfg.tracking.mlflow_uri == "postgresql://mlflow@db.example.com/mlflow"
