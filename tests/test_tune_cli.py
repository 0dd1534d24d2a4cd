"""`vitsweep tune` / `compare` without Ray: bad input exits 2 before anything runs; the results table."""
import itertools
import json
import math
import re
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from conftest import refused_in_process
from pipeline.cli import EXIT_INVALID_INPUT, EXIT_OK, main
from pipeline.sweeps.runner import RECORD_NAME
from pipeline.sweeps.tracking import KNOBS_TAG, PARENT_TAG, ROLE_TAG, STOP_REASON_TAG, TRIAL_TAG
from pipeline.tracking.store import MlflowStore


def _tune(tmp_path, space_text: str | None, *overrides: str, space: str | None = None) -> list[str]:
    if space_text is not None:
        (tmp_path / "space.yaml").write_text(space_text)
        space = str(tmp_path / "space.yaml")
    args = ["tune", "--space", space, "--config", "smoke", "--set", f"run.storage_path={tmp_path / 'runs'}",
            "--set", "optim.epochs=3"]
    for override in overrides:
        args += ["--set", override]
    return args


BAD_SPACES = [
    ("unknown_key", "params:\n  optim.lrr: {values: [1.0e-3]}\n", "optim.lrr"),
    ("empty_choice_list", "fixed:\n  model.args.qkv: fsne\nparams:\n  model.args.code_size: {values: []}\n",
     "model.args.code_size.values = []: give at least one value"),
    ("alpha_outside_unit_interval",
     "fixed:\n  model.args.head: sot\nparams:\n  model.args.svpn_alpha: {uniform: [0.3, 1.5], grid: [0.5]}\n",
     "svpn_alpha = 1.5"),
    ("no_valid_trial", "params:\n  model.args.num_heads: {values: [3, 5, 7]}\n", "yields no valid trial"),
]


@pytest.mark.parametrize("text,expected", [case[1:] for case in BAD_SPACES], ids=[case[0] for case in BAD_SPACES])
def test_bad_space_exits_2_naming_the_problem_writes_nothing_and_starts_no_ray(tmp_path, capsys, text, expected):
    assert expected in refused_in_process(_tune(tmp_path, text), capsys)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, space, expected", [
    ("optim.weight_decay=0.05", "lr_wd", "lr_wd.yaml searches optim.weight_decay"),
    # a whole list whose element the space searches, and a key a derive rule fills
    ("model.args.mha_ratio_range=[0.5, 0.5]", "eit_channel_ratio", "searches model.args.mha_ratio_range.0"),
    ("model.args.mgcrp_m=8", "sot_mgcrp_heads", "sot_mgcrp_heads.yaml derives model.args.mgcrp_m"),
])
def test_a_set_of_a_key_the_space_searches_or_derives_is_refused_not_silently_replaced(tmp_path, capsys, override,
                                                                                       space, expected):
    err = refused_in_process(_tune(tmp_path, None, override, space=space), capsys)
    assert f"--set {override}: " in err and expected in err and "each trial's value would replace it" in err
    assert not (tmp_path / "runs").exists()


def test_a_set_of_the_target_a_derive_rule_reads_is_taken(tmp_path, digits16):
    from pipeline.sweeps.planning import resolve_trial
    from pipeline.sweeps.runner import prepare_sweep

    sweep = prepare_sweep("smoke", [f"run.storage_path={tmp_path}", f"data.train={digits16['train']}",
                                    f"data.val={digits16['val']}", "data.prepare=null", "model.args.repr_size=2000",
                                    "tune.scheduler=fifo"],
                          ["sot_mgcrp_heads"])
    # up_even: the smallest even m with h m^2 >= 2000, by hand: h = 1: 46 (2116); h = 8: 16 (2048)
    trials = [resolve_trial(sweep.space, sweep.base_tree, variant)[0].model.args for variant in sweep.plan.variants]
    sides = {args["mgcrp_heads"]: args["mgcrp_m"] for args in trials}
    assert sides[1] == 46 and sides[8] == 16


