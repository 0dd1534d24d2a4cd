"""Bad input refused: this tree's vitsweep against an earlier commit's, side by side.

Each command runs as `python -m pipeline ...` in a checkout of each tree (this one, and ``--against``
checked out into a temporary git worktree; the same venv), alternating tree by tree so that load on a
shared machine hits both alike. Timed from the start to the exit, with the processes below the
command listed every 20 ms: how many of Ray's appeared. A valid command is timed to its
"training NAME:" line, the end of its start-up (Ray up, the store open), then stopped.

    .venv/bin/python benchmarks/bench_refusals.py --against c6c9cff~1 --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RAY_PROCESSES = ("gcs_server", "raylet", "ray::", "ray-dashboard")
NO_VALID_TRIAL = "params:\n  model.args.num_heads: {values: [3, 5, 7]}\n"


def commands(storage: str, data: dict[str, str], space: str) -> dict[str, list[str]]:
    train = ["train", "--config", "smoke", "--set", f"run.storage_path={storage}", "--set", f"data.train={data['train']}",
             "--set", f"data.val={data['val']}", "--set", "data.prepare=null"]
    return {
        "unknown key (`optim.lrr=1e-3`)": [*train, "--set", "optim.lrr=1e-3"],
        "bad value (`optim.lr=-1`)": [*train, "--set", "optim.lr=-1"],
        "missing dataset": [*train, "--set", f"data.train={storage}/nowhere.beton"],
        "a space with no valid combination (tune)": ["tune", "--space", space, "--config", "smoke",
                                                    "--set", f"run.storage_path={storage}"],
        "valid input, to its `training` line": train,
    }


@contextlib.contextmanager
def checked_out(commit: str, where: Path) -> Iterator[Path]:
    """``commit`` checked out at ``where`` (a detached git worktree of this repository), removed after."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=REPO, check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=REPO, capture_output=True)


@contextlib.contextmanager
def trees_and_digits(commit: str) -> Iterator[tuple[str, dict[str, Path], dict[str, str]]]:
    """(a scratch directory, the trees by name: this one and ``commit`` checked out, the smoke preset's
    digits written there as {"train", "val"} paths)."""
    from pipeline.config.loading import load_config
    from pipeline.data.prepare import prepare_digits

    with tempfile.TemporaryDirectory() as scratch, checked_out(commit, Path(scratch) / "earlier") as earlier:
        cfg = load_config("smoke")
        data = {"train": f"{scratch}/data/train.beton", "val": f"{scratch}/data/val.beton"}
        prepare_digits(cfg.data.model_copy(update=data), cfg.model.img_size)
        yield scratch, {"this tree": REPO, commit: earlier}, data


def run(tree: Path, args: list[str], until: str | None) -> tuple[float, int, int]:
    """(seconds, exit code, Ray processes seen) of `python -m pipeline ARGS` run in ``tree``."""
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=tree, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, done = set(), threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if child.name().startswith(RAY_PROCESSES):
                            seen.add(child.pid)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for line in process.stdout:
        if until and line.startswith(until):
            elapsed = time.monotonic() - started
            process.send_signal(2)  # SIGINT: the run ends KILLED, its Ray with it
            process.wait()
            break
    else:
        process.wait()
        elapsed = time.monotonic() - started
    done.set()
    watcher.join()
    return elapsed, process.returncode, len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the earlier commit, e.g. c6c9cff~1")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with trees_and_digits(args.against) as (scratch, trees, data):
        (Path(scratch) / "space.yaml").write_text(NO_VALID_TRIAL)
        rows: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
        for repeat in range(args.repeats):
            for tree_name, tree in trees.items():
                storage = f"{scratch}/runs-{repeat}-{tree_name.replace(' ', '-').replace('~', '-')}"
                for name, command in commands(storage, data, f"{scratch}/space.yaml").items():
                    until = "training " if name.startswith("valid") else None
                    rows.setdefault((name, tree_name), []).append(run(tree, command, until))
                    print(f"{repeat} {tree_name:>12} {name}: {rows[(name, tree_name)][-1]}", flush=True)

    print(f"\n`python -m pipeline ...`, {args.repeats} runs each, alternating trees; median seconds (exit code, "
          "Ray processes seen)\n")
    print(f"| command | this tree | {args.against} | ratio |")
    print("| --- | ---: | ---: | ---: |")
    names = list(dict.fromkeys(name for name, _ in rows))
    for name in names:
        cells = []
        for tree_name in trees:
            runs = rows[(name, tree_name)]
            cells.append((statistics.median(r[0] for r in runs), runs[-1][1], max(r[2] for r in runs)))
        (new, new_code, new_ray), (old, old_code, old_ray) = cells
        print(f"| {name} | {new:.1f} s (exit {new_code}, {new_ray} Ray) | {old:.1f} s (exit {old_code}, {old_ray} Ray) "
              f"| {old / new:.1f}x |")


if __name__ == "__main__":
    main()
