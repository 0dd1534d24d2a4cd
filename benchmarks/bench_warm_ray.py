"""Commands joining a warm local Ray (`ray start --head` once, then `--address auto`) against commands that
each start a new local Ray (no address), side by side.

The command is the smoke run (`vitsweep train --config smoke`, one epoch of the 2-worker smoke model on 16 px
digits, the suite's commonest command), alternating fresh and warm, timed from start to exit. The warm
cluster is started once, as README "A warm local Ray" starts it (its own token, ports and temp dir here,
so a user's cluster is left alone); its start and its idle cost (CPU seconds of its processes while
nothing runs) are printed too: what the first command pays, and what a warm cluster costs while it waits.

    .venv/bin/python benchmarks/bench_warm_ray.py --repeats 3
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from warm_ray import start_warm_ray  # noqa: E402  (the suite's warm cluster, set up as the README says)

REPO = Path(__file__).resolve().parents[1]
VITSWEEP = str(Path(sys.executable).parent / "vitsweep")


def smoke_train(storage: Path, env: dict[str, str], name: str) -> float:
    args = [VITSWEEP, "train", "--config", "smoke", "--set", f"run.storage_path={storage}",
            "--set", f"data.train={storage}/data/train.beton", "--set", f"data.val={storage}/data/val.beton",
            "--set", f"run.name={name}"]
    started = time.monotonic()
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return seconds


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):  # an idle cluster's processes stay; one gone is not counted
            times = process.cpu_times()
            total += times.user + times.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as root:
        storage = Path(root) / "runs"
        smoke_train(storage, env, "writes-the-dataset")  # not timed: the first run writes the dataset
        started = time.monotonic()
        warm = start_warm_ray(Path(root) / "home")
        start_s = time.monotonic() - started
        try:
            time.sleep(10)  # the measurement's protocol: its start's last work settles, outside the idle window
            processes = warm.processes()
            before = cpu_seconds(processes)
            time.sleep(args.idle_seconds)
            idle = (cpu_seconds(processes) - before) / args.idle_seconds
            times: dict[str, list[float]] = {"fresh": [], "warm": []}
            for i in range(args.repeats):
                times["fresh"].append(smoke_train(storage, env, f"fresh-{i}"))
                warm.wait_until_idle()
                times["warm"].append(smoke_train(storage, {**env, **warm.joining}, f"warm-{i}"))
        finally:
            warm.stop()
    print(f"host: {os.cpu_count()} cores; {args.repeats} smoke runs each, alternating")
    # Medians: one run in a few takes 10-15 s longer on this host, fresh or warm.
    for kind, seconds in times.items():
        print(f"  {kind:5s}: median {statistics.median(seconds):5.1f} s  ({', '.join(f'{s:.1f}' for s in seconds)})")
    fresh, warm_s = statistics.median(times["fresh"]), statistics.median(times["warm"])
    print(f"  saved per command: {fresh - warm_s:.1f} s ({fresh / warm_s:.2f}x)")
    print(f"  the warm cluster's start: {start_s:.1f} s; idle, its processes use {idle:.3f} CPU-seconds per second")


if __name__ == "__main__":
    main()
