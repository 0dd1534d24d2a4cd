"""`vitsweep compare EXPERIMENT`: a sweep's results table and knob importances from MLflow, in the terminal."""
from __future__ import annotations

import argparse
import json
import os

from pipeline.cli.config import add_config_arguments
from pipeline.errors import InvalidInputError


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "compare", help="Print a sweep's results table, what it spent and which knob mattered, from MLflow.",
        description="The table `vitsweep tune` records as the parent run's results.csv, read live from MLflow "
                    "(so a running sweep shows its progress), with each trial's accelerator-hours; what the sweep "
                    "spent, its best trial alone, and the trials cheapest for their result (the Pareto front); then "
                    "each searched knob's importance for the sweep's metric (fANOVA over the completed trials, seeds "
                    "averaged). The store is the config's: tracking.mlflow_uri, MLFLOW_TRACKING_URI, or "
                    "run.storage_path/mlflow.db.",
    )
    parser.add_argument("experiment", metavar="EXPERIMENT", help="MLflow experiment name (tracking.experiment)")
    parser.add_argument("--sweep", default=None, metavar="NAME",
                        help="which sweep (its name, tune.name); default: the latest in the experiment")
    parser.add_argument("--csv", action="store_true", help="print the table as CSV (only the table)")
    add_config_arguments(parser)
    parser.set_defaults(run=_run)


def _record(parent) -> dict:
    """The sweep's record (space, pruned samples) as `vitsweep tune` wrote it when it started; the
    finished sweep's pruned.json replaces its list of pruned samples (TPE prunes as it goes)."""
    from pipeline.sweeps.runner import PRUNED_NAME, RECORD_NAME

    artifacts = parent.artifact_names()
    record = json.loads(parent.read_artifact(RECORD_NAME)) if RECORD_NAME in artifacts else {}
    if PRUNED_NAME in artifacts:
        record["pruned"] = json.loads(parent.read_artifact(PRUNED_NAME))
    return record


def _run(args: argparse.Namespace) -> int:
    from pipeline.config.loading import load_config
    from pipeline.sweeps import report
    from pipeline.sweeps.spend import format_spend, sweep_spend
    from pipeline.sweeps.importance import format_importance, knob_importance
    from pipeline.sweeps.spaces import spaces_from_record
    from pipeline.sweeps.tracking import ROLE_TAG
    from pipeline.tracking.store import MlflowStore
    from pipeline.tracking.connection import is_new_local_store, require_reachable, resolve_tracking_uri

    uri = resolve_tracking_uri(load_config(args.config, args.overrides))
    if is_new_local_store(uri):  # opening it would create it: compare only reads
        raise InvalidInputError(f"no MLflow store at {uri}: nothing was recorded there; give the store a sweep wrote "
                                "(tracking.mlflow_uri, MLFLOW_TRACKING_URI, or the run.storage_path it trained under)")
    require_reachable(uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # keep the table's output clean
    store = MlflowStore(uri)
    experiment = store.find_experiment(args.experiment)
    if experiment is None:
        raise InvalidInputError(f"no MLflow experiment {args.experiment!r} in {uri}; experiments: "
                                f"{', '.join(store.experiment_names()) or 'none'}")
    sweeps = store.search(experiment.experiment_id, f"tags.`{ROLE_TAG}` = 'sweep'",
                          order_by=["attributes.start_time DESC"])
    if not sweeps:
        raise InvalidInputError(f"experiment {args.experiment!r} in {uri} holds no sweep (runs of `vitsweep tune`)")
    if args.sweep:
        chosen = [run for run in sweeps if run.info.run_name == args.sweep]
        if not chosen:
            names = ", ".join(run.info.run_name for run in sweeps)
            raise InvalidInputError(f"no sweep {args.sweep!r} in experiment {args.experiment!r}; sweeps: {names}")
        found = chosen[0]
    else:
        found = sweeps[0]
    parent = store.run(found.info.run_id)

    params = found.data.params
    metric, mode = params.get("tune.metric", "val_top1"), params.get("tune.mode", "max")
    record = _record(parent)
    trials = report.sweep_rows(parent, metric)
    rows = trials + report.pruned_rows(record.get("pruned", []))
    if args.csv:
        print(report.to_csv(rows, metric, mode), end="")
        return 0
    best = found.data.tags.get("best_trial_id")
    others = [run.info.run_name for run in sweeps if run.info.run_id != found.info.run_id]
    print(f"sweep {found.info.run_name} ({found.info.status}): space {params.get('space')}, "
          f"searcher {params.get('tune.searcher')}, scheduler {params.get('tune.scheduler')}, metric {metric} ({mode})"
          + (f", best trial {best}" if best else ""))
    if report.has_seeds(rows):
        print(f"\nper configuration, over seeds (completed trials):\n{report.format_seed_table(rows, metric, mode)}\n"
              "\nper trial:")
    print(report.format_table(rows, metric, mode))
    print(f"\n{format_spend(sweep_spend(rows, metric, mode, report.best_row(trials, metric, mode)), metric)}")
    plotted = f"plots/{metric}_vs_accelerator_hours.png"
    if plotted in {item.path for item in parent.client.list_artifacts(parent.run_id, "plots")}:
        print(f"  {metric} against the spend, the Pareto front drawn: {plotted} on the sweep's parent run "
              f"{parent.run_id} (and in its summary.html)")
    if "spaces" in record:  # the knobs as searched: which was a choice, a range, a log range
        space = spaces_from_record([tuple(part) for part in record["spaces"]])
        print(f"\n{format_importance(knob_importance(trials, metric, space.dims, params.get('tune.searcher')))}")
    if others:
        print(f"\nother sweeps in {args.experiment!r} (--sweep NAME): {', '.join(others)}")
    return 0