def test_searching_the_epochs_needs_fifo_asha_compares_trials_at_the_same_epochs(tmp_path, capsys):
    (tmp_path / "space.yaml").write_text("params:\n  optim.epochs: {values: [2, 3]}\n")
    err = refused_in_process(["tune", "--space", str(tmp_path / "space.yaml"), "--config", "smoke",
                              "--set", f"run.storage_path={tmp_path / 'runs'}", "--set", "tune.grace_period=1"], capsys)
    assert "optim.epochs is searched, but ASHA compares trials at the same epochs" in err and "fifo" in err


def test_a_sweep_searching_the_epochs_records_them_as_searched_not_as_the_base_configs(tmp_path, digits16):
    from pipeline.sweeps.resources import TrialResources
    from pipeline.sweeps.runner import _sweep_params, describe_sweep, prepare_sweep

    (tmp_path / "epochs.yaml").write_text("params:\n  optim.epochs: {values: [1, 2]}\n")
    sweep = prepare_sweep("smoke", [f"run.storage_path={tmp_path}", f"data.train={digits16['train']}",
                                    f"data.val={digits16['val']}", "data.prepare=null", "tune.scheduler=fifo"],
                          [str(tmp_path / "epochs.yaml")])
    assert _sweep_params(sweep, 1, TrialResources.of(sweep.cfg))["optim.epochs"] == "searched"
    assert ", its searched epochs each, optimising val_top1" in describe_sweep(sweep)


def test_a_trial_searched_at_fewer_epochs_than_the_base_config_completes_at_its_own(capsys):
    from types import SimpleNamespace

    from pipeline.sweeps.progress import SweepTable

    table = SweepTable("val_top1", epochs=6)  # the base config's
    trial = SimpleNamespace(trial_id="t1", config={"knobs": {"optim.epochs": 2}}, last_result={"epochs_done": 2})
    table.on_trial_start(0, [], trial)
    for epoch in (1, 2):
        table.on_trial_result(0, [], trial, {"epochs_done": epoch, "val_top1": 50.0})
    table.on_trial_complete(0, [], trial)
    out = capsys.readouterr().out
    assert "trial t1 (epochs=2): epoch 2/2  val_top1 50" in out and "trial t1 (epochs=2): completed" in out
    assert table.render()[1].split() == ["t1", "2", "2/2", "50", "completed"]


def test_unknown_shipped_space_exits_2_with_a_suggestion(tmp_path, capsys):
    assert main(_tune(tmp_path, None, space="fsne_code_sise")) == EXIT_INVALID_INPUT
    assert "did you mean 'fsne_code_size'" in capsys.readouterr().err


def test_the_learning_rate_space_sweeps_the_per_batch_rate_over_a_config_with_an_absolute_one(tmp_path, digits16):
    from pipeline.sweeps.runner import prepare_sweep

    # The default preset gives lr 1e-3 absolutely; lr_wd's fixed optim.lr: null leaves the rate to its knob.
    sweep = prepare_sweep("default", [f"run.storage_path={tmp_path}", f"data.train={digits16['train']}",
                                      f"data.val={digits16['val']}", "data.prepare=null"], ["lr_wd"])
    assert len(sweep.plan.variants) == 9 and not sweep.plan.pruned
    assert {variant["optim.lr_per_512"] for variant in sweep.plan.variants} == {2.5e-4, 5e-4, 1e-3}
    assert sweep.base_tree["optim"]["lr"] is None


def test_an_absolute_rate_set_over_the_learning_rate_space_exits_2_naming_both(tmp_path, capsys):
    assert main(_tune(tmp_path, None, "optim.lr=1e-3", space="lr_wd")) == EXIT_INVALID_INPUT
    assert "optim.lr=0.001 and optim.lr_per_512=" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_asha_grace_period_must_leave_epochs_to_stop(tmp_path, capsys):
    args = _tune(tmp_path, None, "optim.epochs=2", "tune.grace_period=2", space="lr_wd")
    assert main(args) == EXIT_INVALID_INPUT
    assert "tune.grace_period=2 must be < optim.epochs=2" in capsys.readouterr().err


