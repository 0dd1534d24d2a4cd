"""`vitsweep tune` end to end on 2 cores, one sweep: a trial that runs out of memory goes on at a smaller
micro-batch, ASHA stops a bad trial, a diverging trial fails alone,
the driver killed during the last trial resumes without re-running finished trials, first under a budget
its trials have already spent (it starts nothing and stops, resumable), then with a larger one, and MLflow
holds one parent with a child per trial, each with what it spent. (A TPE sweep: test_cluster_growing_sweep.)"""
import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import timm
from mlflow.tracking import MlflowClient

from conftest import (VITSWEEP, RunningVitsweep, run_vitsweep,
                      sampled_every, tune_command)
import models  # noqa: F401  (registers vitsweep's variants)
from pipeline.cli import EXIT_OK, main
from pipeline.config.loading import load_config
from pipeline.sweeps.runner import TRIAL_RUNS_DIR
from pipeline.training.oom import INJECT_ENV

pytestmark = pytest.mark.slow

EPOCH_METRICS = {"train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_sec", "epoch_time_s"}
BUDGET = 1e-4  # CPU-core-hours, 0.36 s of a CPU: the three trials before the kill spent far more


def _runs(storage):
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = client.get_experiment_by_name("vitsweep")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("vitsweep.role") == "sweep"]
    children = {r.data.tags["trial_id"]: r for r in runs if r.data.tags.get("vitsweep.role") == "trial"}
    return client, parents, children


def _lr(run) -> float:
    """The rate the trial trained at, as MLflow records it beside the knob it was given."""
    return float(run.data.params["optim.lr_effective"])


# --------------------------------------------------------------------------------------------------
# A 4-trial grid under ASHA
# --------------------------------------------------------------------------------------------------

@dataclass
class Lifetime:
    """A process as a sampler saw it: the titles it had (Ray retitles a worker as it takes an actor or
    a task), and when it was first and last seen alive."""
    titles: set[str]
    first: float
    last: float

    def was(self, title: str) -> bool:
        return any(seen.startswith(title) for seen in self.titles)


