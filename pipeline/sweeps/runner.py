"""Runs a sweep: everything checked first, trials sized to the cluster, Ray Tune, resume.

``prepare_sweep`` does all the checking (config, space, every trial's model on the meta device,
the datasets, every trial's initial weights, the MLflow store) and writes nothing but a requested
offline dataset. ``run_sweep`` then starts or joins Ray, sizes the trials to it
(``pipeline.sweeps.resources``: a cluster may grow, and trials wait for its nodes), opens the MLflow
parent run, writes the sweep's record and the trials' initial weights (one file per source, read by
every trial that starts from it: ``pipeline.trained.transfer``) and drives ``tune.Tuner``. ``load_sweep`` +
``run_sweep(resume=True)`` continue an interrupted sweep from its record with ``Tuner.restore``:
finished trials stay finished, unfinished ones continue their Ray Train checkpoint and their MLflow run.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
import ray
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from pipeline import interrupts, uris
from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import apply_overrides, load_config, parse_override, validate, with_dotted
from pipeline.console import LOG_FILE_NAME, active_console, counted
from pipeline.ray_connection import local_ray_resources, ray_address, start_ray
from pipeline.training.jobs import check_paths_outlive_job
from pipeline.errors import Interrupted, InvalidInputError
from pipeline.training.locations import check_can_create, run_directories
from pipeline.data.loaders import check_decoding_threads
from pipeline.training.runs import ResolvedData, resolve_data
from pipeline.sweeps import importance, plots, report, spend, summary, view
from pipeline.sweeps.budget import BUDGET, BudgetedASHAScheduler, BudgetedFIFOScheduler, SweepBudget, recorded_budget
from pipeline.sweeps.planning import TrialChecker, TrialPlan, check_initial_weights, check_teachers, plan_trials
from pipeline.sweeps.spaces import SearchSpace, SpaceError, load_spaces, short_keys, spaces_from_record
from pipeline.sweeps.progress import SweepTable
from pipeline.sweeps.resources import (ClusterGrowthDeadline, TrialResources, autoscaler_ceiling, concurrent_trials,
                                       growth_notice, local_ray_cpus, local_trials_fitting, start_timeout_s)
from pipeline.sweeps.tracking import (COMPLETED, EPOCHS_DONE, INTERRUPTED, PRUNED, TRIAL_STATES, TrialRecorder,
                                      mark_unfinished, open_parent_run)
from pipeline.sweeps.trial import SweepPlan, run_trial
from pipeline.tracking.store import STOP_REASON_TAG, MlflowRun, MlflowStore, command_line, run_origin
from pipeline.training.cost import ACCELERATOR_HOURS, UNIT_TAG, cost_unit
from pipeline.tracking.connection import require_reachable, resolve_tracking_uri
from pipeline.trained.transfer import SWEEP_SOURCES, save_source, sweep_source_location

RECORD_NAME = "vitsweep_sweep.json"
PRUNED_NAME = "pruned.json"  # on the parent run: every pruned sample with its reason
BUDGET_KEY = "tune.budget_hours"  # the one setting --resume may change
BEST_TRIAL_HOURS = "cost/best_trial_accelerator_hours"  # beside the parent's cost/accelerator_hours, the sweep's
TRIAL_RUNS_DIR = "trial_runs"
DEFAULT_RANDOM_SAMPLES = 10


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------

@dataclass
class Sweep:
    name: str
    root: str  # storage root (absolute local path or URI); the sweep lives in root/name
    space: SearchSpace
    base_tree: dict[str, Any]
    plan: TrialPlan
    data: ResolvedData
    tracking_uri: str
    parent_run_id: str | None = None
    created: float = 0.0
    # The trials' model sources, resolved while checking, by (model.init_from, model.init_ema) and
    # (distill.teacher_from, distill.teacher_ema); saved into the sweep directory when it starts (a resumed sweep has
    # them there already).
    sources: dict[tuple[str, bool], Any] = field(default_factory=dict, repr=False)

    @property
    def cfg(self) -> ExperimentConfig:
        return validate(self.base_tree)

    @property
    def directory(self) -> str:
        return uris.join(self.root, self.name)

    @property
    def record_path(self) -> str:
        return uris.join(self.directory, RECORD_NAME)

    def record(self) -> str:
        return json.dumps({
            "name": self.name, "root": self.root, "created": self.created,
            "spaces": [list(part) for part in self.space.parts], "base_config": self.base_tree,
            "tracking_uri": self.tracking_uri, "parent_run_id": self.parent_run_id,
            "variants": self.plan.variants, "pruned": self.plan.pruned, "checked": self.plan.checked,
            "data": asdict(self.data),
        }, indent=1)


def _check_settings(cfg: ExperimentConfig, space: SearchSpace) -> None:
    tune = cfg.tune
    if tune.searcher == "grid" and tune.num_samples not in (None, 1):
        raise SpaceError(
            f"tune.num_samples={tune.num_samples} with tune.searcher=grid would repeat identical trials; search "
            "run.seed to repeat with other seeds, or use tune.searcher=random or tpe"
        )
    if tune.scheduler == "asha" and report.EPOCHS_KEY in space.keys:
        raise SpaceError(f"{report.EPOCHS_KEY} is searched, but ASHA compares trials at the same epochs, up to one "
                         "budget for all; use tune.scheduler=fifo")
    if tune.scheduler == "asha" and tune.grace_period >= cfg.optim.epochs:
        raise SpaceError(
            f"tune.grace_period={tune.grace_period} must be < optim.epochs={cfg.optim.epochs} for ASHA to stop any "
            "trial early; lower it, train longer, or use tune.scheduler=fifo"
        )
    if tune.searcher == "tpe" and all(d.kind == "values" and len(d.values) == 1 for d in space.dims):
        raise SpaceError("tune.searcher=tpe needs at least one knob with more than one value")


def base_config(config: str | None, overrides: list[str], space: SearchSpace) -> ExperimentConfig:
    """The config every trial starts from: ``--config``, then the space's ``fixed``, then ``--set``; a
    ``--set`` of a key the space searches or derives is refused (each trial's value would replace it)."""
    decided = {key: "searches" for key in space.keys}
    decided |= {key: "derives" for rule in space.derive for key in rule.replaced_keys}
    for assignment in overrides:
        given = parse_override(assignment)[0]
        for key, how in decided.items():
            if given == key or key.startswith(f"{given}.") or given.startswith(f"{key}."):
                raise SpaceError(f"--set {assignment}: {' + '.join(space.sources)} {how} {key}, so each trial's "
                                 "value would replace it; drop the --set, or search a space without it")
    tree = with_dotted(load_config(config).model_dump(mode="json"), space.fixed)
    return validate(apply_overrides(tree, list(overrides)))


def prepare_sweep(config: str | None, overrides: list[str], space_refs: list[str]) -> Sweep:
    """Check everything a sweep needs; nothing is started and nothing written (but a requested dataset)."""
    space = load_spaces(space_refs)
    cfg = base_config(config, overrides, space)
    _check_settings(cfg, space)

    # Trials run in their own working directories: every local path becomes absolute here.
    created = time.time()
    check_paths_outlive_job(cfg)
    check_can_create(run_directories(cfg, sweep=True))
    cfg = cfg.with_absolute_paths()
    name = cfg.tune.name or f"{space.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(created))}"
    root = cfg.tune.storage_path or cfg.run.storage_path
    tracking_uri = resolve_tracking_uri(cfg)
    require_reachable(tracking_uri)
    tune_settings = cfg.tune.model_copy(update={
        "name": name, "storage_path": root,
        "seed": cfg.tune.seed if cfg.tune.seed is not None else cfg.run.seed,
        "num_samples": cfg.tune.num_samples or (None if cfg.tune.searcher == "grid" else DEFAULT_RANDOM_SAMPLES),
    })
    tracking = cfg.tracking.model_copy(update={"mlflow_uri": tracking_uri})
    cfg = validate(cfg.model_copy(update={"tune": tune_settings, "tracking": tracking}).model_dump(mode="json"))
    base_tree = cfg.model_dump(mode="json")

    sweep_dir = uris.join(root, name)
    if uris.read_bytes(uris.join(sweep_dir, RECORD_NAME)) is not None:
        raise InvalidInputError(f"sweep {name!r} already exists in {sweep_dir}; continue it with "
                                f"`vitsweep tune --resume {sweep_dir}` or set another tune.name")
    plan = plan_trials(space, base_tree, cfg.tune.searcher, cfg.tune.num_samples, cfg.tune.seed)
    data = resolve_data(cfg)
    sources = {**check_initial_weights(plan.candidates, data.num_classes, tracking_uri),
               **check_teachers(plan.candidates, data.num_classes, tracking_uri)}
    return Sweep(name, root, space, base_tree, plan, data, tracking_uri, created=created, sources=sources)


def load_sweep(sweep_dir: str, overrides: list[str] = ()) -> Sweep:
    """An interrupted sweep, from its record (``--resume``); ``overrides``: ``tune.budget_hours=HOURS``
    at most (a sweep stopped at its budget goes on with more), validated as any config is."""
    text = uris.read_bytes(uris.join(uris.absolute(sweep_dir), RECORD_NAME))
    if text is None:
        raise InvalidInputError(f"--resume {sweep_dir}: no sweep there (no {RECORD_NAME}); give the sweep directory "
                                "that `vitsweep tune` printed when it started")
    record = json.loads(text.decode())
    space = spaces_from_record([tuple(part) for part in record["spaces"]])
    cfg = validate(apply_overrides(record["base_config"], list(overrides)))
    check_can_create(run_directories(cfg, sweep=True))
    data = resolve_data(cfg)  # the datasets must still be there, unchanged
    plan = TrialPlan(record["variants"], record["pruned"], record["checked"])
    return Sweep(record["name"], record["root"], space, cfg.model_dump(mode="json"), plan, data,
                 record["tracking_uri"], record["parent_run_id"], record["created"])


# --------------------------------------------------------------------------------------------------
# Ray Tune
# --------------------------------------------------------------------------------------------------

def trial_name(trial) -> str:
    return trial.trial_id


def _scheduler(cfg: ExperimentConfig, budget: SweepBudget):
    """FIFO or ASHA, starting no trial once ``budget`` is spent (``pipeline.sweeps.budget``)."""
    if cfg.tune.scheduler == "fifo":
        return BudgetedFIFOScheduler(budget)
    # Rungs end before the last epoch and trials past the last rung are never stopped, so a trial
    # that trains every epoch always finishes its own run (final model, FINISHED) before it ends.
    return BudgetedASHAScheduler(budget, time_attr=EPOCHS_DONE, max_t=cfg.optim.epochs - 1,
                                 grace_period=cfg.tune.grace_period, reduction_factor=cfg.tune.reduction_factor,
                                 brackets=1, stop_last_trials=False)


def _trainable(sweep: Sweep, need: TrialResources):
    cfg = sweep.cfg
    plan = SweepPlan(sweep.name, sweep.space, sweep.base_tree, sweep.data, sweep.tracking_uri,
                     cfg.tracking.experiment, sweep.parent_run_id, uris.join(sweep.directory, TRIAL_RUNS_DIR),
                     source=command_line(), init_sources=uris.join(sweep.directory, SWEEP_SOURCES))
    return tune.with_resources(tune.with_parameters(run_trial, plan=plan), need.function_request(cfg))


def _tuner(sweep: Sweep, max_concurrent: int, need: TrialResources, local: bool) -> tune.Tuner:
    cfg = sweep.cfg
    if cfg.tune.searcher == "tpe":
        param_space = {"knobs": {dim.key: dim.tune_domain() for dim in sweep.space.dims}}
        search_alg = OptunaSearch(metric=cfg.tune.metric, mode=cfg.tune.mode,
                                  sampler=optuna.samplers.TPESampler(seed=cfg.tune.seed))
        num_samples = cfg.tune.num_samples
    else:  # grid and random trials were fixed (and checked) up front
        param_space = {"knobs": tune.grid_search(sweep.plan.variants)}
        search_alg, num_samples = None, 1
    # a local Ray fits a trial (checked) and never grows: only a cluster's growth has a deadline
    growth = [] if local else [ClusterGrowthDeadline(start_timeout_s(), need.describe(cfg))]
    budget = SweepBudget(sweep.tracking_uri, sweep.parent_run_id, sweep.record_path, cost_unit(cfg))
    return tune.Tuner(
        _trainable(sweep, need),
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=cfg.tune.metric, mode=cfg.tune.mode, search_alg=search_alg, scheduler=_scheduler(cfg, budget),
            num_samples=num_samples, max_concurrent_trials=max_concurrent,
            trial_name_creator=trial_name, trial_dirname_creator=trial_name,
            # A trial's process takes the next trial (its imports done): a stopped trial's function ends
            # promptly (pipeline.sweeps.trial_stop), which is what reuse waits for.
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=sweep.name, storage_path=sweep.root, verbose=0,  # the sweep prints its own table
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
            callbacks=[TrialRecorder(sweep.tracking_uri, cfg.tracking.experiment, sweep.parent_run_id,
                                     cfg.optim.epochs, cfg.tune.scheduler),
                       SweepTable(cfg.tune.metric, cfg.optim.epochs), budget, *growth],
        ),
    )


