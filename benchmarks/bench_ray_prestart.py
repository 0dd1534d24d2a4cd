"""A command's new local Ray with Ray's default prestarted workers (a Python worker per CPU for the first
driver) against one without them (``RAY_prestart_worker_first_driver=0``), side by side: whether leaving
them out saves a command CPU (it was measured for the suite's economics, issue #45, and is not adopted:
it saves none measurable).

The command is the smoke run (`vitsweep train --config smoke`, the suite's commonest command), alternating
the two, each measured by the machine's busy CPU-seconds from start to exit (everything the command
started: Ray's processes, its workers; run it on an otherwise idle machine) and its wall time, and by the
Ray worker processes that never took a task or actor.

    .venv/bin/python benchmarks/bench_ray_prestart.py --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from suite_cpu_by_process import busy_cpu_seconds

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")


def smoke_train(storage: Path, env: dict[str, str], name: str) -> tuple[float, float, int]:
    """(wall s, busy CPU-s, Ray workers that stayed idle) of one smoke run; its Ray workers' titles are
    sampled every 50 ms (Ray retitles a worker ``ray::IDLE`` -> ``ray::<actor or task>`` as it takes one)."""
    args = [VITSWEEP, "train", "--config", "smoke", "--set", f"run.storage_path={storage}",
            "--set", f"data.train={storage}/data/train.beton", "--set", f"data.val={storage}/data/val.beton",
            "--set", f"run.name={name}"]
    titles: dict[int, set[str]] = {}
    started, busy = time.monotonic(), busy_cpu_seconds()
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while process.poll() is None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    title = " ".join(child.cmdline())
                    if title.startswith("ray::") or child.pid in titles:
                        titles.setdefault(child.pid, set()).add(title.split()[0] if title else "")
        with contextlib.suppress(subprocess.TimeoutExpired):  # the next sample, or the run's end
            process.wait(timeout=0.05)
    wall, cpu = time.monotonic() - started, busy_cpu_seconds() - busy
    if process.returncode != 0:
        raise SystemExit(f"{name} failed:\n{process.stderr.read()[-3000:]}")
    never_used = sum(1 for seen in titles.values() if seen <= {"ray::IDLE", ""})
    return wall, cpu, never_used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for variable in ("RAY_ADDRESS", "RAY_prestart_worker_first_driver"):
        env.pop(variable, None)
    kinds = {"Ray's default (prestarted)": env, "without prestarted workers": {**env, "RAY_prestart_worker_first_driver": "0"}}
    results: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-prestart-") as root:
        storage = Path(root) / "runs"
        smoke_train(storage, env, "writes-the-dataset")  # not measured: the first run writes the dataset
        for i in range(args.repeats):
            for kind, kind_env in kinds.items():
                results[kind].append(smoke_train(storage, kind_env, f"{kind[:4]}-{i}"))
    print(f"host: {os.cpu_count()} cores; {args.repeats} smoke runs each, alternating")
    for kind, runs in results.items():
        walls, cpus, idle = zip(*runs)
        print(f"  {kind:26s} busy CPU median {statistics.median(cpus):5.1f} s ({', '.join(f'{c:.1f}' for c in cpus)})"
              f"  wall median {statistics.median(walls):5.1f} s  never-used Ray workers {', '.join(map(str, idle))}")
    default, without = (statistics.median(c for _, c, _ in runs) for runs in results.values())
    print(f"  CPU saved per command without them: {default - without:.1f} s ({default / without:.3f}x)")


if __name__ == "__main__":
    main()
