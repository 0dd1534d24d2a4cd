"""What a sweep spent (``pipeline.sweeps.spend``): totals by how each trial ended, its best trial's alone,
and the completed trials cheapest for their result. Expected values by hand."""
import pytest

from pipeline.sweeps.report import TrialRow, pruned_rows
from pipeline.sweeps.spend import format_spend, front_trials, sweep_spend


def _row(trial: str, state: str, metric: dict, hours: float | None, unit: str = "CPU-core-hours") -> TrialRow:
    return TrialRow(trial, f"run-{trial}", state, "", {"optim.lr": 1e-3}, 2, metric, 1.0, 0.01,
                    accelerator_hours=hours, cost_unit=unit)


ROWS = [_row("a", "completed", {"val_loss": 0.9}, 1.0), _row("b", "completed", {"val_loss": 0.7}, 3.0),
        _row("c", "completed", {"val_loss": 0.8}, 4.0), _row("d", "early_stopped", {"val_loss": 0.1}, 0.5),
        _row("e", "diverged", {}, 0.25), _row("f", "completed", {"val_loss": 0.7}, 3.0)]


def test_the_spend_is_summed_by_how_each_trial_ended_and_a_pruned_sample_spent_nothing():
    spend = sweep_spend(ROWS + pruned_rows([{"knobs": {"optim.lr": 9.0}, "reason": "too big"}]), "val_loss", "min",
                        ROWS[1])
    assert spend.by_state == {"completed": 11.0, "early_stopped": 0.5, "diverged": 0.25}
    assert spend.total == 11.75 and spend.pruned == 1 and spend.unit == "CPU-core-hours"


def test_a_trial_pruned_out_of_memory_spent_what_it_ran_and_is_no_sample_that_spent_nothing():
    out_of_memory = _row("g", "pruned", {}, 0.5)  # it trained until its out-of-memory error
    spend = sweep_spend(ROWS + [out_of_memory] + pruned_rows([{"knobs": {"optim.lr": 9.0}, "reason": "too big"}]),
                        "val_loss", "min", ROWS[1])
    assert spend.by_state["pruned"] == 0.5 and spend.pruned == 1
    assert format_spend(spend, "val_loss").splitlines()[0] == (
        "spend: 12.25 CPU-core-hours in all (completed 11, diverged 0.25, early stopped 0.5, pruned 0.5); "
        "1 pruned sample spent nothing")


def test_the_front_is_the_completed_trials_no_cheaper_one_beats_in_the_metrics_direction():
    # min: a 0.9 at 1; b and f 0.7 at 3 (a tie: both); c 0.8 at 4 is beaten by b; d is better but stopped early
    assert [row.trial_id for row in front_trials(ROWS, "val_loss", "min")] == ["a", "b", "f"]
    maximised = [_row("a", "completed", {"val_top1": 50.0}, 1.0), _row("b", "completed", {"val_top1": 40.0}, 2.0),
                 _row("c", "completed", {"val_top1": 60.0}, 2.0)]
    assert [row.trial_id for row in front_trials(maximised, "val_top1", "max")] == ["a", "c"]


def test_the_spend_reads_as_three_lines():
    spend = sweep_spend(ROWS, "val_loss", "min", ROWS[1])
    assert format_spend(spend, "val_loss").splitlines() == [
        "spend: 11.75 CPU-core-hours in all (completed 11, diverged 0.25, early stopped 0.5)",
        "  the best trial, b, alone: 3 CPU-core-hours",
        "  cheapest for their val_loss (Pareto front over CPU-core-hours): a val_loss 0.9 at 1; b val_loss 0.7 at 3; "
        "f val_loss 0.7 at 3"]


@pytest.mark.parametrize("rows, said", [
    ([], "spend: no trial has recorded any yet"),
    ([_row("a", "running", {}, None)], "spend: no trial has recorded any yet"),
])
def test_a_sweep_whose_trials_recorded_no_spend_says_so(rows, said):
    assert format_spend(sweep_spend(rows, "val_top1", "max", None), "val_top1") == said


def test_trials_of_several_units_are_summed_as_accelerator_hours():
    rows = [_row("a", "completed", {"val_top1": 1.0}, 1.0, "GPU-hours"), _row("b", "completed", {"val_top1": 2.0}, 2.0)]
    assert sweep_spend(rows, "val_top1", "max", None).unit == "accelerator-hours"