@dataclass(frozen=True)
class SweepOutcome:
    name: str
    directory: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    view: str  # the saved runs-table view of its trials (MLflow UI)
    interrupted: bool  # it ended with trials left to run: --resume continues it
    table: str
    best: report.TrialRow | None
    knob_importance: importance.KnobImportance
    spend: spend.SweepSpend
    stop_reason: str  # completed, interrupted: ..., budget: ... (the parent run's stop_reason tag)

    @property
    def stopped_at_budget(self) -> bool:
        return self.stop_reason.startswith(f"{BUDGET}: ")


def _sweep_params(sweep: Sweep, max_concurrent: int, need: TrialResources) -> dict[str, Any]:
    cfg = sweep.cfg
    # the budget may grow on --resume: a tag (MLflow's params never change), not a param
    params = {f"tune.{k}": v for k, v in cfg.tune.model_dump(mode="json").items() if f"tune.{k}" != BUDGET_KEY}
    params.update({
        "space": sweep.space.name, "space_files": ", ".join(sweep.space.sources),
        "searched_keys": ", ".join(sweep.space.keys), "derive": ", ".join(r.name for r in sweep.space.derive) or "none",
        "tune.mode": cfg.tune.mode, "model.name": cfg.model.name,
        "optim.epochs": "searched" if report.EPOCHS_KEY in sweep.space.keys else cfg.optim.epochs,
        "trial_resources": need.describe(cfg), "max_concurrent_trials_effective": max_concurrent,
        "trials_planned": len(sweep.plan.variants) if cfg.tune.searcher != "tpe" else cfg.tune.num_samples,
        "combinations_checked": sweep.plan.checked,
    })
    return params


