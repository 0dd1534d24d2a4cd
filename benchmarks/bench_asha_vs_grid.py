"""ASHA vs the full grid on svPN alpha x learning rate: trial-epochs spent to find the grid's best config.

Goal: ASHA finds the full grid's best config, or one within noise of it, in at most 50% of the
grid's trial-epochs (sum over trials of the epochs each trained).

The grid is run for real with `vitsweep tune` (FIFO: every trial trains every epoch) on the smoke
model with the SoT head, 1 worker per trial, 1 trial at a time. ASHA is then measured one of two ways:

- default (replay): Ray Tune's own ``ASHAScheduler``, configured exactly as `vitsweep tune` configures
  it, is fed the grid's recorded per-epoch curves in the grid's trial order. With one trial at a
  time and seeded training, a trial's first k epochs are the same whether or not it is stopped
  later, so the scheduler takes the decisions it would take live. Costs one sweep.
- ``--live``: a second `vitsweep tune` run with ASHA; its trial-epochs are counted from MLflow.

"Within noise": the config's final top-1 in the grid is at most ``--noise`` points (default 1.0) below
the grid's best.

    flock /tmp/vitsweep-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_asha_vs_grid.py
    ... --live          # also run ASHA for real (about twice the time)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
VITSWEEP = str(Path(sys.executable).parent / "vitsweep")
SPACE = """\
description: svPN exponent alpha x learning rate (benchmark study)
fixed:
  model.args.head: sot
params:
  model.args.svpn_alpha: {values: [0.3, 0.5, 0.7]}
  optim.lr: {values: [3.0e-3, 1.0e-3, 1.0e-4]}
"""


def sweep(storage: Path, name: str, scheduler: str, args) -> float:
    """Run `vitsweep tune`; returns its wall time in seconds."""
    command = [VITSWEEP, "tune", "--space", str(storage / "space.yaml"), "--config", "smoke",
               "--set", f"run.storage_path={storage}", "--set", "scaling.num_workers=1",
               "--set", f"optim.epochs={args.epochs}", "--set", f"tune.name={name}", "--set", f"tune.scheduler={scheduler}",
               "--set", f"tune.grace_period={args.grace_period}", "--set", f"tune.reduction_factor={args.reduction_factor}"]
    start = time.time()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"`vitsweep tune` ({name}) failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return time.time() - start


def curves(storage: Path, name: str) -> list[dict]:
    """Each trial of sweep ``name`` in trial order: knobs, val_top1 per epoch, epochs trained, state."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    experiment = client.get_experiment_by_name("vitsweep")
    (parent,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.sweep = '{name}' and "
                                   "tags.`vitsweep.role` = 'sweep'")
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    trials = []
    for run in sorted(children, key=lambda r: r.data.tags["trial_id"]):
        history = sorted(client.get_metric_history(run.info.run_id, "val_top1"), key=lambda m: m.step)
        values = {m.step: m.value for m in history}
        trials.append({"trial": run.data.tags["trial_id"], "knobs": json.loads(run.data.tags["knobs"]),
                       "curve": [values[s] for s in sorted(values)], "state": run.data.tags["stop_reason"]})
    return trials


def replay_asha(grid: list[dict], args) -> list[dict]:
    """Ray's ASHAScheduler, set up as `vitsweep tune` sets it up, on the grid's curves in order."""
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    scheduler = ASHAScheduler(time_attr="epochs_done", metric="val_top1", mode="max", max_t=args.epochs - 1,
                              grace_period=args.grace_period, reduction_factor=args.reduction_factor, brackets=1,
                              stop_last_trials=False)
    replayed = []
    for trial in grid:
        handle = SimpleNamespace(trial_id=trial["trial"])
        scheduler.on_trial_add(None, handle)
        trained = []
        for epoch, value in enumerate(trial["curve"], start=1):
            trained.append(value)
            decision = scheduler.on_trial_result(None, handle, {"epochs_done": epoch, "val_top1": value})
            if decision == TrialScheduler.STOP and epoch < args.epochs:
                break
        scheduler.on_trial_complete(None, handle, {"epochs_done": len(trained), "val_top1": trained[-1]})
        replayed.append({**trial, "curve": trained,
                         "state": "completed" if len(trained) == args.epochs else f"early_stopped after {len(trained)}"})
    return replayed


def summarise(label: str, trials: list[dict], grid: list[dict], args) -> dict:
    final = {json.dumps(t["knobs"], sort_keys=True): t["curve"][-1] for t in grid}
    grid_best = max(final.values())
    completed = [t for t in trials if len(t["curve"]) == args.epochs]
    best = max(completed, key=lambda t: t["curve"][-1])
    found = final[json.dumps(best["knobs"], sort_keys=True)]
    return {"method": label, "trials": len(trials), "trial_epochs": sum(len(t["curve"]) for t in trials),
            "best": best["knobs"], "best_top1": found, "gap_to_grid_best": grid_best - found,
            "within_noise": grid_best - found <= args.noise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--grace-period", type=int, default=1)
    parser.add_argument("--reduction-factor", type=float, default=3.0)
    parser.add_argument("--noise", type=float, default=1.0, help="top-1 points counted as within noise")
    parser.add_argument("--live", action="store_true", help="also run ASHA for real, not only the replay")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()

    storage = args.out or Path(tempfile.mkdtemp(prefix="bench-asha-"))
    storage.mkdir(parents=True, exist_ok=True)
    (storage / "space.yaml").write_text(SPACE)
    seconds = {"grid": sweep(storage, "grid", "fifo", args)}
    grid = curves(storage, "grid")
    rows = [summarise("full grid (FIFO)", grid, grid, args),
            summarise("ASHA (replayed on the grid's curves)", replay_asha(grid, args), grid, args)]
    if args.live:
        seconds["asha"] = sweep(storage, "asha", "asha", args)
        rows.append(summarise("ASHA (live sweep)", curves(storage, "asha"), grid, args))

    budget = rows[0]["trial_epochs"]
    print(f"\nsvPN alpha x lr on the smoke model (SoT head), {len(grid)} configs x {args.epochs} epochs; ASHA grace "
          f"{args.grace_period}, reduction factor {args.reduction_factor:g}; noise = {args.noise} top-1 points")
    print("\n| method | trials | trial-epochs | % of grid | best config | its grid top-1 | gap to grid best | "
          "within noise |\n| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for row in rows:
        knobs = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in row["best"].items())
        print(f"| {row['method']} | {row['trials']} | {row['trial_epochs']} | {100 * row['trial_epochs'] / budget:.0f}% | "
              f"{knobs} | {row['best_top1']:.2f} | {row['gap_to_grid_best']:.2f} | {'yes' if row['within_noise'] else 'no'} |")
    print("\nper-trial val_top1 curves of the grid:")
    for trial in grid:
        print(f"  {trial['trial']}  {trial['knobs']}  " + " ".join(f"{v:.1f}" for v in trial["curve"]))
    print("\nwall time: " + ", ".join(f"{k} sweep {v / 60:.1f} min" for k, v in seconds.items()) + f"; runs in {storage}")
    (storage / "bench_asha_vs_grid.json").write_text(json.dumps({"rows": rows, "grid": grid, "seconds": seconds},
                                                                indent=1))
    goal = [r for r in rows[1:] if r["within_noise"] and r["trial_epochs"] <= 0.5 * budget]
    print(f"goal (within noise in <= 50% of the grid's trial-epochs): {'met' if goal else 'not met'}")


if __name__ == "__main__":
    main()
