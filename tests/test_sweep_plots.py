"""A sweep's plots read right: a knob per figure, costs only where they vary, no overlapping labels."""
import itertools

import pytest

from pipeline.sweeps.plots import cost_figure, knob_figure, plot_sweep, spend_figure
from pipeline.sweeps.report import TrialRow
from pipeline.sweeps.spend import pareto_front, sweep_spend


def _row(i: int, knobs: dict, top1: float, params_m: float = 1.0, gflops: float = 0.01,
         state: str = "completed") -> TrialRow:
    return TrialRow(f"t{i}", f"r{i}", state, "", knobs, 3, {"val_top1": top1}, params_m, gflops)


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Every pair of drawn tick labels, on any axis of ``fig``, whose text boxes intersect."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pairs = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in axis.get_ticklabels()
                     if t.get_visible() and t.get_text()]
            pairs += [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]
    return pairs


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [text.get_text() for text in legend.get_texts()] if legend else []


def test_pareto_front_keeps_trials_no_cheaper_trial_beats():
    points = [(1.0, 50.0), (2.0, 40.0), (2.0, 70.0), (3.0, 60.0), (4.0, 80.0)]
    assert pareto_front(points, "max") == [(1.0, 50.0), (2.0, 70.0), (4.0, 80.0)]
    assert pareto_front([(1.0, 0.5), (2.0, 0.7), (3.0, 0.2)], "min") == [(1.0, 0.5), (3.0, 0.2)]


