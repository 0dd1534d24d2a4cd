"""`vitsweep compare EXPERIMENT`: a sweep's results table from MLflow, in the terminal."""
from __future__ import annotations

import argparse
import json
import os

from pipeline.cli.config import add_config_arguments
from pipeline.errors import InvalidInputError


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "compare", help="Print a sweep's results table from MLflow.",
        description="The table `vitsweep tune` records as the parent run's results.csv, read live from MLflow "
                    "(so a running sweep shows its progress). The store is the config's: tracking.mlflow_uri, "
                    "MLFLOW_TRACKING_URI, or run.storage_path/mlflow.db.",
    )
    parser.add_argument("experiment", metavar="EXPERIMENT", help="MLflow experiment name (tracking.experiment)")
    parser.add_argument("--sweep", default=None, metavar="NAME",
                        help="which sweep (its name, tune.name); default: the latest in the experiment")
    parser.add_argument("--csv", action="store_true", help="print CSV instead of an aligned table")
    add_config_arguments(parser)
    parser.set_defaults(run=_run)


def _pruned(client, run_id: str) -> list[dict]:
    """Pruned samples: the finished sweep's pruned.json, else the record written when it started."""
    import tempfile
    from pathlib import Path

    from pipeline.sweeps.runner import PRUNED_NAME, RECORD_NAME

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # keep the table's output clean
    for name, field in ((PRUNED_NAME, None), (RECORD_NAME, "pruned")):
        if any(a.path == name for a in client.list_artifacts(run_id)):
            with tempfile.TemporaryDirectory() as directory:
                data = json.loads(Path(client.download_artifacts(run_id, name, directory)).read_text())
            return data if field is None else data.get(field, [])
    return []


def _run(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from pipeline.config import load_config
    from pipeline.sweeps import report
    from pipeline.sweeps.tracking import ROLE_TAG
    from pipeline.tracking import check_reachable, resolve_tracking_uri

    uri = resolve_tracking_uri(load_config(args.config, args.overrides))
    try:
        check_reachable(uri)
    except ConnectionError as err:
        raise InvalidInputError(str(err)) from None
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        names = [e.name for e in client.search_experiments()]
        raise InvalidInputError(f"no MLflow experiment {args.experiment!r} in {uri}; experiments: {', '.join(names) or 'none'}")
    sweeps = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{ROLE_TAG}` = 'sweep'",
                                order_by=["attributes.start_time DESC"])
    if not sweeps:
        raise InvalidInputError(f"experiment {args.experiment!r} in {uri} holds no sweep (runs of `vitsweep tune`)")
    if args.sweep:
        chosen = [run for run in sweeps if run.info.run_name == args.sweep]
        if not chosen:
            names = ", ".join(run.info.run_name for run in sweeps)
            raise InvalidInputError(f"no sweep {args.sweep!r} in experiment {args.experiment!r}; sweeps: {names}")
        parent = chosen[0]
    else:
        parent = sweeps[0]

    params = parent.data.params
    metric, mode = params.get("tune.metric", "val_top1"), params.get("tune.mode", "max")
    rows = report.sweep_rows(uri, parent.info.run_id, metric)
    rows += report.pruned_rows(_pruned(client, parent.info.run_id))
    if args.csv:
        print(report.to_csv(rows, metric, mode), end="")
        return 0
    best = parent.data.tags.get("best_trial_id")
    others = [run.info.run_name for run in sweeps if run.info.run_id != parent.info.run_id]
    print(f"sweep {parent.info.run_name} ({parent.info.status}): space {params.get('space')}, "
          f"searcher {params.get('tune.searcher')}, scheduler {params.get('tune.scheduler')}, metric {metric} ({mode})"
          + (f", best trial {best}" if best else ""))
    print(report.format_table(rows, metric, mode))
    if others:
        print(f"\nother sweeps in {args.experiment!r} (--sweep NAME): {', '.join(others)}")
    return 0
