"""Knob importance (Optuna's fANOVA over a sweep's finished trials) on sweeps whose answer is known."""
import itertools
import math
import random

import pytest

from pipeline.sweeps.importance import CONFIGURATIONS_PER_KNOB, MIN_CONFIGURATIONS, format_importance, knob_importance
from pipeline.sweeps.report import TrialRow
from pipeline.sweeps.spaces import Dimension

CODE_SIZE = Dimension("model.args.code_size", "values", values=(8, 16, 32, 48, 64))
LR = Dimension("optim.lr", "loguniform", low=1e-4, high=3e-3)
SEED = Dimension("run.seed", "values", values=(0, 1, 2))


def _rows(values: list[tuple[dict, float]], state: str = "completed") -> list[TrialRow]:
    return [TrialRow(f"t{i:03d}", f"r{i}", state, "", knobs, 3, {"val_top1": top1}, 1.0, 0.01)
            for i, (knobs, top1) in enumerate(values)]


def _grid(metric, seeds=(None,)) -> list[TrialRow]:
    """A 5 x 5 grid over code size and lr (+ seeds), the metric a function of them."""
    rng = random.Random(0)
    values = []
    for code_size, lr, seed in itertools.product([8, 16, 32, 48, 64], [1e-4, 3e-4, 1e-3, 2e-3, 3e-3], seeds):
        knobs = {"model.args.code_size": code_size, "optim.lr": lr, **({} if seed is None else {"run.seed": seed})}
        values.append((knobs, metric(code_size, lr, seed, rng)))
    return _rows(values)


def test_the_one_knob_that_drives_the_metric_gets_most_of_the_importance():
    rows = _grid(lambda code_size, lr, seed, rng: 50 + 0.5 * code_size + rng.gauss(0, 0.5))
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR], "grid")
    assert list(found.importances) == ["model.args.code_size", "optim.lr"]  # most important first
    assert found.importances["model.args.code_size"] > 0.9


def test_two_equally_strong_knobs_come_out_about_equal():
    # both knobs' five values map to the same five effects, so their main effects are equal
    effect_of_code_size = {8: 0.0, 16: 4.0, 32: 8.0, 48: 12.0, 64: 16.0}
    effect_of_lr = {1e-4: 0.0, 3e-4: 4.0, 1e-3: 8.0, 2e-3: 12.0, 3e-3: 16.0}
    rows = _grid(lambda code_size, lr, seed, rng: 50 + effect_of_code_size[code_size] + effect_of_lr[lr])
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR], "grid")
    assert found.importances["model.args.code_size"] == pytest.approx(0.5, abs=0.1)
    assert found.importances["optim.lr"] == pytest.approx(0.5, abs=0.1)


def test_a_seed_knob_is_averaged_out_and_gets_no_importance():
    # the seed moves each trial by up to 20 points, far more than lr does; averaged over seeds it cancels
    seed_effect = {0: -20.0, 1: 0.0, 2: 20.0}
    rows = _grid(lambda code_size, lr, seed, rng: 50 + 0.5 * code_size + 1e3 * lr + seed_effect[seed], seeds=(0, 1, 2))
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR, SEED], "grid")
    assert "run.seed" not in found.importances and found.configurations == 25
    assert found.importances["model.args.code_size"] > found.importances["optim.lr"]
    assert "  seed: averaged out (repeats of one configuration, not a knob)" in format_importance(found)


def test_too_few_trials_to_say_below_the_minimum_number_of_configurations():
    needed = max(MIN_CONFIGURATIONS, CONFIGURATIONS_PER_KNOB * 2)
    rows = _grid(lambda code_size, lr, seed, rng: 50 + code_size)[:needed - 1]
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR], "grid")
    assert not found.importances and found.needed == needed
    assert format_importance(found).startswith(
        f"knob importance for val_top1: too few trials to say ({needed - 1} configurations; fANOVA needs at least "
        f"{needed}")


def test_only_completed_trials_count():
    rows = _grid(lambda code_size, lr, seed, rng: 50 + code_size)
    stopped = _rows([({"model.args.code_size": 8, "optim.lr": 1e-4}, 0.0)] * 5, state="early_stopped")
    assert knob_importance(rows + stopped, "val_top1", [CODE_SIZE, LR], "grid").configurations == 25