def test_plots_cover_each_knob_and_the_cost_pareto_front(tmp_path):
    knobs = [{"model.args.channel_schedule": "linear", "model.args.mha_ratio_range.0": 0.25},
             {"model.args.channel_schedule": "decreasing"}, {"model.args.channel_schedule": "increasing"}]
    rows = [_row(i, knobs[i], top1, params, 0.01 * params, state)
            for i, (state, top1, params) in enumerate([("completed", 70.0, 1.0), ("completed", 80.0, 2.0),
                                                       ("early_stopped", 20.0, 1.5)])]
    written = plot_sweep(rows, "val_top1", "max", tmp_path, log_keys=set())
    # mha_ratio_range.0 applies to one trial only: one point plots nothing
    assert sorted(p.name for p in written) == ["val_top1_vs_channel_schedule.png", "val_top1_vs_params_and_gflops.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_no_plot_is_drawn_for_a_knob_or_a_size_that_does_not_vary(tmp_path):
    rows = [_row(i, {"optim.lr": lr, "model.args.depth": 2}, top1, 0.9, 0.003)
            for i, (lr, top1) in enumerate([(1e-3, 70.0), (2e-3, 80.0)])]
    written = plot_sweep(rows, "val_top1", "max", tmp_path, log_keys=set())
    assert [p.name for p in written] == ["val_top1_vs_lr.png"]


# svPN variants: the parameter counts differ by 14, the GFLOPs in the ninth digit
SVPN = [({"model.args.svpn_iterations": it}, 70.0 + i, (904000 + 7 * i) / 1e6, 0.003012 + 1e-9 * i)
        for i, it in enumerate([1, 3, 5])]


def test_costs_within_one_percent_are_one_level_not_a_pareto_front(tmp_path):
    rows = [_row(i, knobs, top1, params, gflops) for i, (knobs, top1, params, gflops) in enumerate(SVPN)]
    assert cost_figure(rows, "val_top1", "max") is None
    written = plot_sweep(rows, "val_top1", "max", tmp_path, log_keys=set(), discrete_keys={"model.args.svpn_iterations"})
    assert [p.name for p in written] == ["val_top1_vs_svpn_iterations.png"]


def test_only_the_cost_that_varies_is_drawn_the_constant_one_is_said_in_words(tmp_path):
    rows = [_row(i, knobs, top1, params, gflops * (1 + i)) for i, (knobs, top1, params, gflops) in enumerate(SVPN)]
    fig = cost_figure(rows, "val_top1", "max")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "GFLOPs" and "Pareto front" in _legend(ax)
    assert fig._suptitle.get_text() == "parameters (M): 0.904 in every trial (within 1%: one level)"
    assert not overlapping_labels(fig)
    written = plot_sweep(rows, "val_top1", "max", tmp_path, log_keys=set())
    assert written[-1].name == "val_top1_vs_gflops.png"


def test_a_pareto_front_needs_two_cost_levels_among_the_completed_trials():
    # the completed trials are one model size (0.1 % apart); only a stopped trial is bigger
    rows = [_row(0, {"optim.lr": 1e-3}, 70.0, 1.000, 0.01), _row(1, {"optim.lr": 2e-3}, 75.0, 1.001, 0.01),
            _row(2, {"optim.lr": 3e-3}, 20.0, 2.0, 0.02, state="early_stopped")]
    fig = cost_figure(rows, "val_top1", "max")
    assert [ax.get_xlabel() for ax in fig.axes] == ["parameters (M)", "GFLOPs"]
    assert all("Pareto front" not in _legend(ax) for ax in fig.axes)


def test_a_categorical_knob_gets_one_tick_per_value_in_order():
    rows = [_row(i, {"model.args.qkv": qkv}, top1) for i, (qkv, top1) in
            enumerate([("linear", 60.0), ("sne", 70.0), ("fsne", 80.0), ("sne", 72.0)])]
    (ax,) = knob_figure(rows, "model.args.qkv", "val_top1").axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["linear", "sne", "fsne"]
    assert sorted(map(tuple, ax.collections[0].get_offsets().tolist())) == [(0, 60), (1, 70), (1, 72), (2, 80)]


def test_a_discrete_numeric_knob_is_a_category_per_value_in_numeric_order():
    rows = [_row(i, {"model.args.repr_size": size}, 60.0 + i) for i, size in enumerate([4096, 512, 1024])]
    (ax,) = knob_figure(rows, "model.args.repr_size", "val_top1", discrete=True).axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1024", "4096"]


TANGLES = {
    "many_categories": ([_row(i, {"model.args.channel_schedule": f"schedule_{i:02d}"}, 50.0 + i) for i in range(24)],
                        "model.args.channel_schedule", {}),
    "long_list_values": ([_row(i, {"model.args.mha_ratio_range": [0.125 * i, 1.0 - 0.0625 * i]}, 50.0 + i)
                          for i in range(9)], "model.args.mha_ratio_range", {}),
    "long_decimals": ([_row(i, {"optim.weight_decay": 0.050010 + 0.000013 * i}, 50.0 + i) for i in range(6)],
                      "optim.weight_decay", {}),
    "log_range": ([_row(i, {"optim.lr": 1e-5 * 3 ** i}, 50.0 + i) for i in range(8)], "optim.lr", {"log": True}),
}


@pytest.mark.parametrize("case", TANGLES, ids=list(TANGLES))
def test_knob_tick_labels_never_overlap(case):
    rows, key, options = TANGLES[case]
    fig = knob_figure(rows, key, "val_top1", **options)
    assert not overlapping_labels(fig)


def test_cost_tick_labels_never_overlap_on_an_axis_that_varies_by_just_over_one_percent():
    rows = [_row(i, {"optim.lr": 1e-3 * (i + 1)}, 70.0 + i, 0.9040 + 0.0023 * i, 0.0030120 + 0.0000081 * i)
            for i in range(5)]
    fig = cost_figure(rows, "val_top1", "max")
    assert len(fig.axes) == 2 and not overlapping_labels(fig)


def test_the_spend_figure_draws_every_trial_that_spent_and_names_the_front_cheapest_first(tmp_path):
    rows = [TrialRow(f"t{i}", f"r{i}", state, "", {"optim.lr": lr}, 2, {"val_top1": top1}, 1.0, 0.01,
                     accelerator_hours=hours, cost_unit="GPU-hours")
            for i, (state, lr, top1, hours) in enumerate([("completed", 1e-3, 80.0, 2.0), ("completed", 2e-3, 70.0, 1.0),
                                                          ("completed", 3e-3, 75.0, 3.0), ("early_stopped", 4e-3, 20.0, 0.5)])]
    spend = sweep_spend(rows, "val_top1", "max", rows[0])
    fig = spend_figure(rows, "val_top1", spend)
    ax = fig.axes[0]
    drawn = sorted(tuple(point) for collection in ax.collections for point in collection.get_offsets())
    assert drawn == [(0.5, 20.0), (1.0, 70.0), (2.0, 80.0), (3.0, 75.0)]
    assert [text.get_text() for text in ax.texts] == ["t1", "t0"]  # t2 costs more than t0 for less
    assert "Pareto front" in _legend(ax) and ax.get_xlabel() == "GPU-hours spent"
    assert ax.get_title() == "6.5 GPU-hours in all; the best trial alone 2"
    assert not overlapping_labels(fig)
    written = plot_sweep(rows, "val_top1", "max", tmp_path, log_keys={"optim.lr"}, spend=spend)
    assert "val_top1_vs_accelerator_hours.png" in [p.name for p in written]