def test_grid_search_refuses_identical_repeats(tmp_path, capsys):
    assert main(_tune(tmp_path, None, "tune.num_samples=3", space="lr_wd")) == EXIT_INVALID_INPUT
    assert "would repeat identical trials" in capsys.readouterr().err


def test_invalid_sweep_setting_names_the_key(tmp_path, capsys):
    assert main(_tune(tmp_path, None, "tune.scheduler=hyperband", space="lr_wd")) == EXIT_INVALID_INPUT
    assert "tune.scheduler" in capsys.readouterr().err


def test_an_existing_sweep_is_not_overwritten(tmp_path, capsys):
    record = tmp_path / "runs" / "mine" / RECORD_NAME
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    assert main(_tune(tmp_path, None, "tune.name=mine", space="lr_wd")) == EXIT_INVALID_INPUT
    assert "--resume" in capsys.readouterr().err
    assert record.read_text() == "{}"


@pytest.mark.parametrize("flags, message", [
    (["--register", "a:b"], "cannot register as 'a:b': Invalid model name"),
    (["--register", "ok", "--alias", "latest"], "'latest' alias name (case insensitive) is reserved"),
    (["--alias", "champion"], "--alias champion names an alias of the model --register NAME registers"),
])
def test_a_registry_name_mlflow_refuses_exits_2_before_the_sweep(tmp_path, capsys, flags, message):
    assert main([*_tune(tmp_path, "params:\n  optim.lr: {values: [1.0e-3]}\n"), *flags]) == EXIT_INVALID_INPUT
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_resume_takes_nothing_but_the_sweep_directory(tmp_path, capsys):
    assert main(["tune", "--resume", str(tmp_path), "--space", "lr_wd"]) == EXIT_INVALID_INPUT
    assert "drop --space" in capsys.readouterr().err


def test_resume_changes_nothing_but_the_budget(tmp_path, capsys):
    assert main(["tune", "--resume", str(tmp_path), "--set", "tune.budget_hours=2", "--set", "optim.lr=1"]) \
        == EXIT_INVALID_INPUT
    assert "drop --set optim.lr=1 (only --set tune.budget_hours=HOURS may change)" in capsys.readouterr().err


def test_a_bad_budget_given_on_resume_exits_2_and_leaves_the_sweeps_record_as_it_was(tmp_path, capsys, digits16):
    from pipeline.sweeps.runner import prepare_sweep

    sweep = prepare_sweep("smoke", [f"run.storage_path={tmp_path}", f"data.train={digits16['train']}",
                                    f"data.val={digits16['val']}", "data.prepare=null", "tune.name=budgeted",
                                    "tune.scheduler=fifo", "tune.budget_hours=0.5"], ["lr_wd"])
    record = tmp_path / "budgeted" / RECORD_NAME
    record.parent.mkdir()
    record.write_text(sweep.record())
    written = record.read_bytes()
    assert main(["tune", "--resume", str(record.parent), "--set", "tune.budget_hours=-1"]) == EXIT_INVALID_INPUT
    assert "tune.budget_hours = -1: Input should be greater than 0" in capsys.readouterr().err
    assert record.read_bytes() == written and sorted(record.parent.iterdir()) == [record]


def test_resume_of_a_directory_without_a_sweep_exits_2(tmp_path, capsys):
    assert main(["tune", "--resume", str(tmp_path)]) == EXIT_INVALID_INPUT
    assert "no sweep there" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Results table
# --------------------------------------------------------------------------------------------------

