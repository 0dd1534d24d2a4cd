"""Time from `vitsweep train` start to the first optimizer step (goal: <= 30 s on 2 CPU cores).

Runs the real command (the smoke preset unless --config says otherwise) a few times and reads the
`time_to_first_step_s` metric each run records in MLflow (measured by rank 0 against the CLI's start
time). Run after `make setup`, which builds DeepSpeed's CPU comm op once; the digits dataset is
written before the first timed run so every run reads existing `.beton` files.

    python benchmarks/bench_first_step.py [--config smoke] [--runs 3]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smoke")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    from pipeline.config.loading import load_config
    from pipeline.data.prepare import prepare_digits

    with tempfile.TemporaryDirectory() as storage:
        cfg = load_config(args.config)
        data = {"train": f"{storage}/data/train.beton", "val": f"{storage}/data/val.beton"}
        prepare_digits(cfg.data.model_copy(update=data), cfg.model.img_size)
        rows = []
        for run in range(args.runs):
            started = time.time()
            subprocess.run(
                [VITSWEEP, "train", "--config", args.config, "--set", f"run.storage_path={storage}",
                 "--set", f"run.name=first-step-{run}", "--set", f"data.train={data['train']}",
                 "--set", f"data.val={data['val']}", "--set", "data.prepare=null", "--set", "optim.epochs=1"],
                check=True, capture_output=True,
            )
            client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
            (mlflow_run,) = client.search_runs(
                [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
                filter_string=f"attributes.run_name = 'first-step-{run}'",
            )
            rows.append((mlflow_run.data.metrics["time_to_first_step_s"], time.time() - started))
    print(f"\n`vitsweep train --config {args.config}` ({cfg.scaling.num_workers} workers), {args.runs} runs\n")
    print("| run | start -> first optimizer step (s) | whole command (s) |")
    print("| --- | ---: | ---: |")
    for i, (first_step, whole) in enumerate(rows):
        print(f"| {i} | {first_step:.1f} | {whole:.1f} |")


if __name__ == "__main__":
    main()
