"""Subcommands whose issue has not landed yet: they say so and exit 1, they never pretend."""
from __future__ import annotations

import argparse
import sys

EXIT_NOT_AVAILABLE = 1


def _not_available(feature: str, issue: str):
    def run(args: argparse.Namespace) -> int:
        print(
            f"vitsweep {args.command}: {feature} is not available in this version yet "
            f"(tracked in issue {issue}); nothing was run.",
            file=sys.stderr,
        )
        return EXIT_NOT_AVAILABLE

    return run


def _add(commands, name: str, help_: str, feature: str, issue: str) -> None:
    parser = commands.add_parser(name, help=f"{help_} [not available yet]", description=help_)
    # Accept the final interface's arguments so scripts fail with the clear message, not a usage error.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(run=_not_available(feature, issue))


def add_tune_parser(commands) -> None:
    _add(commands, "tune", "Sweep the papers' knobs with Ray Tune, every trial in MLflow.",
         "sweeps", "#6 (Sweeps)")


def add_compare_parser(commands) -> None:
    _add(commands, "compare", "Print a sweep's results table from MLflow.", "sweep comparison", "#6 (Sweeps)")

