"""`vitsweep train`: one training run, Ray Train x DeepSpeed x FFCV, recorded in MLflow."""
from __future__ import annotations

import argparse
import time

from pipeline.cli.config import add_address_argument, add_config_arguments, add_verbose_argument


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "train", help="Train one model with Ray Train x DeepSpeed x FFCV, tracked in MLflow.",
        description="Without arguments: the embedded default (a small XCiT on the offline digits dataset, "
                    "2 CPU workers, a local MLflow store).",
    )
    add_config_arguments(parser)
    add_address_argument(parser)
    add_verbose_argument(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    launched_at = time.time()
    from pipeline.console import command_console

    with command_console(args.verbose) as console:
        from pipeline.training.driver import train_from_config

        outcome = train_from_config(args.config, args.overrides, args.address, launched_at)
        from pipeline.tracking.ui import model_line, where_to_look

        metrics = outcome.metrics
        console.line(
            f"\nfinished {outcome.run_name}: val_top1 {metrics.get('val_top1', float('nan')):.2f}%  "
            f"val_top5 {metrics.get('val_top5', float('nan')):.2f}%\n"
            f"  checkpoints and Ray results: {outcome.run_dir}\n"
            f"  MLflow run {outcome.mlflow_run_id} in {outcome.tracking_uri}\n"
            + (f"{model_line(outcome.model_id)}\n" if outcome.model_id else "")
            + where_to_look(outcome.tracking_uri, outcome.experiment_id, outcome.mlflow_run_id)
        )
    return 0
