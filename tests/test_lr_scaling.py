"""The learning rate follows the global batch in code: optim.lr_per_512 scaled to micro batch x
accumulation x workers (linear, or sqrt beyond DeiT's and XCiT's 1,024), one rate given one way,
and the optimizer, its schedule, the console and `vitsweep config show` all use the same rate."""
import math
from pathlib import Path

import pytest
import torch

from pipeline.cli import EXIT_INVALID_INPUT, EXIT_OK, main
from pipeline.config.loading import load_config
from pipeline.errors import ConfigError
from pipeline.components.lr_scaling import describe_lr, effective_lr, global_batch_size
from pipeline.components.optim import build_optimizer, build_scheduler

REPO = Path(__file__).resolve().parents[1]
PER_BATCH = ["optim.lr=null", "optim.lr_per_512=5e-4"]  # DeiT's 5e-4 per 512 images


def _config(workers: int, micro: int, accum: int, scaling: str, *more: str):
    return load_config("smoke", [*PER_BATCH, f"optim.lr_scaling={scaling}", f"scaling.num_workers={workers}",
                                 f"optim.micro_batch_size={micro}", f"optim.grad_accum_steps={accum}", *more])


# (workers, micro batch, accumulation) -> global batch; the rate by hand for 5e-4 per 512.
@pytest.mark.parametrize("workers, micro, accum, batch, linear, sqrt", [
    (1, 64, 1, 64, 6.25e-5, 6.25e-5),  # below 1,024 the sqrt rule is the linear rule
    (2, 32, 4, 256, 2.5e-4, 2.5e-4),
    (8, 128, 1, 1024, 1e-3, 1e-3),  # XCiT's and DeiT's own batch and rate
    (8, 128, 4, 4096, 4e-3, 1e-3 * 2),  # sqrt: 1e-3 x sqrt(4096 / 1024)
    (64, 16, 1, 1024, 1e-3, 1e-3),  # the 8 x 8 A100 job at micro batch 16: XCiT's recipe back
    (64, 128, 1, 8192, 8e-3, 1e-3 * math.sqrt(8)),  # the 8 x 8 A100 job
])
def test_the_effective_rate_follows_workers_micro_batch_and_accumulation(workers, micro, accum, batch, linear, sqrt):
    for scaling, expected in (("linear", linear), ("sqrt", sqrt)):
        cfg = _config(workers, micro, accum, scaling)
        assert global_batch_size(cfg.optim, cfg.scaling.num_workers) == batch
        assert effective_lr(cfg.optim, cfg.scaling.num_workers) == pytest.approx(expected), scaling


def test_an_absolute_rate_is_the_same_at_every_batch():
    cfg = load_config("smoke", ["optim.lr=2e-3"])
    assert {effective_lr(cfg.optim, workers) for workers in (1, 2, 8, 64)} == {2e-3}


def test_a_config_giving_no_rate_trains_at_deits_rate_absolutely():
    cfg = load_config("smoke")  # the preset names no rate
    assert cfg.optim.lr is None and cfg.optim.lr_per_512 is None
    assert {effective_lr(cfg.optim, workers) for workers in (1, 64)} == {5e-4}


def test_both_rates_given_is_an_error_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config("smoke", ["optim.lr=1e-3", "optim.lr_per_512=5e-4"])
    assert "optim.lr=0.001 and optim.lr_per_512=0.0005 both give the learning rate" in str(err.value)


@pytest.mark.parametrize("rate", [["optim.lr=1e-3"], []], ids=["absolute", "none"])
def test_sqrt_scaling_without_a_per_batch_rate_is_an_error(rate):
    with pytest.raises(ConfigError, match="optim.lr_scaling='sqrt' scales optim.lr_per_512, which is"):
        load_config("smoke", [*rate, "optim.lr_scaling=sqrt"])


def test_a_per_batch_config_round_trips_through_yaml(tmp_path):
    cfg = _config(64, 128, 1, "sqrt")
    path = tmp_path / "shown.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(str(path)) == cfg


def test_training_with_both_rates_exits_2_naming_both_before_anything_starts(tmp_path, capsys):
    # The old habit on the cluster job: an absolute rate on top of the job's per-batch one.
    code = main(["train", "--config", str(REPO / "cluster/jobs/a100_8x8.yaml"), "--set", "optim.lr=8e-3",
                 "--set", f"run.storage_path={tmp_path}"])
    assert code == EXIT_INVALID_INPUT
    assert "optim.lr=0.008 and optim.lr_per_512=" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_optimizer_and_its_schedule_peak_at_the_effective_rate():
    cfg = _config(8, 128, 4, "sqrt", "optim.epochs=2", "optim.schedule.warmup_epochs=1",
                  "optim.schedule.warmup_lr=1e-6")
    rate = effective_lr(cfg.optim, cfg.scaling.num_workers)
    optimizer = build_optimizer(torch.nn.Linear(4, 2), cfg.optim, rate)
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch=4)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # warmup_lr is absolute (as in DeiT): the warmup rises from it to the scaled rate
    assert seen[0] == pytest.approx(1e-6) and seen[4] == pytest.approx(2e-3) == pytest.approx(rate)


def test_the_start_line_shows_the_batch_factors_and_the_rule_applied():
    cfg = _config(64, 128, 1, "sqrt")
    assert describe_lr(cfg.optim, 64) == ("global batch 8192 = 128 per worker x 1 accumulation step x 64 workers; "
                                          "lr 0.00283 = optim.lr_per_512 0.0005 x 1024/512 x sqrt(8192/1024) "
                                          "(sqrt scaling)")
    assert describe_lr(load_config("smoke", ["optim.lr=2e-3"]).optim, 2).endswith(
        "lr 0.002 (optim.lr, absolute: the same at any batch)")


def test_config_show_adds_the_effective_rate_and_global_batch(capsys):
    overrides = [arg for key in PER_BATCH for arg in ("--set", key)]
    assert main(["config", "show", "--config", "smoke", *overrides, "--flat"]) == EXIT_OK
    flat = capsys.readouterr().out.splitlines()
    assert "optim.lr_per_512=0.0005" in flat and "optim.global_batch_size=64" in flat
    assert "optim.lr_effective=6.25e-05" in flat
    assert main(["config", "show", "--config", "smoke", *overrides]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1] == f"# {describe_lr(load_config('smoke', PER_BATCH).optim, 2)}"


def test_every_worker_is_handed_the_rate_of_the_global_batch_not_of_its_own(tmp_path):
    """The driver decides the rate once (what MLflow records as optim.lr_effective) and hands it to the
    workers in their plan: each worker's own micro batch would give a quarter of it on 4 workers."""
    from pipeline.tracking.store import MlflowRun
    from pipeline.training.cost import RunCost
    from pipeline.training.runs import CheckedRun, ModelFacts, ResolvedData, build_trainer

    cfg = _config(4, 32, 2, "linear")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = CheckedRun(cfg, ResolvedData("train.beton", "val.beton", 10), ModelFacts.measure(cfg.model, 10), "rated",
                     str(tmp_path), uri)
    plan = build_trainer(run, MlflowRun(uri, "run-id"), 0.0, RunCost.begin(cfg, {})).train_loop_config
    assert plan["lr"] == pytest.approx(5e-4 * (32 * 2 * 4) / 512)  # by hand: DeiT's rule on 256 images