def test_a_single_varying_knob_has_nothing_to_rank_against():
    rows = _rows([({"optim.lr": lr}, top1) for lr, top1 in [(1e-3, 70.0), (2e-3, 80.0)] * 6])
    found = knob_importance(rows, "val_top1", [LR], "grid")
    assert not found.importances
    assert "only lr varies: nothing to rank it against" in format_importance(found)


def test_a_knob_that_applies_to_some_trials_only_is_named_not_assessed():
    rows = _grid(lambda code_size, lr, seed, rng: 50 + code_size)
    rows += _rows([({"model.args.code_size": 8, "optim.lr": 1e-4, "model.args.mha_ratio_range.0": 0.5}, 60.0)])
    ratio = Dimension("model.args.mha_ratio_range.0", "uniform", low=0.0, high=1.0,
                      when=(("model.args.channel_schedule", ("linear",)),))
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR, ratio], "grid")
    assert set(found.importances) == {CODE_SIZE.key, LR.key}
    assert "mha_ratio_range.0: not assessed (applies to some trials only)" in format_importance(found)


def test_categorical_knobs_are_assessed_by_category():
    rng = random.Random(1)
    rows = _rows([({"model.args.qkv": qkv, "optim.lr": lr}, {"linear": 60.0, "sne": 80.0, "fsne": 70.0}[qkv]
                   + rng.gauss(0, 0.5)) for qkv, lr in itertools.product(["linear", "sne", "fsne"], [1e-4, 1e-3, 1e-2])])
    qkv = Dimension("model.args.qkv", "values", values=("linear", "sne", "fsne"))
    found = knob_importance(rows, "val_top1", [qkv, LR], "grid")
    assert found.importances["model.args.qkv"] > 0.9
    text = format_importance(found)
    assert text.splitlines()[0] == "knob importance for val_top1 (fANOVA over 9 configurations; shares sum to 1):"
    assert text.splitlines()[1].split()[:2] == ["qkv", f"{found.importances['model.args.qkv']:.2f}"]


WD = Dimension("optim.weight_decay", "uniform", low=0.0, high=0.1)


def test_the_space_each_knob_is_integrated_over_is_the_one_it_was_searched_over():
    """fANOVA integrates a knob over its space: a choice (or any grid point) is a category; a uniform
    range is itself; a log-uniform range is its log10, where it was sampled uniformly."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from pipeline.sweeps.importance import _distribution

    distribution, write = _distribution(LR, False, [1e-4, 1e-3])
    assert distribution == FloatDistribution(-4.0, math.log10(3e-3))
    assert write(1e-3) == pytest.approx(-3.0)
    distribution, write = _distribution(WD, False, [0.01, 0.05])
    assert distribution == FloatDistribution(0.0, 0.1) and write(0.05) == 0.05
    # a category per value seen, each written as the sweep's table writes it
    distribution, write = _distribution(CODE_SIZE, False, [8, 64, 8])
    assert isinstance(distribution, CategoricalDistribution) and set(distribution.choices) == {"8", "64"}
    assert write(64) == "64"
    distribution, write = _distribution(LR, True, [3e-4, 1e-4, 3e-4])  # a grid's points are categories
    assert isinstance(distribution, CategoricalDistribution) and len(distribution.choices) == 2
    assert write(1e-4) in distribution.choices and write(3e-4) in distribution.choices


def test_a_range_knob_whose_trials_ran_outside_the_searched_range_is_integrated_over_both():
    """``derive: mgcrp_square`` sets a sampled repr size to 6 m^2 (loguniform 500..6000 gives 486 for m = 9), and
    the 4-digit rounding of a sample may pass a bound: fANOVA's space spans the values the trials ran with."""
    from optuna.distributions import FloatDistribution

    from pipeline.sweeps.importance import _distribution

    repr_size = Dimension("model.args.repr_size", "loguniform", low=500, high=6000)
    assert _distribution(repr_size, False, [486, 1000])[0] == FloatDistribution(math.log10(486), math.log10(6000))
    assert _distribution(WD, False, [0.05, 0.1001])[0] == FloatDistribution(0.0, 0.1001)
    rng = random.Random(5)
    sizes = [6 * round(math.sqrt(rng.uniform(500, 6000) / 6)) ** 2 for _ in range(15)] + [486]
    rows = _rows([({"model.args.repr_size": size, "optim.weight_decay": rng.uniform(0.0, 0.1)},
                   50 + 5 * math.log10(size) + rng.gauss(0, 0.1)) for size in sizes])
    found = knob_importance(rows, "val_top1", [repr_size, WD], "random")
    assert list(found.importances) == ["model.args.repr_size", "optim.weight_decay"]


