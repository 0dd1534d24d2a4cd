"""A sweep whose trials reuse their processes (Tune's reuse_actors) against an earlier commit's, side by side.

Two ASHA sweeps of the smoke model over ``optim.lr_per_512``, 3 epochs, one worker per trial:
- the suite's (``test_tune_e2e``): 3 trials one at a time, the middle one far too slow to learn (ASHA stops
  it after epoch 1, and the last trial starts after it);
- 4 trials two at a time (each trial function 0.5 CPU, its worker 0.5 CPU), the suite's earlier shape.

Each runs as `python -m pipeline tune ...` in a checkout of each tree (this one, and ``--against`` in a
temporary git worktree; the same venv), alternating tree by tree. Timed from start to exit, with the Ray
processes below the command sampled every 50 ms: how many trial-function processes the sweep started,
and the seconds from the stopped trial's line to the next trial's "started" line.

    .venv/bin/python benchmarks/bench_sweep_reuse.py --against a3433cf --repeats 1
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from bench_refusals import trees_and_digits

SWEEPS = {
    "3 trials, one at a time (the suite's)": ("[3.2e-2, 1.6e-6, 1.6e-2]", []),
    "4 trials, two at a time": ("[3.2e-2, 2.4e-2, 1.6e-2, 1.6e-6]",
                                ["--set", "tune.trial_cpus=0.5", "--set", "scaling.cpus_per_worker=0.5"]),
}


def sweep_command(storage: str, data: dict[str, str], values: str, extra: list[str]) -> list[str]:
    space = Path(storage) / "lr.yaml"
    space.parent.mkdir(parents=True)
    space.write_text(f"fixed:\n  optim.lr: null\nparams:\n  optim.lr_per_512: {{values: {values}}}\n")
    return ["tune", "--space", str(space), "--config", "smoke", "--set", f"run.storage_path={storage}",
            "--set", "scaling.num_workers=1", "--set", f"data.train={data['train']}", "--set", f"data.val={data['val']}",
            "--set", "data.prepare=null", "--set", "optim.epochs=3", "--set", "tune.name=asha",
            "--set", "tune.scheduler=asha", "--set", "tune.grace_period=1", "--set", "tune.reduction_factor=2", *extra]


def run(tree: Path, args: list[str]) -> tuple[float, int, int, float | None]:
    """(seconds, exit code, trial-function processes, seconds from the first "stopped early" line to the
    next "started" line) of `python -m pipeline ARGS` run in ``tree``."""
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=tree, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    functions, done = set(), threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if " ".join(child.cmdline()).startswith("ray::ImplicitFunc"):
                            functions.add(child.pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stopped_at, gap = None, None
    for line in process.stdout:
        now = time.monotonic()
        if stopped_at is None and re.search(r": stopped early after epoch \d+$", line):
            stopped_at = now
        elif stopped_at is not None and gap is None and line.rstrip().endswith(": started"):
            gap = now - stopped_at
    process.wait()
    done.set()
    watcher.join()
    return time.monotonic() - started, process.returncode, len(functions), gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the earlier commit, e.g. a3433cf")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    with trees_and_digits(args.against) as (scratch, trees, data):
        rows: dict[tuple[str, str], list[tuple[float, int, int, float | None]]] = {}
        for repeat in range(args.repeats):
            for index, (name, (values, extra)) in enumerate(SWEEPS.items()):
                for tree_name, tree in trees.items():
                    storage = f"{scratch}/runs-{repeat}-{index}-{tree_name.replace(' ', '-')}"
                    rows.setdefault((name, tree_name), []).append(run(tree, sweep_command(storage, data, values, extra)))
                    print(f"{repeat} {tree_name:>10} {name}: {rows[(name, tree_name)][-1]}", flush=True)

    print(f"\n`python -m pipeline tune ...`, {args.repeats} run(s) each, alternating trees; the mean\n")
    print(f"| sweep | this tree | {args.against} | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name in SWEEPS:
        cells = []
        for tree_name in trees:
            runs = rows[(name, tree_name)]
            gaps = [r[3] for r in runs if r[3] is not None]
            cells.append((sum(r[0] for r in runs) / len(runs), runs[-1][1], max(r[2] for r in runs),
                          f"{sum(gaps) / len(gaps):.1f} s" if gaps else "no trial after"))
        (new, new_code, new_functions, new_gap), (old, old_code, old_functions, old_gap) = cells
        print(f"| {name} | {new:.1f} s (exit {new_code}; {new_functions} trial processes; stop to next start "
              f"{new_gap}) | {old:.1f} s (exit {old_code}; {old_functions}; {old_gap}) | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
