"""The `vitsweep` command. Each subcommand group lives in its own module with ``add_parser``.

Exit codes: 0 success, 2 invalid input (config, path, dataset), 1 failure at run time, 130 / 143
interrupted by SIGINT / SIGTERM.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
from typing import NoReturn

from pipeline import interrupts
from pipeline.cli import compare, config, data, doctor, evaluate, models, predict, register, train, tune
from pipeline.errors import AlreadyFinished, Interrupted, InvalidInputError, RunFailed
from pipeline.uris import redact

EXIT_OK, EXIT_FAILURE, EXIT_INVALID_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitsweep",
        description="Train and sweep compact vision transformers with FFCV, DeepSpeed, Ray and MLflow.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train.add_parser(commands)
    tune.add_parser(commands)
    compare.add_parser(commands)
    evaluate.add_parser(commands)
    predict.add_parser(commands)
    register.add_parser(commands)
    data.add_parser(commands)
    models.add_parser(commands)
    config.add_parser(commands)
    doctor.add_parser(commands)
    return parser


def entry_point() -> NoReturn:
    """The installed `vitsweep` (and `python -m pipeline`): ``main``, then the process ends once
    Python's exit handlers ran (Ray's shutdown, MLflow's and the log files' flushes, ffcv's threads).

    Python would then collect every module's garbage before exiting: ~4 s after a training command
    on a 2-core machine (torch, Ray and MLflow hold millions of objects), with nothing left to do."""
    code = 1  # an exception escaping ``main``: Python prints it, and the command fails

    def end_now() -> None:  # registered first, so it runs after every handler registered later
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to say
                stream.flush()
        os._exit(code)

    atexit.register(end_now)
    try:
        code = main()
    except SystemExit as exit_:  # a library's sys.exit inside main: the code Python would exit with
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        raise
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    try:
        with interrupts.raised():  # first: a signal at any later moment ends the command with its exit code
            return _command(argv)
    except Interrupted as stop:  # before the command line was read
        print(f"vitsweep: interrupted by {stop.signal_name}", file=sys.stderr)
        return stop.exit_code


def _command(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on usage errors, 0 on --help
        return int(exit_.code or 0)
    try:
        return int(args.run(args) or EXIT_OK)
    except InvalidInputError as err:
        print(redact(f"vitsweep {args.command}: {err}"), file=sys.stderr)
        return EXIT_INVALID_INPUT
    except AlreadyFinished as done:
        print(redact(f"vitsweep {args.command}: {done}"))
        return EXIT_OK
    except RunFailed as err:
        print(redact(f"vitsweep {args.command}: {err}"), file=sys.stderr)
        return EXIT_FAILURE
    except Interrupted as stop:
        print(f"vitsweep {args.command}: interrupted by {stop.signal_name}{'; ' if stop.outcome else ''}{stop.outcome}",
              file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # SIGINT where a library put Python's default handler back
        print(f"vitsweep {args.command}: interrupted by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
