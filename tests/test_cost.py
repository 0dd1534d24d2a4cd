"""What a run costs (``pipeline.training.cost``): accelerator-hours as wall time x the accelerators its
workers hold, on top of what earlier attempts recorded, and the first epoch that reaches
``run.target_metric``, logged beside the epochs in MLflow. Expected values by hand. End to end: the
ZeRO-2 run's target (test_training) and a run through a group restart and a re-run (test_fault_injection)."""
import pytest

from pipeline.config.loading import load_config
from pipeline.config.specs import MetricTarget
from pipeline.console import MARK
from pipeline.errors import ConfigError
from pipeline.tracking.store import MlflowStore
from pipeline.training.cost import (ACCELERATOR_HOURS, ACCELERATOR_HOURS_TO_TARGET, CPU_CORE_HOURS, GPU_HOURS,
                                    TARGET_EPOCH, WALL_HOURS, WALL_HOURS_TO_TARGET, RunCost, accelerators_held,
                                    cost_unit)
from pipeline.training.epoch_logger import MLflowEpochLogger


def _epoch(epoch: int, top1: float, loss: float = 1.0) -> dict:
    return {"epoch": epoch, "train_loss": loss, "val_loss": loss, "val_top1": top1, "val_top5": 99.0, "lr": 1e-3,
            "images_per_sec": 100.0, "epoch_time_s": 1.0}


@pytest.mark.parametrize("overrides, held, unit", [
    (["scaling.num_workers=2", "scaling.cpus_per_worker=1"], 2, CPU_CORE_HOURS),
    (["scaling.num_workers=3", "scaling.cpus_per_worker=4"], 12, CPU_CORE_HOURS),
    (["scaling.num_workers=8", "scaling.use_gpu=true", "scaling.gpus_per_worker=1", "scaling.cpus_per_worker=10"],
     8, GPU_HOURS),
])
def test_a_run_holds_its_workers_gpus_or_on_cpu_their_cores(overrides, held, unit):
    cfg = load_config("smoke", overrides)
    assert accelerators_held(cfg) == held
    assert cost_unit(cfg) == unit


def test_an_attempt_costs_its_wall_time_times_what_it_holds_on_top_of_the_earlier_attempts():
    cfg = load_config("smoke", ["scaling.num_workers=2", "scaling.cpus_per_worker=3"])
    cost = RunCost.begin(cfg, {WALL_HOURS: 0.25, ACCELERATOR_HOURS: 1.5, "val_top1": 50.0})
    assert cost.so_far(cost.started + 1800) == pytest.approx({WALL_HOURS: 0.75, ACCELERATOR_HOURS: 1.5 + 0.5 * 6})
    assert cost.so_far(cost.started) == pytest.approx({WALL_HOURS: 0.25, ACCELERATOR_HOURS: 1.5})


@pytest.mark.parametrize("spec, metric, operator, value", [
    ("val_top1>=75", "val_top1", ">=", 75.0), ("val_loss<=0.9", "val_loss", "<=", 0.9),
    (" val_top5 >= 1e1 ", "val_top5", ">=", 10.0), ("val_top1_ema>=60", "val_top1_ema", ">=", 60.0),
])
def test_a_target_is_a_reported_metric_a_bound_and_its_direction(spec, metric, operator, value):
    assert MetricTarget.parse(spec) == MetricTarget(metric, operator, value)


@pytest.mark.parametrize("spec", ["val_top1>75", "val_top1=75", "accuracy>=75", "val_top1>=", "val_top1>=inf",
                                  "train_loss_ema<=1", "val_top1>=seventy"])
def test_a_target_that_is_not_one_is_refused_saying_what_is_accepted(spec):
    with pytest.raises(ConfigError) as refused:
        load_config("smoke", [f"run.target_metric={spec}"])
    assert f"run.target_metric = {spec!r}: {spec!r} is not a target: give METRIC>=VALUE or METRIC<=VALUE" \
        in str(refused.value)


def test_a_target_on_the_emas_metric_needs_an_ema():
    with pytest.raises(ConfigError, match="names the EMA's val_top1_ema, but optim.ema_decay is null"):
        load_config("smoke", ["run.target_metric=val_top1_ema>=50"])
    assert load_config("smoke", ["run.target_metric=val_top1_ema>=50", "optim.ema_decay=0.99"]).run.target


def test_the_first_epoch_that_reaches_the_target_is_the_one_recorded_and_only_once():
    cost = RunCost.begin(load_config("smoke", ["run.target_metric=val_loss<=0.5"]), {})
    assert TARGET_EPOCH not in cost.at_epoch(_epoch(1, 20.0, loss=0.8))
    reached = cost.at_epoch(_epoch(2, 30.0, loss=0.5))  # the bound itself counts
    assert reached[TARGET_EPOCH] == 2
    assert reached[WALL_HOURS_TO_TARGET] == reached[WALL_HOURS]
    assert reached[ACCELERATOR_HOURS_TO_TARGET] == reached[ACCELERATOR_HOURS]
    assert TARGET_EPOCH not in cost.at_epoch(_epoch(3, 40.0, loss=0.3))
    # a run whose earlier attempt reached it (its MLflow run holds the epoch) does not reach it again
    again = RunCost.begin(load_config("smoke", ["run.target_metric=val_loss<=0.5"]), {TARGET_EPOCH: 2.0})
    assert TARGET_EPOCH not in again.at_epoch(_epoch(3, 40.0, loss=0.3))


def test_each_epoch_logs_the_runs_spend_so_far_and_the_target_once_with_the_console_saying_it(tmp_path, capsys):
    """The controller's side, on a real store: the totals at every epoch's step, never falling, the
    target's three metrics at its epoch alone, and a line beside that epoch's."""
    store = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db")
    run = store.create_run("vitsweep", "costed")
    cfg = load_config("smoke", ["run.target_metric=val_top1>=60", "scaling.num_workers=2"])
    logger = MLflowEpochLogger(run, 3, RunCost.begin(cfg, {}))
    for epoch, top1 in [(1, 40.0), (2, 65.0), (3, 70.0)]:
        logger.after_report(None, [_epoch(epoch, top1)], None)
    client = store.client
    history = client.get_metric_history(run.run_id, ACCELERATOR_HOURS)
    walls = client.get_metric_history(run.run_id, WALL_HOURS)
    assert [m.step for m in history] == [1, 2, 3] and [m.step for m in walls] == [1, 2, 3]
    assert [m.value for m in history] == sorted(m.value for m in history)
    for spend, wall in zip(history, walls):  # 2 workers x 1 CPU each (the smoke preset's)
        assert spend.value == pytest.approx(2 * wall.value)
    for key in (TARGET_EPOCH, WALL_HOURS_TO_TARGET, ACCELERATOR_HOURS_TO_TARGET):
        assert [m.step for m in client.get_metric_history(run.run_id, key)] == [2], key
    assert run.get().data.metrics[TARGET_EPOCH] == 2
    out = capsys.readouterr().out
    assert f"{MARK}epoch-end 2 reached val_top1>=60 at epoch 2, after 0:00 and " in out
    assert out.count("reached val_top1>=60") == 1
