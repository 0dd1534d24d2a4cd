"""What one sweep trial's function and its Ray Train controller hold in memory: the figure a head's trial
slots are sized by (cluster/: 16 slots per head; README "Sweeps", Resources).

Runs `vitsweep tune` (the smoke model, a 2-trial grid, one trial at a time) on the offline digits and
samples every 0.2 s the resident (RSS) and unique (USS: freed if the process ends) memory of each
``ray::ImplicitFunc`` (trial function) and ``ray::TrainController`` process; prints the peaks.

    .venv/bin/python benchmarks/trial_function_memory.py
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

KINDS = {"ray::ImplicitFunc": "trial function", "ray::TrainController": "Ray Train controller"}
VITSWEEP = str(Path(sys.executable).with_name("vitsweep"))


def sample(root: int, peaks: dict[str, dict[str, float]], stop: threading.Event) -> None:
    while not stop.wait(0.2):
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process(root).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    title = " ".join(process.cmdline())
                    kind = next((name for prefix, name in KINDS.items() if title.startswith(prefix)), None)
                    if kind:
                        memory = process.memory_full_info()
                        peak = peaks.setdefault(kind, {"rss": 0.0, "uss": 0.0})
                        peak["rss"], peak["uss"] = max(peak["rss"], memory.rss), max(peak["uss"], memory.uss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    from pipeline.config.schema import DataConfig
    from pipeline.data.prepare import prepare_digits

    with tempfile.TemporaryDirectory(prefix="trial-memory-") as root:
        root = Path(root)
        train, val = prepare_digits(DataConfig(train=str(root / "train.beton"), val=str(root / "val.beton")), img_size=16)
        space = root / "lr.yaml"
        space.write_text("params:\n  optim.lr: {values: [1.0e-3, 2.0e-3]}\n")
        command = [VITSWEEP, "tune", "--space", str(space), "--config", "smoke", "--set", f"run.storage_path={root}",
                   "--set", f"data.train={train}", "--set", f"data.val={val}", "--set", "data.prepare=null",
                   "--set", "scaling.num_workers=1", "--set", "optim.epochs=1", "--set", "tune.scheduler=fifo"]
        peaks: dict[str, dict[str, float]] = {}
        stop = threading.Event()
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=sample, args=(process.pid, peaks, stop), daemon=True)
        sampler.start()
        code = process.wait()
        stop.set()
        sampler.join()
    if code != 0:
        sys.exit(f"the sweep exited {code}")
    print(f"sweep of 2 one-epoch trials: {time.monotonic() - started:.0f} s")
    print(f"{'process':<22} {'peak RSS':>10} {'peak USS':>10}")
    for kind, peak in peaks.items():
        print(f"{kind:<22} {peak['rss'] / 2**20:>7.0f} MiB {peak['uss'] / 2**20:>7.0f} MiB")
    total = sum(peak["rss"] for peak in peaks.values()) / 2**30
    print(f"together (RSS): {total:.2f} GiB per trial")


if __name__ == "__main__":
    main()
