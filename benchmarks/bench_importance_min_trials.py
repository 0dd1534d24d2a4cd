"""How many configurations knob importance needs: fANOVA on synthetic sweeps with a known answer.

One knob of k drives the metric (its effect's standard deviation is 1); the others do nothing; the
metric carries Gaussian noise of standard deviation ``--noise`` (seed-to-seed spread). A sweep
"names the knob" when vitsweep's ``knob_importance`` (Optuna's fANOVA) ranks the driving knob first
with more than half of the importance. Two designs:

- random: N configurations drawn uniformly over k continuous knobs (random search / TPE);
- grid: a full grid of k choice knobs with L values each (N = L^k), the driving knob's values evenly
  spread.

Printed: the share of ``--repeats`` sweeps (different random draws) that name the knob, per design,
k and N. ``pipeline/sweeps/importance.py`` says "too few trials to say" below the N where this
reaches about 90 %.

    flock /tmp/vitsweep-heavy.lock .venv/bin/python benchmarks/bench_importance_min_trials.py
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
import time

from pipeline.sweeps.importance import knob_importance
from pipeline.sweeps.report import TrialRow
from pipeline.sweeps.spaces import Dimension

RANDOM_SIZES = (4, 6, 8, 10, 12, 16, 20, 24)
GRIDS = ((2, 2), (2, 3), (2, 4), (2, 5), (3, 2), (3, 3))  # (knobs, values per knob)


def _row(index: int, knobs: dict, value: float) -> TrialRow:
    return TrialRow(f"t{index}", f"r{index}", "completed", "", knobs, 1, {"val_top1": value}, None, None)


def named(rows: list[TrialRow], dims: list[Dimension], searcher: str) -> bool:
    found = knob_importance(rows, "val_top1", dims, searcher, needed=2)  # measured below the threshold too
    return max(found.importances, key=found.importances.get) == dims[0].key and found.importances[dims[0].key] > 0.5


def random_design(knobs: int, size: int, noise: float, rng: random.Random) -> bool:
    dims = [Dimension(f"k{j}", "uniform", low=0.0, high=1.0) for j in range(knobs)]
    rows = []
    for i in range(size):
        point = {dim.key: rng.random() for dim in dims}
        rows.append(_row(i, point, math.sqrt(12) * point["k0"] + rng.gauss(0, noise)))  # effect sd 1
    return named(rows, dims, "random")


def grid_design(knobs: int, levels: int, noise: float, rng: random.Random) -> bool:
    values = tuple(range(levels))
    dims = [Dimension(f"k{j}", "values", values=values) for j in range(knobs)]
    spread = math.sqrt(sum((v - (levels - 1) / 2) ** 2 for v in values) / levels)
    rows = [_row(i, dict(zip((d.key for d in dims), point)), point[0] / spread + rng.gauss(0, noise))
            for i, point in enumerate(itertools.product(values, repeat=knobs))]
    return named(rows, dims, "grid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0])
    args = parser.parse_args()
    start = time.time()
    for noise in args.noise:
        print(f"\nnoise sd {noise} (the driving knob's effect sd is 1); share of {args.repeats} sweeps naming it\n")
        print("| design | knobs | " + " | ".join(f"N={n}" for n in RANDOM_SIZES) + " |")
        print("| --- | ---: |" + " ---: |" * len(RANDOM_SIZES))
        for knobs in (2, 3, 5):
            rates = [sum(random_design(knobs, n, noise, random.Random(r)) for r in range(args.repeats)) / args.repeats
                     for n in RANDOM_SIZES]
            print(f"| random | {knobs} | " + " | ".join(f"{rate:.0%}" for rate in rates) + " |", flush=True)
        print("\n| design | knobs x values | N | named |\n| --- | --- | ---: | ---: |")
        for knobs, levels in GRIDS:
            rate = sum(grid_design(knobs, levels, noise, random.Random(r)) for r in range(args.repeats)) / args.repeats
            print(f"| grid | {knobs} x {levels} | {levels ** knobs} | {rate:.0%} |", flush=True)
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