def _fake_sweep(storage) -> MlflowClient:
    """A finished sweep as `vitsweep tune` records it: a parent and three children."""
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = MlflowStore(client.tracking_uri).experiment_id("vitsweep")  # artifacts beside the store, not in ./mlruns
    parent = client.create_run(experiment, run_name="lr-sweep", tags={ROLE_TAG: "sweep"}).info.run_id
    client.log_batch(parent, params=[Param("tune.metric", "val_top1"), Param("tune.mode", "max"),
                                     Param("space", "lr"), Param("tune.searcher", "grid"),
                                     Param("tune.scheduler", "asha")])
    trials = [("t_00000", 2e-3, [60.0, 85.0], "completed", 0.03),
              ("t_00001", 1e-7, [8.0], "early_stopped: ASHA stopped it", 0.01),
              ("t_00002", 1e-3, [55.0, 80.0], "completed", 0.02)]
    for trial_id, lr, curve, reason, spent in trials:
        run = client.create_run(experiment, run_name=trial_id, tags={
            PARENT_TAG: parent, TRIAL_TAG: trial_id, KNOBS_TAG: json.dumps({"optim.lr": lr}), STOP_REASON_TAG: reason,
            "cost.unit": "CPU-core-hours"})
        client.log_batch(run.info.run_id, metrics=[Metric("val_top1", v, 0, step) for step, v in enumerate(curve)]
                         + [Metric("cost/accelerator_hours", spent, 0, len(curve) - 1)],
                         params=[Param("model_facts.params", "904000"), Param("model_facts.gflops", "0.003")])
        client.set_terminated(run.info.run_id, "FINISHED")
    client.log_text(parent, json.dumps([{"knobs": {"optim.lr": 5.0}, "reason": "too big"}]), "pruned.json")
    return client