@contextlib.contextmanager
def lifetimes_below(root_pid: int, every: float = 0.05) -> Iterator[dict[int, Lifetime]]:
    """Every Ray worker process below ``root_pid`` (a local Ray's are all below its driver), by pid, sampled
    every ``every`` s while the block runs. A worker's own children are left out: a fork (a subprocess
    before its exec, a dataloader) carries its parent's ``ray::`` title but is no Ray worker."""
    seen: dict[int, Lifetime] = {}

    def sample() -> None:
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process(root_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if process.status() == psutil.STATUS_ZOMBIE:
                        continue
                    now, title = time.monotonic(), " ".join(process.cmdline())
                    if process.pid in seen:
                        seen[process.pid].last = now
                        seen[process.pid].titles.add(title)
                    elif title.startswith("ray::") and process.ppid() not in seen:
                        seen[process.pid] = Lifetime({title}, now, now)

    with sampled_every(every, sample):
        yield seen


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the sweep's driver, then wait for the Ray processes it started to go with it."""
    tree = psutil.Process(process.pid).children(recursive=True)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    _, alive = psutil.wait_procs(tree, timeout=60)
    for leftover in alive:  # never leave Ray workers running on the shared machine
        leftover.kill()


@dataclass(frozen=True)
class KilledAndResumedSweep:
    """One sweep through everything that ends a trial: completed, stopped by ASHA, diverged, and
    interrupted by a killed driver; then `vitsweep tune --resume` under a budget already spent, which
    stops it again at once, and `--resume` with a larger budget, which completes it."""
    storage: Path
    killed: RunningVitsweep  # the first command, its console with each line's arrival time
    processes: dict[int, Lifetime]  # the Ray processes it started, by pid
    before: dict  # the trials' MLflow runs as the kill left them, by trial id
    history: dict  # their val_top1 (step, timestamp) pairs then
    over_budget: subprocess.CompletedProcess  # `--resume --set tune.budget_hours=BUDGET`
    at_budget: tuple  # (the parent run, the trials' runs by trial id) as it left them
    resumed: subprocess.CompletedProcess  # `--resume --set tune.budget_hours=10`

    @property
    def consoles(self) -> str:
        return self.killed.output + self.over_budget.stdout + self.resumed.stdout + self.resumed.stderr


@pytest.fixture(scope="module")
def asha_sweep(tmp_path_factory, digits16) -> KilledAndResumedSweep:
    storage = tmp_path_factory.mktemp("asha")
    space = storage / "lr.yaml"
    # The rate per 512 images (DeiT's convention), which each trial scales to its global batch of 1 worker x 32:
    # 2e-3; a far too small 1e-7 (below the first trial's result at the first rung); 1e6, which diverges;
    # then 1e-3. One trial at a time (a worker's CPU and the trial function's): each trial follows the end
    # of the one before.
    space.write_text("fixed:\n  optim.lr: null\n"
                     "params:\n  optim.lr_per_512: {values: [3.2e-2, 1.6e-6, 1.6e+7, 1.6e-2]}\n")
    # The first trial's workers run out of memory at its micro-batch of 32 (a fault injected, as a GPU would
    # raise it): it goes on at 16 x 2 accumulation steps.
    sweep = RunningVitsweep(tune_command(storage, digits16, space, "optim.epochs=2", "tune.name=asha",
                                         "tune.scheduler=asha", "tune.grace_period=1", "tune.reduction_factor=2"),
                            env={INJECT_ENV: "*_00000:16"})
    with lifetimes_below(sweep.process.pid) as processes:
        try:
            # the last trial has trained and checkpointed its first epoch (ASHA let it go on: 1e-3 is far
            # above the mean of the two results before it at that rung)
            sweep.wait_for_line("(lr_per_512=0.016): epoch 1/2 ", timeout=1200)
        finally:
            _kill_tree(sweep.process)
            sweep.finish(timeout=60)
    _, _, before = _runs(storage)
    history = {t: [(m.step, m.timestamp) for m in _client(storage).get_metric_history(r.info.run_id, "val_top1")]
               for t, r in before.items()}
    over_budget = run_vitsweep([VITSWEEP, "tune", "--resume", str(storage / "asha"), "--set",
                                f"tune.budget_hours={BUDGET}"], timeout=600)
    assert over_budget.returncode == 0, over_budget.stdout[-4000:] + over_budget.stderr[-4000:]
    _, (parent,), children = _runs(storage)
    resumed = run_vitsweep([VITSWEEP, "tune", "--resume", str(storage / "asha"), "--set", "tune.budget_hours=10"],
                           timeout=1200)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    # no trial may fail but the diverging one: each test below would only see its missing records, not why
    errors = {trial_id: run.data.tags["stop_reason"] for trial_id, run in _runs(storage)[2].items()
              if run.data.tags["stop_reason"].startswith("error")}
    assert not errors, errors
    return KilledAndResumedSweep(storage, sweep, processes, before, history, over_budget, (parent, children), resumed)


def _client(storage):
    return MlflowClient(f"sqlite:///{storage}/mlflow.db")


def _trial_started(output: str) -> set[str]:
    """The trials a sweep's console says it started."""
    return set(re.findall(r"^trial (\w+) \(.*\): started$", output, re.M))


def test_sweep_prints_every_trial_in_its_results_table(asha_sweep):
    storage, result = asha_sweep.storage, asha_sweep.resumed
    _, _, children = _runs(storage)
    assert "sweep asha (finished)" in result.stdout
    assert "knob importance for val_top1: only lr_per_512 varies: nothing to rank it against" in result.stdout
    assert all(trial_id in result.stdout for trial_id in children)
    assert f"sqlite:///{storage}/mlflow.db" in result.stdout


SWEEP_NOISE = ("TrainingReport(", "Checkpoint successfully created", "built successfully", "No CUDA runtime",
               "PreemptionWatcher", "core_worker", "TensorBoard", "Configuration for experiment", "Trial status",
               "Token authentication", "\x1b[")


def test_the_sweeps_console_is_its_own_table_without_library_noise(asha_sweep):
    console, first = asha_sweep.consoles, asha_sweep.killed.output
    assert not [noise for noise in SWEEP_NOISE if noise in console], console[-4000:]
    assert re.search(r"^trial \w+ \(lr_per_512=0\.032\): epoch 1/2  val_top1 [\d.]+$", first, re.M)
    assert re.search(r"^trial \w+ \(lr_per_512=1\.6e-06\): stopped early after epoch 1$", first, re.M)
    assert re.search(r"^trial \w+ \(lr_per_512=1\.6e\+07\): diverged", first, re.M), first[-4000:]
    assert "TrainController" in (asha_sweep.storage / "asha" / "vitsweep.log").read_text()


def test_each_trial_carries_its_knobs_as_short_params_and_the_sweep_a_saved_view(asha_sweep):
    client, (parent,), children = _runs(asha_sweep.storage)
    assert all(run.data.params["lr_per_512"] == run.data.params["optim.lr_per_512"] for run in children.values())
    experiment = client.get_experiment(parent.info.experiment_id)
    view = json.loads(json.loads(experiment.tags["mlflow.sharedViewState.vitsweep-asha"])["state"])
    assert view["selectedColumns"][:3] == ["metrics.`val_top1`", "params.`lr_per_512`", "params.`optim.lr_effective`"]
    assert parent.info.run_id in view["searchFilter"]
    assert "lr_per_512" in parent.data.tags["mlflow.note.content"]


def test_a_sweep_over_the_per_batch_rate_records_it_and_the_rate_each_trial_trained_at(asha_sweep):
    storage, result = asha_sweep.storage, asha_sweep.resumed
    _, _, children = _runs(storage)
    for run in children.values():
        knob = json.loads(run.data.tags["knobs"])["optim.lr_per_512"]
        assert run.data.params["optim.lr_per_512"] == str(knob) and run.data.params["optim.lr"] == "None"
        assert run.data.params["optim.global_batch_size"] == "32"  # 1 worker x 32 x 1
        assert _lr(run) == pytest.approx(knob * 32 / 512)
    # The sweep's final table (and `vitsweep compare`, the same table) shows both, per trial.
    assert re.search(r"^trial +state +lr_per_512 +lr_effective +oom_split +epochs ", result.stdout, re.M)
    assert re.search(r"^\w+ +\w+ +0\.032 +0\.002 ", result.stdout, re.M)  # the 3.2e-2 trial trained at 2e-3


def test_mlflow_holds_one_parent_run_and_a_nested_child_per_trial(asha_sweep):
    _, parents, children = _runs(asha_sweep.storage)
    assert len(parents) == 1 and len(children) == 4
    assert {r.data.tags["mlflow.parentRunId"] for r in children.values()} == {parents[0].info.run_id}
    assert sorted(_lr(r) for r in children.values()) == [1e-7, 1e-3, 2e-3, 1e6]  # as MLflow records them


def test_the_stopped_trials_process_takes_the_next_trial_once_the_stopped_trials_workers_are_gone(asha_sweep):
    sweep, processes = asha_sweep.killed, asha_sweep.processes
    lines = list(zip(sweep.arrivals, sweep.lines))

    def arrival(pattern: str) -> float:
        (at,) = [at for at, line in lines if re.search(pattern, line)]
        return at

    first_started = arrival(r"\(lr_per_512=0\.032\): started$")
    stopped = arrival(r"\(lr_per_512=1\.6e-06\): stopped early after epoch 1$")
    next_started = arrival(r"\(lr_per_512=1\.6e\+07\): started$")
    last_started = arrival(r"\(lr_per_512=0\.016\): started$")
    assert stopped < next_started
    functions = sorted((p for p in processes.values() if p.was("ray::ImplicitFunc")), key=lambda p: p.first)
    # Tune reused the first trial's process for the second and the third; the third failed, and Tune
    # ends a failed trial's process rather than reuse it: the fourth trial runs in a new one.
    assert len(functions) == 2, functions
    assert functions[0].first <= first_started and functions[0].last >= next_started
    assert functions[0].last <= functions[1].first <= last_started
    workers = [p for p in processes.values() if p.was("ray::RayTrainWorker")]
    assert len(workers) == 5, workers  # one per trial, and the first trial's that ran out of memory
    assert [w for w in workers if w.first <= next_started <= w.last] == []  # the stopped trial's had ended


def test_each_trials_checkpoints_are_its_own_runs_epochs(asha_sweep):
    storage = asha_sweep.storage
    client, _, children = _runs(storage)
    for trial_id, run in children.items():
        directory = storage / "asha" / TRIAL_RUNS_DIR / trial_id
        if run.data.tags["stop_reason"].startswith("diverged"):  # in its first epoch: nothing to resume from
            assert not list(directory.glob("checkpoint_*")), trial_id
            continue
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_top1")}
        snapshot = json.loads((directory / "checkpoint_manager_snapshot.json").read_text())
        reported = {r["metrics"]["epoch"]: r["metrics"]["val_top1"] for r in snapshot["checkpoint_results"]}
        assert reported and reported == {epoch: history[epoch] for epoch in reported}, trial_id
        assert all((directory / r["checkpoint_dir_name"]).is_dir() for r in snapshot["checkpoint_results"])
        if run.data.tags["stop_reason"] == "completed":  # its final model was logged from its own directory
            assert json.loads((directory / "mlflow_run.json").read_text())["run_id"] == run.info.run_id


def test_asha_stops_the_clearly_worse_trial_early_and_records_it_as_such(asha_sweep):
    client, _, children = _runs(asha_sweep.storage)
    (bad,) = [r for r in children.values() if _lr(r) == 1e-7]
    assert bad.data.tags["stop_reason"].startswith("early_stopped: ASHA stopped it after epoch 1 of 2")
    assert bad.info.status == "FINISHED"  # stopped by the scheduler, not a failure
    # Its run was aborted as Tune stopped it: no epoch trained (and logged) after the stop.
    assert [m.step for m in client.get_metric_history(bad.info.run_id, "val_top1")] == [1]


def test_each_child_carries_a_training_runs_record_and_its_trial_id(asha_sweep):
    client, _, children = _runs(asha_sweep.storage)
    expected = set(load_config("smoke").flat()) | {"model_facts.params", "model_facts.gflops"}
    for trial_id, run in children.items():
        assert expected <= set(run.data.params), trial_id
        assert run.data.params["run.name"] == trial_id
        assert {"config.yaml", "deepspeed.json", "model_summary.txt"} <= {
            a.path for a in client.list_artifacts(run.info.run_id)}
        if run.data.tags["stop_reason"].startswith("diverged"):
            continue  # it ended in its first epoch, before any epoch's record
        assert EPOCH_METRICS <= set(run.data.metrics), trial_id
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_top1")]
        assert steps == list(range(1, len(steps) + 1)) and steps, trial_id  # epochs count from 1


def test_trials_that_train_every_epoch_finish_with_their_final_model_named_by_trial_and_sweep(asha_sweep):
    client, (parent,), children = _runs(asha_sweep.storage)
    completed = {trial_id: r for trial_id, r in children.items() if r.data.tags["stop_reason"] == "completed"}
    assert sorted(_lr(r) for r in completed.values()) == [1e-3, 2e-3]
    for trial_id, run in completed.items():
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_top1")] == [1, 2]
        assert "model.safetensors" in {a.path for a in client.list_artifacts(run.info.run_id)}
        (output,) = run.outputs.model_outputs
        assert client.get_logged_model(output.model_id).name == f"{trial_id} of {parent.info.run_name}"


def test_parent_records_space_searcher_scheduler_and_best_trial(asha_sweep):
    _, (parent,), children = _runs(asha_sweep.storage)
    params, tags = parent.data.params, parent.data.tags
    assert parent.info.status == "FINISHED"
    assert params["tune.searcher"] == "grid" and params["tune.scheduler"] == "asha" and params["searched_keys"] == "optim.lr_per_512"
    completed = [r for r in children.values() if r.data.tags["stop_reason"] == "completed"]
    # ties are possible on a small validation set: the lower trial id wins one, as the README says
    best = min(completed, key=lambda r: (-r.data.metrics["val_top1"], r.data.tags["trial_id"]))
    assert tags["best_trial_id"] == best.data.tags["trial_id"] and tags["best_run_id"] == best.info.run_id
    assert parent.data.metrics["best_val_top1"] == pytest.approx(best.data.metrics["val_top1"])
    assert (tags["trials_completed"], tags["trials_early_stopped"], tags["trials_diverged"]) == ("2", "1", "1")


def test_parent_holds_the_results_table_and_plots(asha_sweep):
    storage = asha_sweep.storage
    client, (parent,), children = _runs(storage)
    run_id = parent.info.run_id
    assert {"results.csv", "space.yaml", "base_config.yaml", "summary.html"} <= {
        a.path for a in client.list_artifacts(run_id)}
    # every trial has the same size: the rate plot, no size plot, and the spend's
    assert {a.path for a in client.list_artifacts(run_id, "plots")} == {"plots/val_top1_vs_lr_per_512.png",
                                                                         "plots/val_top1_vs_accelerator_hours.png"}
    rows = list(csv.DictReader(io.StringIO(_download(client, run_id, "results.csv", storage))))
    assert {row["trial"] for row in rows} == set(children)
    assert sorted(row["state"] for row in rows) == ["completed", "completed", "diverged", "early_stopped"]


def _download(client, run_id, name, storage) -> str:
    directory = storage / f"artifacts-{run_id}"
    directory.mkdir(exist_ok=True)
    return open(client.download_artifacts(run_id, name, str(directory))).read()


def test_compare_prints_the_same_table_as_the_parents_csv(asha_sweep, capsys):
    storage = asha_sweep.storage
    client, (parent,), _ = _runs(storage)
    recorded = list(csv.reader(io.StringIO(_download(client, parent.info.run_id, "results.csv", storage))))
    capsys.readouterr()
    assert main(["compare", "vitsweep", "--csv", "--set", f"run.storage_path={storage}"]) == EXIT_OK  # as the command runs it
    printed = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert printed == recorded


# --------------------------------------------------------------------------------------------------
# The same sweep, killed during its last trial and resumed
# --------------------------------------------------------------------------------------------------

def test_killed_sweep_left_its_finished_trials_finished(asha_sweep):
    states = {_lr(r): (r.info.status, r.data.tags["stop_reason"]) for r in asha_sweep.before.values()}
    assert states[2e-3] == ("FINISHED", "completed")
    assert states[1e-7][0] == "FINISHED" and states[1e-7][1].startswith("early_stopped")
    assert states[1e6][0] == "FAILED"
    assert states[1e-3][0] == "RUNNING"


def test_resumed_sweep_completes(asha_sweep):
    storage = asha_sweep.storage
    _, (parent,), children = _runs(storage)
    assert parent.info.status == "FINISHED"
    (resumed,) = [r for r in children.values() if _lr(r) == 1e-3]
    assert resumed.info.status == "FINISHED" and resumed.data.tags["stop_reason"] == "completed"
    assert _trial_started(asha_sweep.resumed.stdout) == {resumed.data.tags["trial_id"]}
    # Continued from its checkpoint, not restarted: every epoch logged once.
    assert sorted(m.step for m in _client(storage).get_metric_history(resumed.info.run_id, "val_top1")) == [1, 2]


def test_resume_does_not_rerun_finished_trials(asha_sweep):
    storage, before, history = asha_sweep.storage, asha_sweep.before, asha_sweep.history
    _, _, after = _runs(storage)
    finished = [t for t, r in before.items() if r.info.status != "RUNNING"]
    assert len(finished) == 3
    assert not _trial_started(asha_sweep.resumed.stdout) & set(finished)
    for trial_id in finished:
        assert after[trial_id].info.end_time == before[trial_id].info.end_time
        steps = [(m.step, m.timestamp) for m in _client(storage).get_metric_history(after[trial_id].info.run_id, "val_top1")]
        assert steps == history[trial_id]


def test_resume_continues_the_interrupted_trials_mlflow_run_without_duplicates(asha_sweep):
    _, parents, after = _runs(asha_sweep.storage)
    assert len(parents) == 1 and len(after) == 4
    assert {t: r.info.run_id for t, r in after.items()} == {t: r.info.run_id for t, r in asha_sweep.before.items()}


def test_diverging_trial_fails_alone_and_mlflow_marks_it_failed(asha_sweep):
    _, (parent,), children = _runs(asha_sweep.storage)
    (diverged,) = [r for r in children.values() if _lr(r) == 1e6]
    assert diverged.info.status == "FAILED"
    assert diverged.data.tags["stop_reason"].startswith("diverged: loss diverged at epoch 1 step")
    assert all(r.info.status == "FINISHED" for r in children.values() if r is not diverged)
    assert parent.data.tags["trials_diverged"] == "1"


# --------------------------------------------------------------------------------------------------
# What the sweep spent, and its budget
# --------------------------------------------------------------------------------------------------

def _spend(run) -> float:
    return run.data.metrics["cost/accelerator_hours"]


def test_each_trial_records_what_it_spent_counting_the_killed_trials_two_attempts(asha_sweep):
    client, _, children = _runs(asha_sweep.storage)
    for trial_id, run in children.items():
        # 1 worker x 1 CPU: no less than its epochs took, no more than from its run's creation to its spend's
        # last record (a trial ASHA stops ends in Tune, which ends its run, before its workers have stopped)
        epochs = sum(m.value for m in client.get_metric_history(run.info.run_id, "epoch_time_s"))
        recorded = max(m.timestamp for m in client.get_metric_history(run.info.run_id, "cost/accelerator_hours"))
        assert epochs / 3600 < _spend(run) < (recorded - run.info.start_time) / 3.6e6, trial_id
        assert run.data.tags["cost.unit"] == "CPU-core-hours"
    (continued,) = [t for t, r in children.items() if _lr(r) == 1e-3]
    killed = asha_sweep.before[continued]
    # what its first attempt had recorded when the driver was killed, and then its resumed attempt's
    assert killed.data.metrics["cost/accelerator_hours"] > 0
    epoch_2 = client.get_metric_history(children[continued].info.run_id, "epoch_time_s")[-1].value
    assert _spend(children[continued]) > killed.data.metrics["cost/accelerator_hours"] + epoch_2 / 3600


def test_the_sweep_records_its_trials_spend_summed_its_best_trials_and_the_cheapest_for_their_result(asha_sweep):
    storage, result = asha_sweep.storage, asha_sweep.resumed
    client, (parent,), children = _runs(storage)
    best = children[parent.data.tags["best_trial_id"]]
    assert parent.data.metrics["cost/accelerator_hours"] == pytest.approx(sum(_spend(r) for r in children.values()))
    assert parent.data.metrics["cost/best_trial_accelerator_hours"] == pytest.approx(_spend(best))
    # the Pareto front of the two completed trials, by hand: the cheaper, and the dearer if it scored higher
    cheaper, dearer = sorted((r for r in children.values() if r.data.tags["stop_reason"] == "completed"), key=_spend)
    front = [cheaper] + ([dearer] if dearer.data.metrics["val_top1"] > cheaper.data.metrics["val_top1"] else [])
    listed = re.search(r"^  cheapest for their val_top1 \(Pareto front over CPU-core-hours\): (.*)$", result.stdout, re.M)
    assert [part.split()[0] for part in listed[1].split("; ")] == [r.data.tags["trial_id"] for r in front]
    assert re.search(r"^spend: [\d.e-]+ CPU-core-hours in all \(completed [\d.e-]+, diverged [\d.e-]+, "
                     r"early stopped [\d.e-]+\)$", result.stdout, re.M), result.stdout[-3000:]
    assert f"the best trial, {best.data.tags['trial_id']}, alone: " in result.stdout
    assert re.search(r"^trial +state +lr_per_512 +.* +CPU_core_hours +reason", result.stdout, re.M)
    summary = _download(client, parent.info.run_id, "summary.html", storage)
    assert "<h2>What it cost (CPU-core-hours)</h2>" in summary and "Pareto front over CPU-core-hours" in summary
    # the recipe it ran under: the smoke config is closest to a paper row, its searched rate not a departure
    recipe = re.search(r"<p>Recipe: closest to paper (\d{3}) .*? departs in (\d+) keys .*?</p>", summary)
    assert recipe and "optim.lr_effective" not in recipe[0] and "optim.epochs" in recipe[0], summary[:3000]


def test_a_resume_under_a_budget_already_spent_starts_no_trial_and_stops_resumable_saying_why(asha_sweep):
    storage, result = asha_sweep.storage, asha_sweep.over_budget
    parent, children = asha_sweep.at_budget
    assert not _trial_started(result.stdout), result.stdout[-3000:]
    reason = parent.data.tags["stop_reason"]
    said = re.fullmatch(rf"budget: the trials spent ([\d.e-]+) CPU-core-hours of tune.budget_hours={BUDGET:g}; "
                        rf"1 trial not started; continue with: vitsweep tune --resume {re.escape(str(storage / 'asha'))} "
                        r"--set tune.budget_hours=MORE", reason)
    assert said, reason
    assert float(said[1]) == pytest.approx(sum(_spend(r) for r in children.values()), rel=1e-3)  # as recorded, summed
    assert parent.info.status == "KILLED"
    assert "sweep asha (stopped at its budget)" in result.stdout
    assert f"vitsweep tune: stopped at its budget: {reason.partition(': ')[2]}" in result.stdout
    # the killed driver's trial, whose run it had left RUNNING, waits for the next resume as KILLED
    (waiting,) = [r for r in children.values() if _lr(r) == 1e-3]
    assert waiting.info.status == "KILLED" and waiting.data.tags["stop_reason"].startswith("interrupted")


def test_a_larger_budget_given_on_resume_runs_the_rest_and_is_what_the_sweep_records(asha_sweep):
    storage = asha_sweep.storage
    _, (parent,), _ = _runs(storage)
    assert parent.data.tags["stop_reason"] == "completed" and parent.data.tags["tune.budget_hours"] == "10.0"
    assert json.loads((storage / "asha" / "vitsweep_sweep.json").read_text())["base_config"]["tune"]["budget_hours"] == 10
    assert "tune.budget_hours" not in parent.data.params  # it may change: a tag


# --------------------------------------------------------------------------------------------------
# A trial that ran out of memory
# --------------------------------------------------------------------------------------------------

def test_a_trial_out_of_memory_goes_on_at_half_the_micro_batch_with_the_same_global_batch_and_rate(asha_sweep):
    storage, result = asha_sweep.storage, asha_sweep.resumed
    _, _, children = _runs(storage)
    (split,) = [run for trial_id, run in children.items() if trial_id.endswith("_00000")]
    params, tags = split.data.params, split.data.tags
    assert (tags["oom.split"], tags["oom.retries"]) == ("16x2", "1")
    assert (params["oom_split.micro_batch_size"], params["oom_split.grad_accum_steps"]) == ("16", "2")
    # as asked: the params stay what the sweep asked for, and the global batch and rate are its
    assert (params["optim.micro_batch_size"], params["optim.grad_accum_steps"]) == ("32", "1")
    assert params["optim.global_batch_size"] == "32" and _lr(split) == pytest.approx(3.2e-2 * 32 / 512)
    assert tags["stop_reason"] == "completed"
    assert [m.step for m in _client(storage).get_metric_history(split.info.run_id, "val_top1")] == [1, 2]
    assert all("oom.split" not in run.data.tags for trial_id, run in children.items() if run is not split)
    table = result.stdout[result.stdout.index("sweep asha (finished)"):]
    assert re.search(r"^trial +state +lr_per_512 +lr_effective +oom_split +epochs ", table, re.M)
    assert re.search(rf"^{split.data.tags['trial_id']} +completed +0\.032 +0\.002 +16x2 +2 ", table, re.M), table
    log = (storage / "asha" / "vitsweep.log").read_text()
    assert f"trial {split.data.tags['trial_id']}: out of memory at micro-batch 32; again at 16 x 2 accumulation " \
           "steps (the same global batch)" in log


def test_the_rank_that_ran_out_of_memory_left_what_held_it(asha_sweep):
    storage = asha_sweep.storage
    client, _, children = _runs(storage)
    (split,) = [run for trial_id, run in children.items() if trial_id.endswith("_00000")]
    assert [a.path for a in client.list_artifacts(split.info.run_id, "oom/micro_batch_32")] == [
        "oom/micro_batch_32/rank0_memory.txt"]  # its one worker's; on a GPU also the allocator's snapshot
    text = _download(client, split.info.run_id, "oom/micro_batch_32/rank0_memory.txt", storage)
    assert text.startswith("rank 0 ran out of memory on cpu\nprocess resident memory: ")
    # the largest live tensor is at least the model's largest weight (timm's own count of the smoke model)
    model = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=2)
    largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    listed = float(re.search(r"the largest:\n +([\d.]+) MiB", text)[1])
    assert listed >= round(largest, 3), (listed, largest)
