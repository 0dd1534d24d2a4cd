"""A command's end: vitsweep's entry point vs Python's plain exit, after a training run.

The installed `vitsweep` (``pipeline.cli:entry_point``) ends the process once Python's exit handlers
ran; a plain ``sys.exit(main())`` goes on to Python's last garbage collection of every module. Both
run the same `vitsweep train` (the smoke preset, a fresh local Ray each, the same datasets),
alternating pair by pair so that load on a shared machine hits both alike; each is timed from its
last console line to the process's exit, and whole.

    .venv/bin/python benchmarks/bench_command_exit.py --pairs 2
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")
PLAIN_EXIT = [sys.executable, "-c", "import sys; from pipeline.cli import main; sys.exit(main(sys.argv[1:]))"]


def timed(command: list[str]) -> tuple[float, float]:
    """(last console line -> exit, whole command) in seconds."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_line = started
    for _ in process.stdout:
        last_line = time.monotonic()
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... exited {process.returncode}")
    ended = time.monotonic()
    return ended - last_line, ended - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()

    from pipeline.config.loading import load_config
    from pipeline.data.prepare import prepare_digits

    cfg = load_config("smoke")
    results: dict[str, list[tuple[float, float]]] = {"entry point (installed `vitsweep`)": [], "plain sys.exit(main())": []}
    with tempfile.TemporaryDirectory() as storage:
        data = {"train": f"{storage}/data/train.beton", "val": f"{storage}/data/val.beton"}
        prepare_digits(cfg.data.model_copy(update=data), cfg.model.img_size)
        for pair in range(args.pairs):
            for (name, rows), prefix in zip(results.items(), ([VITSWEEP], PLAIN_EXIT)):
                train = ["train", "--config", "smoke", "--set", f"run.storage_path={storage}/{len(rows)}-{name[:5]}",
                         "--set", f"data.train={data['train']}", "--set", f"data.val={data['val']}",
                         "--set", "data.prepare=null"]
                rows.append(timed(prefix + train))
                print(f"pair {pair}: {name}: last line -> exit {rows[-1][0]:.1f} s, whole {rows[-1][1]:.1f} s", flush=True)
    print(f"\n`vitsweep train --config smoke`, {args.pairs} pairs, alternating\n")
    print("| ending | last line -> exit (s) | whole command (s) | median whole (s) |")
    print("| --- | --- | --- | ---: |")
    for name, rows in results.items():
        print(f"| {name} | {', '.join(f'{tail:.1f}' for tail, _ in rows)} | {', '.join(f'{whole:.1f}' for _, whole in rows)} "
              f"| {statistics.median(whole for _, whole in rows):.1f} |")


if __name__ == "__main__":
    main()