def test_compare_prints_the_sweep_table_best_first(tmp_path, capsys):
    _fake_sweep(tmp_path)
    assert main(["compare", "vitsweep", "--set", f"run.storage_path={tmp_path}"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("sweep lr-sweep (RUNNING): space lr, searcher grid, scheduler asha")
    rows = [line.split()[:5] for line in lines[3:7]]
    assert rows == [["t_00000", "completed", "0.002", "2", "85"], ["t_00002", "completed", "0.001", "2", "80"],
                    ["t_00001", "early_stopped", "1e-07", "1", "8"], ["-", "pruned", "5", "0", "too"]]


def test_compare_prints_what_the_sweep_spent_its_best_trial_alone_and_the_cheapest_for_their_result(tmp_path, capsys):
    _fake_sweep(tmp_path)
    assert main(["compare", "vitsweep", "--set", f"run.storage_path={tmp_path}"]) == EXIT_OK
    spend = capsys.readouterr().out.split("\n\n")[1]
    # by hand: 0.03 + 0.02 completed, 0.01 stopped early; t_00002 (80 at 0.02) is cheapest, t_00000 (85) better
    assert spend.splitlines() == [
        "spend: 0.06 CPU-core-hours in all (completed 0.05, early stopped 0.01); 1 pruned sample spent nothing",
        "  the best trial, t_00000, alone: 0.03 CPU-core-hours",
        "  cheapest for their val_top1 (Pareto front over CPU-core-hours): t_00002 val_top1 80 at 0.02; "
        "t_00000 val_top1 85 at 0.03"]
    # the README shows this sweep's spend as `vitsweep compare` prints it
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"```\n{spend.strip()}\n```" in readme


def test_compare_csv_has_one_row_per_trial_and_pruned_sample(tmp_path, capsys):
    _fake_sweep(tmp_path)
    assert main(["compare", "vitsweep", "--csv", "--set", f"run.storage_path={tmp_path}"]) == EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("trial,state,lr,epochs,val_top1") and len(lines) == 1 + 4


def test_compare_prints_which_knob_mattered_under_the_table(tmp_path, capsys):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = MlflowStore(client.tracking_uri).experiment_id("vitsweep")
    parent = client.create_run(experiment, run_name="grid", tags={ROLE_TAG: "sweep"}).info.run_id
    client.log_batch(parent, params=[Param("tune.metric", "val_top1"), Param("tune.mode", "max"),
                                     Param("tune.searcher", "grid")])
    space = "params:\n  model.args.code_size: {values: [8, 16, 32]}\n  optim.lr: {values: [1.0e-3, 2.0e-3, 3.0e-3]}\n"
    client.log_text(parent, json.dumps({"spaces": [["grid", "grid.yaml", space]], "pruned": []}), RECORD_NAME)
    for i, (code_size, lr) in enumerate(itertools.product([8, 16, 32], [1e-3, 2e-3, 3e-3])):
        run = client.create_run(experiment, run_name=f"t{i}", tags={
            PARENT_TAG: parent, TRIAL_TAG: f"t{i}", STOP_REASON_TAG: "completed",
            KNOBS_TAG: json.dumps({"model.args.code_size": code_size, "optim.lr": lr})})
        client.log_metric(run.info.run_id, "val_top1", 50.0 + code_size + 100 * lr, step=3)  # code size drives it
    assert main(["compare", "vitsweep", "--set", f"run.storage_path={tmp_path}"]) == EXIT_OK
    out = capsys.readouterr().out
    table, importances = out.split("\n\nknob importance for val_top1 (fANOVA over 9 configurations; shares sum to 1):\n")
    assert len(table.split("\n\n")[0].splitlines()) == 1 + 2 + 9
    assert [line.split()[0] for line in importances.splitlines()] == ["code_size", "lr"]
    # the README shows this sweep's importances as `vitsweep compare` prints them
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    shown = re.search(r"```\n(knob importance for val_top1 \(fANOVA over 9 [^`]*)```", readme).group(1)
    assert out.endswith(shown)


def test_compare_of_an_unknown_experiment_exits_2_listing_the_known_ones(tmp_path, capsys):
    _fake_sweep(tmp_path)
    assert main(["compare", "vitsweeep", "--set", f"run.storage_path={tmp_path}"]) == EXIT_INVALID_INPUT
    assert "experiments: " in capsys.readouterr().err


@pytest.mark.parametrize("store", ["run.storage_path={tmp}/fresh", "tracking.mlflow_uri=sqlite:///{tmp}/none/store.db"],
                         ids=["a fresh directory", "a sqlite path that does not exist"])
def test_compare_of_a_store_that_does_not_exist_exits_2_and_writes_nothing(tmp_path, capsys, store):
    assert main(["compare", "vitsweep", "--set", store.format(tmp=tmp_path)]) == EXIT_INVALID_INPUT
    assert "nothing was recorded there" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_sweep_record_round_trips_on_a_local_path_and_a_uri(tmp_path):
    from pipeline.uris import read_bytes, write_bytes

    write_bytes(str(tmp_path / "a" / "record.json"), b"local")
    write_bytes(f"file://{tmp_path}/b/record.json", b"uri")
    assert read_bytes(str(tmp_path / "a" / "record.json")) == b"local"
    assert read_bytes(f"file://{tmp_path}/b/record.json") == b"uri"
    assert read_bytes(f"file://{tmp_path}/missing.json") is None
    assert read_bytes(str(tmp_path / "a" / "record.json"), 3, offset=1) == read_bytes(f"file://{tmp_path}/a/record.json", 3, 1) == b"oca"


def test_seeds_are_summarised_per_configuration_as_mean_spread_and_n(tmp_path):
    from pipeline.sweeps.report import TrialRow, format_seed_table, seed_groups

    trials = [("eit", 0, 80.0), ("eit", 1, 84.0), ("eit", 2, 82.0), ("vit", 0, 70.0), ("vit", 1, 72.0)]
    rows = [TrialRow(f"t{i}", f"r{i}", "completed", "", {"model.name": model, "run.seed": seed}, 3,
                     {"val_top1": top1}, 1.0, 0.01) for i, (model, seed, top1) in enumerate(trials)]
    rows.append(TrialRow("t9", "r9", "early_stopped", "", {"model.name": "vit", "run.seed": 2}, 1, {"val_top1": 10.0},
                         1.0, 0.01))  # stopped early: not a finished repeat
    (eit, vit) = seed_groups(rows)
    assert (eit.knobs, eit.n("val_top1"), eit.mean("val_top1"), eit.spread("val_top1")) == (
        {"model.name": "eit"}, 3, 82.0, 2.0)
    assert (vit.n("val_top1"), vit.mean("val_top1")) == (2, 71.0)
    lines = format_seed_table(rows, "val_top1", "max").splitlines()
    assert lines[0].split()[:6] == ["name", "n", "val_top1", "mean", "±", "sd"]
    assert lines[2].split()[:5] == ["eit", "3", "82.00", "±", "2.00"] and lines[3].split()[:5] == ["vit", "2", "71.00", "±", "1.41"]


def test_the_seed_table_reads_whole_best_configuration_first_in_the_metrics_direction():
    from pipeline.sweeps.report import TrialRow, seed_table

    # val_loss is minimised: eit (0.30, 0.50) before vit (0.60, 0.80); each configuration's other metrics as means
    # (vit's trials come first: the table must reorder them in either direction)
    trials = [("vit", 0, 0.60, 70.0), ("vit", 1, 0.80, 72.0), ("eit", 0, 0.30, 80.0), ("eit", 1, 0.50, 84.0)]
    rows = [TrialRow(f"t{i}", f"r{i}", "completed", "", {"model.name": model, "run.seed": seed}, 3,
                     {"val_loss": loss, "val_top1": top1, "val_top5": 99.0, "train_loss": 2 * loss}, 1.0, 0.01)
            for i, (model, seed, loss, top1) in enumerate(trials)]
    header, body = seed_table(rows, "val_loss", "min")
    assert header == ["name", "n", "val_loss mean ± sd", "min", "max", "val_top1 mean", "val_top5 mean",
                      "train_loss mean"]
    # by hand: means 0.4 and 0.7, sample sd sqrt(0.02) = 0.1414, train_loss twice the loss
    assert body == [["eit", "2", "0.40 ± 0.14", "0.3", "0.5", "82", "99", "0.8"],
                    ["vit", "2", "0.70 ± 0.14", "0.6", "0.8", "71", "99", "1.4"]]
    assert [line[0] for line in seed_table(rows[::-1], "val_loss", "max")[1]] == ["vit", "eit"]


def test_a_configuration_without_the_metric_has_no_spread_and_no_range():
    from pipeline.sweeps.report import SeedGroup

    group = SeedGroup({"model.name": "eit"}, {"val_top1": [80.0]})
    assert group.n("val_loss") == 0 and math.isnan(group.mean("val_loss")) and group.spread("val_loss") == 0.0
    assert group.spread("val_top1") == 0.0  # one seed


def test_the_csv_ranks_its_rows_in_the_metrics_direction(tmp_path):
    from pipeline.sweeps.report import TrialRow, to_csv

    rows = [TrialRow(f"t{i}", f"r{i}", "completed", "", {"optim.lr": lr}, 2, {"val_loss": loss}, 1.0, 0.01)
            for i, (lr, loss) in enumerate([(1e-3, 0.9), (2e-3, 0.4), (3e-3, 0.6)])]
    ranked = [line.split(",")[0] for line in to_csv(rows, "val_loss", "min").splitlines()[1:]]
    assert ranked == ["t1", "t2", "t0"]
    assert [line.split(",")[0] for line in to_csv(rows, "val_loss", "max").splitlines()[1:]] == ["t0", "t2", "t1"]


def test_compare_groups_a_sweep_with_seeds_by_configuration(tmp_path, capsys):
    client = _fake_sweep(tmp_path)
    experiment = client.get_experiment_by_name("vitsweep").experiment_id
    (parent,) = client.search_runs([experiment], filter_string=f"tags.`{ROLE_TAG}` = 'sweep'")
    for run in client.search_runs([experiment], filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"):
        knobs = json.loads(run.data.tags[KNOBS_TAG])
        client.set_tag(run.info.run_id, KNOBS_TAG, json.dumps({**knobs, "run.seed": 0}))
    assert main(["compare", "vitsweep", "--set", f"run.storage_path={tmp_path}"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "per configuration, over seeds" in out and "85.00 ± 0.00" in out and "per trial:" in out
