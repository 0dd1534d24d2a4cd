"""`vitsweep train`: one training run, Ray Train x DeepSpeed x FFCV, recorded in MLflow."""
from __future__ import annotations

import argparse
import sys
import time

from pipeline.cli.config import add_address_argument, add_config_arguments


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "train", help="Train one model with Ray Train x DeepSpeed x FFCV, tracked in MLflow.",
        description="Without arguments: the embedded default (a small XCiT on the offline digits dataset, "
                    "2 CPU workers, a local MLflow store).",
    )
    add_config_arguments(parser)
    add_address_argument(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    launched_at = time.time()
    from pipeline.driver import train_from_config
    from pipeline.runs import TrainingDiverged

    try:
        outcome = train_from_config(args.config, args.overrides, args.address, launched_at)
    except TrainingDiverged as err:
        print(f"vitsweep train: {err}", file=sys.stderr)
        return 1
    metrics = outcome.metrics
    print(
        f"\nfinished {outcome.run_name}: val_top1 {metrics.get('val_top1', float('nan')):.2f}%  "
        f"val_top5 {metrics.get('val_top5', float('nan')):.2f}%\n"
        f"  checkpoints and Ray results: {outcome.run_dir}\n"
        f"  MLflow run {outcome.mlflow_run_id} in {outcome.tracking_uri}\n"
        f"  see it with: mlflow ui --backend-store-uri {outcome.tracking_uri}"
    )
    return 0
