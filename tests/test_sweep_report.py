"""A sweep's results table (``pipeline.sweeps.report``), read from a real MLflow store as `vitsweep tune`
records its trials: every field of every row, the table and its CSV whole, the terminal table's columns
and widths. Expected values by hand from what the test logged. (The same table end to end:
test_tune_e2e's sweep; the seed summary: test_tune_cli.)"""
import json

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from pipeline.sweeps.report import (TrialRow, cell, format_table, pruned_rows, ranked, seed_groups, seed_table,
                                    sweep_rows, table, to_csv)
from pipeline.sweeps.tracking import KNOBS_TAG, PARENT_TAG, ROLE_TAG, STOP_REASON_TAG, TRIAL_TAG
from pipeline.tracking.store import MlflowRun, MlflowStore

REPORTED = ("val_top1", "val_top5", "val_loss", "train_loss")


def _sweep(tmp_path) -> MlflowRun:
    """A parent and four children as a sweep leaves them: a completed trial over the per-batch rate (its
    rate, size, spend and split recorded), an early-stopped one, one still running (no stop reason yet),
    and one MLflow holds almost nothing of (no trial id, no knobs, an unreadable size)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    store = MlflowStore(uri)
    parent = store.create_run("vitsweep", "lr-sweep", tags={ROLE_TAG: "sweep"})
    client = MlflowClient(uri)

    def child(name: str, tags: dict, params: dict, history: dict[str, list[float]]) -> None:
        run = client.create_run(parent.get().info.experiment_id, run_name=name, tags={PARENT_TAG: parent.run_id, **tags})
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric(k, v, 0, step) for k, values in history.items()
                                  for step, v in enumerate(values, start=1)])

    child("t_00000", {TRIAL_TAG: "t_00000", KNOBS_TAG: json.dumps({"optim.lr_per_512": 0.016}),
                      STOP_REASON_TAG: "completed", "cost.unit": "CPU-core-hours", "oom.split": "16x2"},
          {"model_facts.params": "904000", "model_facts.gflops": "0.003", "optim.lr_effective": "0.001"},
          {"val_top1": [60.0, 85.0], "val_top5": [90.0, 99.0], "val_loss": [1.2, 0.5], "train_loss": [1.5, 0.7],
           "cost/accelerator_hours": [0.01, 0.02]})
    child("t_00001", {TRIAL_TAG: "t_00001", KNOBS_TAG: json.dumps({"optim.lr_per_512": 1.6e-6}),
                      STOP_REASON_TAG: "early_stopped: ASHA stopped it after epoch 1 of 2"},
          {"model_facts.params": "1250000", "model_facts.gflops": "0.004"}, {"val_top1": [8.0]})
    child("t_00002", {TRIAL_TAG: "t_00002", KNOBS_TAG: json.dumps({"optim.lr_per_512": 0.032})}, {}, {})
    child("stray", {}, {"model_facts.params": "many"}, {})
    return parent


def test_every_row_holds_what_mlflow_recorded_of_its_trial(tmp_path):
    rows = {row.run_id and row.trial_id: row for row in sweep_rows(_sweep(tmp_path), "val_top1")}
    done = rows["t_00000"]
    assert (done.state, done.reason, done.knobs, done.epochs) == ("completed", "", {"optim.lr_per_512": 0.016}, 2)
    assert done.metrics == {"val_top1": 85.0, "val_top5": 99.0, "val_loss": 0.5, "train_loss": 0.7}  # the last epoch's
    assert (done.params_m, done.gflops, done.lr_effective) == (0.904, 0.003, 0.001)  # 904,000 parameters: 0.904 M
    assert (done.accelerator_hours, done.cost_unit, done.split) == (0.02, "CPU-core-hours", "16x2")
    stopped = rows["t_00001"]
    assert (stopped.state, stopped.reason, stopped.epochs, stopped.params_m) == (
        "early_stopped", "ASHA stopped it after epoch 1 of 2", 1, 1.25)
    assert (stopped.lr_effective, stopped.accelerator_hours, stopped.cost_unit, stopped.split) == (None, None, "", "")
    running = rows["t_00002"]
    assert (running.state, running.reason, running.epochs, running.metrics) == ("running", "", 0, {})
    (stray,) = [row for row in rows.values() if not row.trial_id]
    assert (stray.trial_id, stray.knobs, stray.params_m, stray.gflops, stray.state) == ("", {}, None, None, "running")
    assert all(len(row.run_id) == 32 for row in rows.values())


def test_the_table_and_its_csv_read_whole_best_first(tmp_path):
    rows = sweep_rows(_sweep(tmp_path), "val_top1") + pruned_rows([{"knobs": {"optim.lr_per_512": 9.0},
                                                                   "reason": "lr too big"}])
    header, body = table(rows, "val_top1", "max")
    assert header == ["trial", "state", "lr_per_512", "lr_effective", "oom_split", "epochs", "val_top1", "val_top5",
                      "val_loss", "train_loss", "params_M", "gflops", "CPU_core_hours", "reason", "mlflow_run"]
    run_ids = {row.trial_id: row.run_id for row in rows}
    # scored first, best first; then the rest by state, then trial id ('' for the pruned sample and the stray run)
    assert [line[:13] for line in body] == [
        ["t_00000", "completed", "0.016", "0.001", "16x2", "2", "85", "99", "0.5", "0.7", "0.904", "0.003", "0.02"],
        ["t_00001", "early_stopped", "1.6e-06", "", "", "1", "8", "", "", "", "1.25", "0.004", ""],
        ["-", "pruned", "9", "", "", "0", "", "", "", "", "", "", ""],
        ["-", "running", "", "", "", "0", "", "", "", "", "", "", ""],
        ["t_00002", "running", "0.032", "", "", "0", "", "", "", "", "", "", ""]]
    assert [line[13:] for line in body][:2] == [["", run_ids["t_00000"]],
                                                ["ASHA stopped it after epoch 1 of 2", run_ids["t_00001"]]]
    assert body[2][13:] == ["lr too big", ""]  # a pruned sample never ran
    csv = to_csv(rows, "val_top1", "max").splitlines()
    assert csv[0] == ",".join(header) and csv[1] == ",".join(body[0]) and len(csv) == 1 + len(body)


def test_a_minimised_metrics_table_ranks_the_lowest_first_and_other_metrics_keep_their_columns(tmp_path):
    rows = sweep_rows(_sweep(tmp_path), "val_loss")
    header, body = table(rows, "val_loss", "min")
    assert header[5:10] == ["epochs", "val_loss", "val_top1", "val_top5", "train_loss"]
    assert body[0][0] == "t_00000" and body[0][6:10] == ["0.5", "85", "99", "0.7"]
    assert [line[0] for line in body[1:]] == ["t_00001", "-", "t_00002"]  # no val_loss: by state, then trial id


def test_rows_without_the_metric_follow_by_state_then_trial_id_and_the_scored_by_value():
    rows = [TrialRow(trial, trial, state, "", {}, 1, metrics, None, None)
            for trial, state, metrics in [("b", "running", {}), ("a", "running", {}), ("c", "error", {}),
                                          ("d", "completed", {"val_top1": 50.0}), ("e", "completed", {"val_top1": 70.0}),
                                          ("f", "completed", {"val_top1": 60.0})]]
    assert [row.trial_id for row in ranked(rows, "val_top1", "max")] == ["e", "f", "d", "c", "a", "b"]
    assert [row.trial_id for row in ranked(rows, "val_top1", "min")] == ["d", "f", "e", "c", "a", "b"]


def test_the_terminal_table_aligns_every_column_to_its_widest_cell_and_cuts_long_reasons():
    reason = "r" * 70
    rows = [TrialRow("t_00000", "run-a", "error", reason, {"optim.lr": 1e-3}, 1, {"val_top1": 9.5}, 0.9, 0.003),
            TrialRow("t_00001", "run-b", "completed", "", {"optim.lr": 2e-3}, 2, {"val_top1": 80.25}, 0.9, 0.003)]
    lines = format_table(rows, "val_top1", "max").splitlines()
    header, _ = table(rows, "val_top1", "max")
    widths = [len(part) for part in lines[1].split("  ")]
    assert lines[1] == "  ".join("-" * width for width in widths)  # the rule under each column
    assert widths[0] == len("t_00000") and widths[header.index("state")] == len("completed")
    assert widths[header.index("mlflow_run")] == len("mlflow_run")  # the header, wider than "run-a"
    assert widths[header.index("reason")] == 60  # a reason is cut to 60 characters
    assert lines[2].startswith("t_00001  completed  ") and lines[2].endswith("run-b")  # left-aligned, nothing after
    assert lines[3].startswith("t_00000  error      ") and lines[3].endswith(f"{'r' * 60}  run-a")
    assert all(line == line.rstrip() for line in lines)


def test_a_list_value_reads_in_brackets_with_each_element_as_a_cell():
    assert cell([0.25, 0.5, 1]) == "[0.25, 0.5, 1]" and cell((0.123456,)) == "[0.1235]" and cell([]) == "[]"


def test_configurations_are_grouped_by_their_knobs_whatever_their_order():
    rows = [TrialRow("a", "ra", "completed", "", {"model.name": "eit", "optim.lr": 1e-3, "run.seed": 0}, 2,
                     {"val_top1": 80.0}, None, None),
            TrialRow("b", "rb", "completed", "", {"optim.lr": 1e-3, "run.seed": 1, "model.name": "eit"}, 2,
                     {"val_top1": 84.0}, None, None)]
    (group,) = seed_groups(rows)
    assert group.n("val_top1") == 2 and group.mean("val_top1") == 82.0


def test_a_configuration_no_completed_trial_measured_the_metric_of_shows_no_range():
    rows = [TrialRow("a", "ra", "completed", "", {"model.name": "eit", "run.seed": 0}, 2, {"val_top1": 80.0}, None,
                     None)]
    header, (line,) = seed_table(rows, "val_loss", "min")
    assert dict(zip(header, line))["min"] == "" and dict(zip(header, line))["max"] == ""
    assert dict(zip(header, line))["val_top1 mean"] == "80"


def test_the_spend_column_is_named_by_the_trials_one_unit_else_accelerator_hours():
    def row(unit: str) -> TrialRow:
        return TrialRow("t", "r", "completed", "", {"optim.lr": 1e-3}, 1, {"val_top1": 50.0}, 1.0, 0.01,
                        accelerator_hours=0.5 if unit else None, cost_unit=unit)

    def spend_header(rows: list[TrialRow]) -> str:
        header, _ = table(rows, "val_top1", "max")
        return header[header.index("gflops") + 1]

    assert spend_header([row("GPU-hours"), row("")]) == "GPU_hours"  # a trial that never trained has no unit
    assert spend_header([row("GPU-hours"), row("CPU-core-hours")]) == "accelerator_hours"  # a mixed sweep
    assert spend_header([row(""), row("")]) == "accelerator_hours"
