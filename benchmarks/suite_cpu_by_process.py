"""Where a command's CPU goes, by kind of process: ``make test``'s end-to-end runs start many short-lived
processes (Ray's, MLflow's, Chromium), so its time on 2 cores is the CPU they use, not one profile.

    .venv/bin/python benchmarks/suite_cpu_by_process.py --out cpu.json -- make test

Every second it reads every process's CPU time (psutil), keyed by pid and start time, and files it
under a kind read off its command line; at the end it prints each kind's CPU-seconds and process count,
and the machine's busy and idle CPU over the command. A process that lives less than a second is missed;
Ray truncates its workers' titles (``ray::RayTrainWo``), so all of Ray's worker processes are one kind.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import time

import psutil

# Substring of the command line -> kind; the first that matches wins.
KINDS = [
    ("ray::DashboardAgent", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("ray::RuntimeEnvAgent", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("ray::", "Ray worker processes (Train workers, controllers, helper actors, trial functions)"),
    ("default_worker.py", "Ray worker processes (Train workers, controllers, helper actors, trial functions)"),
    ("gcs_server", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("raylet", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("dashboard", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("log_monitor", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("monitor.py", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("runtime_env/agent", "Ray's own processes (GCS, raylet, dashboard, agents, monitors)"),
    ("huey", "MLflow servers"), ("mlflow server", "MLflow servers"), ("uvicorn", "MLflow servers"),
    ("_job_runner", "MLflow servers"), ("mlflow models serve", "MLflow model serving"),
    ("chromium", "Chromium"), ("chromedriver", "Chromium"),
    ("bin/vitsweep", "vitsweep commands"), ("-m pipeline", "vitsweep commands"),
    ("import sys;exec(", "pytest and its workers"), ("pytest", "pytest and its workers"),
    ("multiprocessing", "multiprocessing children (torch ranks, spawned servers)"),
]


def busy_cpu_seconds() -> float:
    """The machine's busy CPU time so far, all cores."""
    times = psutil.cpu_times()
    return sum(getattr(times, field) for field in ("user", "system", "nice", "irq", "softirq"))


def kind_of(command: str) -> str:
    return next((kind for part, kind in KINDS if part in command), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cpu_by_process.json")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    start, busy_before, idle_before = time.time(), busy_cpu_seconds(), psutil.cpu_times().idle
    process = subprocess.Popen(command)
    seen: dict[tuple[int, float], tuple[str, float]] = {}
    while process.poll() is None:
        for each in psutil.process_iter(["pid", "cmdline", "cpu_times", "create_time"]):
            info = each.info
            if info["cpu_times"] is None or info["create_time"] < start - 1:
                continue
            key = (info["pid"], info["create_time"])
            kind = kind_of(" ".join(info["cmdline"] or []))
            kind = seen[key][0] if key in seen and kind == "other" else kind  # a process's last title is kept
            seen[key] = (kind, info["cpu_times"].user + info["cpu_times"].system)
        try:  # a sample a second, and none after the command ends
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    busy = busy_cpu_seconds() - busy_before
    totals, counts = collections.Counter(), collections.Counter()
    for kind, seconds in seen.values():
        totals[kind] += seconds
        counts[kind] += 1
    report = {"command": command, "returncode": process.returncode, "wall_s": round(time.time() - start, 1),
              "busy_cpu_s": round(busy, 1), "idle_cpu_s": round(psutil.cpu_times().idle - idle_before, 1),
              "by_kind": {kind: {"cpu_s": round(seconds, 1), "processes": counts[kind]}
                          for kind, seconds in totals.most_common()}}
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)
    print(json.dumps(report, indent=1))
    raise SystemExit(process.returncode)


if __name__ == "__main__":
    main()
