"""Logging a run's final model: MLflow's pip-requirement inference vs vitsweep's pinned requirements.

Every finished training run and sweep trial logs its model once. ``mlflow.pytorch.log_model`` without
``pip_requirements`` infers them by loading the model in a subprocess and recording its imports;
``pipeline.trained.serving.log_model`` pins the pyfunc's imports instead and does more (the
image pyfunc flavor, the serving input validated). Both log the smoke preset's model into one sqlite
store, interleaved repeat by repeat, so load on a shared machine hits both alike.

    .venv/bin/python benchmarks/bench_log_model.py --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlflow
import mlflow.pytorch
import numpy as np
import torch
from safetensors.torch import save_model

from pipeline.config.loading import load_config
from pipeline.console import library_prints
from pipeline.components.model_card import ModelCard
from pipeline.components.modeling import build_model
from pipeline.trained.serving import log_model
from pipeline.tracking.store import MlflowStore
from pipeline.tracking.connection import fluent_tracking_uri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    cfg = load_config("smoke")
    model = build_model(cfg.model, 10).eval()
    card = ModelCard.of_run(cfg, 10, [str(i) for i in range(10)])
    example = np.zeros((1, 3, cfg.model.img_size, cfg.model.img_size), dtype=np.float32)
    times: dict[str, list[float]] = {"mlflow.pytorch.log_model (inferred requirements)": [],
                                     "serving.log_model (pinned, + image pyfunc)": []}
    with tempfile.TemporaryDirectory() as directory:
        weights = Path(directory) / "model.safetensors"
        save_model(model, str(weights))
        uri = f"sqlite:///{directory}/mlflow.db"
        run = MlflowStore(uri).create_run("bench", "log-model")
        inferred, pinned = times
        for _ in range(args.repeats + 1):  # the first round warms imports and caches: not counted
            started = time.perf_counter()
            with fluent_tracking_uri(uri), mlflow.start_run(run_id=run.run_id), library_prints():
                mlflow.pytorch.log_model(model, name="inferred", input_example=example, serialization_format="pickle")
            times[inferred].append(time.perf_counter() - started)
            started = time.perf_counter()
            log_model(run, model, [weights], card, step=1)
            times[pinned].append(time.perf_counter() - started)
    baseline = statistics.median(times[inferred][1:])
    print(f"{args.repeats} interleaved repeats (after one warm-up), torch threads {torch.get_num_threads()}")
    print("| how | s (median) | s (min) | s (max) | speed-up |\n| --- | ---: | ---: | ---: | ---: |")
    for name, measured in times.items():
        counted = measured[1:]
        print(f"| {name} | {statistics.median(counted):.2f} | {min(counted):.2f} | {max(counted):.2f} | "
              f"{baseline / statistics.median(counted):.1f}x |")


if __name__ == "__main__":
    main()