def record_start(sweep: Sweep, parent: MlflowRun, params: dict[str, Any], resume: bool) -> None:
    """The sweep's record, its trials' model sources and its parent run's setup (a new sweep), or the
    budget a resume was given (``--resume DIR --set tune.budget_hours=...``)."""
    cfg = sweep.cfg
    if resume and recorded_budget(sweep.record_path) != cfg.tune.budget_hours:
        uris.write_bytes(sweep.record_path, sweep.record().encode())
    parent.set_tags({BUDGET_KEY: str(cfg.tune.budget_hours)})
    if resume:
        return
    uris.write_bytes(sweep.record_path, sweep.record().encode())
    for (init_from, init_ema), source in sweep.sources.items():
        save_source(source, sweep_source_location(uris.join(sweep.directory, SWEEP_SOURCES), init_from, init_ema))
    parent.log_params(params)
    parent.set_tags(run_origin(describe_sweep(sweep), command_line()))
    parent.log_texts({"space.yaml": sweep.space.text, "base_config.yaml": cfg.to_yaml(), RECORD_NAME: sweep.record()})
    save_sweep_view(sweep, parent, params["trials_planned"])


def run_sweep(sweep: Sweep, address: str | None = None, resume: bool = False) -> SweepOutcome:
    cfg = sweep.cfg
    if cfg.tune.budget_hours is not None and threading.current_thread() is not threading.main_thread():
        raise InvalidInputError(  # it ends the sweep through Tune's signal handler, which only the main thread has
            f"tune.budget_hours={cfg.tune.budget_hours:g} needs the sweep run from the process's main thread")
    # A pruned TPE sample, or a trial pruned as out of memory, ends without a result, which Tune's strict
    # metric check (in this driver) would turn into an experiment error; every real result carries the metric.
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    if ray_address(address) == "local":  # a trial too large for the local Ray is refused before it starts
        local_trials_fitting(cfg, local_ray_resources(local_ray_cpus(cfg)))
        check_decoding_threads(cfg.data.num_workers)
    try:
        start_ray(address, "tune", local_cpus=local_ray_cpus(cfg))
    except Interrupted:
        with interrupts.ignored():
            ray.shutdown(wait_for_processes=True)  # the local Ray started meanwhile goes with the command
        raise
    local = ray_address(address) == "local"
    cluster, ceiling = ray.cluster_resources(), None if local else autoscaler_ceiling()
    max_concurrent = concurrent_trials(cfg, cluster, local, ceiling)
    need = TrialResources.of(cfg, cluster)

    parent = open_parent_run(sweep.tracking_uri, cfg.tracking.experiment, sweep.name, sweep.parent_run_id)
    sweep.parent_run_id = parent.run_id
    console = active_console()
    if not uris.is_uri(sweep.directory):
        console.open_log(Path(sweep.directory) / LOG_FILE_NAME)
    record_start(sweep, parent, _sweep_params(sweep, max_concurrent, need), resume)
    console.line(f"sweep {sweep.name}: {_sweep_params(sweep, max_concurrent, need)['trials_planned']} trials "
                 f"({cfg.tune.searcher} over {', '.join(sweep.space.keys)}; {cfg.tune.scheduler}), "
                 f"{max_concurrent} at a time, {need.describe(cfg)} each"
                 + (f"; {len(sweep.plan.pruned)} pruned" if sweep.plan.pruned else "")
                 + f"\n  sweep directory: {sweep.directory}\n  resume with: vitsweep tune --resume {sweep.directory}"
                 + (f"\n  library output in {console.log_path}" if console.log_path else ""))
    notice = None if local else growth_notice(cfg, cluster, max_concurrent, ceiling is not None)
    if notice:
        console.line(notice)

    if resume and tune.Tuner.can_restore(sweep.directory):
        tuner = tune.Tuner.restore(sweep.directory, trainable=_trainable(sweep, need), resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
    else:  # a new sweep, or one interrupted before Tune wrote its first state
        tuner = _tuner(sweep, max_concurrent, need, local)
    try:
        results = tuner.fit()
    except KeyboardInterrupt:
        return finish_sweep(sweep, parent, [], interrupted=True)
    except Exception:
        # The sweep itself broke (e.g. the Ray cluster died): its state on disk is intact, so record
        # where it stopped and let --resume continue it.
        reason = f"{INTERRUPTED}: the sweep failed; resume with vitsweep tune --resume {sweep.directory}"
        mark_unfinished(parent, reason)
        parent.end("FAILED", reason)
        console.line(f"vitsweep tune: the sweep failed; continue it with: vitsweep tune --resume {sweep.directory}")
        raise
    # A trial neither terminated nor errored was still pending or running when Tune stopped. The budget
    # (pipeline.sweeps.budget) says so on the parent run, whose stop_reason was "running" until then: Tune
    # ends its pending trials in memory as it returns (they stay pending in its saved state).
    said = parent.tags.get(STOP_REASON_TAG, "")
    budget_stop = said if said.startswith(f"{BUDGET}: ") else None
    interrupted = budget_stop is not None or results.num_terminated + results.num_errors < len(results)
    return finish_sweep(sweep, parent, list(results), interrupted, budget_stop)


def _tpe_pruned(sweep: Sweep, results: list) -> list[dict[str, Any]]:
    """TPE samples that ended as they started, without a result: checked again for the reason."""
    checker = TrialChecker(sweep.space, sweep.base_tree)
    pruned = []
    for result in results:
        if result.error is None and result.config and EPOCHS_DONE not in (result.metrics or {}):
            candidate = checker.check(result.config["knobs"])
            if candidate.problem:
                pruned.append({"knobs": candidate.knobs, "reason": candidate.problem})
    return pruned


def describe_sweep(sweep: Sweep) -> str:
    cfg = sweep.cfg
    trials = len(sweep.plan.variants) if cfg.tune.searcher != "tpe" else cfg.tune.num_samples
    description = (sweep.space.description or "search space").rstrip(".")  # a space's own sentence ends in one
    charts = ("" if trials >= view.PARALLEL_MIN_TRIALS else
              f" The chart view plots {cfg.tune.metric} against each knob; a parallel-coordinates chart needs "
              f"{view.PARALLEL_MIN_TRIALS} trials or more.")
    searched = {"grid": "A grid", "random": "Random search", "tpe": "Optuna TPE"}[cfg.tune.searcher]
    epochs = "its searched epochs" if report.EPOCHS_KEY in sweep.space.keys else counted(cfg.optim.epochs, "epoch")
    return (f"Sweep **{sweep.space.name}**: {description}. {searched} over "
            f"{', '.join(f'`{key}`' for key in sweep.space.keys)} ({counted(trials, 'trial')}, {cfg.tune.scheduler}), "
            f"{cfg.model.name}, {epochs} each, optimising {cfg.tune.metric} ({cfg.tune.mode})."
            + charts)


def describe_result(sweep: Sweep, best: report.TrialRow | None, found: importance.KnobImportance,
                    spent: spend.SweepSpend) -> str:
    """The parent run's description once the sweep ends: what it was, its best trial, which knob
    mattered, what it spent."""
    metric = sweep.cfg.tune.metric
    if best is None:
        outcome = "No trial trained every epoch."
    else:
        knobs = ", ".join(f"{name}={report.cell(best.knobs[key])}" for key, name in short_keys(best.knobs).items())
        outcome = f"Best: trial `{best.trial_id}`, {metric} **{report.cell(best.value(metric))}** ({knobs})."
    lines = importance.format_importance(found, bars=False).splitlines()
    cost = spend.format_spend(spent, metric).splitlines()
    return (f"{describe_sweep(sweep)}\n\n{outcome}\n\n{lines[0]}\n\n" + "".join(f"- {line.strip()}\n" for line in lines[1:])
            + f"\n{cost[0]}\n\n" + "".join(f"- {line.strip()}\n" for line in cost[1:])
            + f"\nThe whole result on one page: Artifacts, `{summary.SUMMARY_NAME}`.")


def view_key(sweep: Sweep) -> str:
    return f"vitsweep-{sweep.name}"


def save_sweep_view(sweep: Sweep, parent: MlflowRun, trials: int) -> None:
    """The runs page as a researcher wants it for this sweep: its trials, a column per knob, the
    metrics, and the chart view's knob and per-epoch charts (``view``)."""
    cfg = sweep.cfg
    state = view.sweep_view(sweep.space, cfg.tune.metric, cfg.tune.mode, parent.run_id, trials)
    MlflowStore(parent.uri).save_view(parent.get().info.experiment_id, view_key(sweep), f"sweep {sweep.name}", state)


def finish_sweep(sweep: Sweep, parent: MlflowRun, results: list, interrupted: bool,
                 budget_stop: str | None = None) -> SweepOutcome:
    """Record the outcome on the parent run: best trial, knob importances, what it spent, results.csv,
    pruned.csv, plots, and all of it on one page (summary.html); the description says the result, the
    ``stop_reason`` tag why it ended (``budget_stop``: the budget's reason, when the budget ended it)."""
    cfg = sweep.cfg
    metric, mode = cfg.tune.metric, cfg.tune.mode
    # Tune answers Ctrl-C by returning early: a trial whose run is still open did not end.
    interrupted = interrupted or any(row.state == "running" for row in report.sweep_rows(parent, metric))
    resume = f"{INTERRUPTED}: resume with vitsweep tune --resume {sweep.directory}"
    if interrupted:  # a trial left running (a killed driver's, or stopped by Ctrl-C) waits for --resume
        mark_unfinished(parent, resume)
    stop_reason = (f"{budget_stop}; continue with: vitsweep tune --resume {sweep.directory} --set tune.budget_hours=MORE"
                   if budget_stop else resume if interrupted else COMPLETED)
    pruned = sweep.plan.pruned + (_tpe_pruned(sweep, results) if cfg.tune.searcher == "tpe" else [])
    rows = report.sweep_rows(parent, metric)
    all_rows = rows + report.pruned_rows(pruned)
    best = report.best_row(rows, metric, mode)
    found = importance.knob_importance(rows, metric, sweep.space.dims, cfg.tune.searcher)
    spent = spend.sweep_spend(all_rows, metric, mode, best)

    files = {"results.csv": report.to_csv(all_rows, metric, mode), PRUNED_NAME: json.dumps(pruned, indent=1)}
    # the samples never started, and the trials that did not fit in memory at micro-batch 1
    pruned_csv = report.pruned_rows(pruned) + [row for row in rows if row.state == PRUNED]
    if pruned_csv:
        files["pruned.csv"] = report.to_csv(pruned_csv, metric, mode)
    parent.log_texts(files)
    with tempfile.TemporaryDirectory() as directory:
        log_keys = {d.key for d in sweep.space.dims if d.is_log}
        discrete_keys = {d.key for d in sweep.space.dims if d.kind in ("values", "randint")}
        written = plots.plot_sweep(rows, metric, mode, Path(directory), log_keys, discrete_keys, spent)
        bars = plots.importance_figure(found)
        bars_path = plots.save(bars, Path(directory) / f"{metric}_importance.png") if bars else None
        for path in [*written, *([bars_path] if bars_path else [])]:
            parent.log_artifact(path, "plots")
        state = "stopped at its budget" if budget_stop else "interrupted" if interrupted else "finished"
        parent.log_texts({summary.SUMMARY_NAME: summary.summary_html(
            sweep.name, state, describe_sweep(sweep), summary.describe_recipe(cfg, set(sweep.space.keys)), all_rows,
            metric, mode, best, found, bars_path, written, spent)})
    if found.assessed:
        names = short_keys(found.importances)
        parent.log_metrics({f"importance/{names[key]}": share for key, share in found.importances.items()})
    # Counters are tags: as metrics the UI would chart each as a one-bar plot ahead of the metric.
    counts = {f"trials_{state}": str(sum(r.state == state for r in all_rows)) for state in TRIAL_STATES}
    counts.update(trials_total=str(len(all_rows)), trial_epochs=str(sum(r.epochs for r in rows)))
    parent.set_tags({**counts, "mlflow.note.content": describe_result(sweep, best, found, spent),
                     STOP_REASON_TAG: stop_reason, UNIT_TAG: spent.unit})
    parent.log_metrics({ACCELERATOR_HOURS: spent.total,
                        **({BEST_TRIAL_HOURS: best.accelerator_hours} if best and best.accelerator_hours else {})})
    if best:
        parent.log_metrics({f"best_{metric}": best.value(metric)})
        parent.set_tags({"best_trial_id": best.trial_id, "best_run_id": best.run_id, "best_knobs": json.dumps(best.knobs)})
    parent.finish("KILLED" if interrupted else "FINISHED")
    table = report.format_table(all_rows, metric, mode)
    if report.has_seeds(rows):
        table = f"per configuration, over seeds:\n{report.format_seed_table(rows, metric, mode)}\n\nper trial:\n{table}"
    return SweepOutcome(sweep.name, sweep.directory, parent.uri, parent.get().info.experiment_id, parent.run_id,
                        view_key(sweep), interrupted, table, best, found, spent, stop_reason)