def test_a_random_sweep_ranks_a_log_uniform_knob_on_its_log_scale():
    """A random sweep over a log-uniform lr and a uniform weight decay, the metric linear in log10(lr)
    (what a log-uniform knob's effect usually is) and blind to the weight decay: lr carries it."""
    rng = random.Random(3)
    draws = [(10 ** rng.uniform(-4, math.log10(3e-3)), rng.uniform(0.0, 0.1)) for _ in range(16)]
    rows = _rows([({"optim.lr": lr, "optim.weight_decay": wd}, 60 + 10 * math.log10(lr) + rng.gauss(0, 0.2))
                  for lr, wd in draws])
    found = knob_importance(rows, "val_top1", [LR, WD], "random")
    assert list(found.importances) == ["optim.lr", "optim.weight_decay"] and found.importances["optim.lr"] > 0.9
    again = knob_importance(rows, "val_top1", [LR, WD], "random")
    assert again.importances == found.importances  # the forest's seed is fixed: the same trials, the same answer


def test_enough_configurations_are_four_per_varying_knob_and_at_least_eight():
    three = [CODE_SIZE, LR, WD]
    values = [({"model.args.code_size": c, "optim.lr": lr, "optim.weight_decay": wd}, 50 + c)
              for c, lr, wd in itertools.product([8, 64], [1e-4, 1e-3], [0.0, 0.05, 0.1])]  # 12 configurations
    too_few = knob_importance(_rows(values[:11]), "val_top1", three, "random")
    assert too_few.needed == 12 and too_few.importances == {} and too_few.configurations == 11
    enough = knob_importance(_rows(values), "val_top1", three, "random")
    assert enough.needed == 12 and set(enough.importances) == {knob.key for knob in three}
    two = knob_importance(_rows(values[:8]), "val_top1", [CODE_SIZE, LR], "random")  # 2 x 4 < 8: at least 8
    assert two.needed == 8 and two.assessed


def test_a_knob_with_one_value_is_named_and_kept_when_there_are_too_few_trials():
    rows = _rows([({"model.args.code_size": c, "optim.lr": lr, "optim.weight_decay": 0.05}, 50.0 + c)
                  for c, lr in [(8, 1e-4), (64, 1e-3)]])
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR, WD], "random")
    assert found.not_assessed == {"optim.weight_decay": "not assessed (one value in the completed trials)"}
    assert format_importance(found).splitlines() == [
        "knob importance for val_top1: too few trials to say (2 configurations; fANOVA needs at least 8: "
        f"{CONFIGURATIONS_PER_KNOB} per knob, at least {MIN_CONFIGURATIONS})",
        "  weight_decay: not assessed (one value in the completed trials)"]


def test_no_knob_varying_is_said_so():
    rows = _rows([({"optim.lr": 1e-3}, 70.0)] * 3)
    assert format_importance(knob_importance(rows, "val_top1", [LR], "random")) == (
        "knob importance for val_top1: no knob varies over the completed trials\n"
        "  lr: not assessed (one value in the completed trials)")


def test_each_knobs_line_aligns_its_name_and_draws_a_bar_of_forty_for_a_share_of_one():
    rows = _grid(lambda code_size, lr, seed, rng: 50 + 0.5 * code_size + rng.gauss(0, 0.5))
    found = knob_importance(rows, "val_top1", [CODE_SIZE, LR], "grid")
    code_size, lr = found.importances["model.args.code_size"], found.importances["optim.lr"]
    assert format_importance(found).splitlines()[1:] == [
        f"  code_size  {code_size:.2f}  {'#' * round(40 * code_size)}",
        f"  lr         {lr:.2f}  {'#' * round(40 * lr)}".rstrip()]
    assert format_importance(found, bars=False).splitlines()[1:] == [
        f"  code_size  {code_size:.2f}", f"  lr         {lr:.2f}"]
