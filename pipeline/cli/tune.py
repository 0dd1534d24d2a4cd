"""`vitsweep tune`: a Ray Tune sweep of `vitsweep train` runs, each trial a nested MLflow run."""
from __future__ import annotations

import argparse
import sys

from pipeline.cli.config import add_address_argument, add_config_arguments, add_verbose_argument
from pipeline.cli.register import add_alias_argument, announce
from pipeline.errors import InvalidInputError


def add_parser(commands) -> None:
    from pipeline.sweeps.spaces import available_spaces

    parser = commands.add_parser(
        "tune", help="Sweep the papers' knobs with Ray Tune, every trial in MLflow.",
        description="Run a search space over the experiment config: grid, random or Optuna TPE sampling, ASHA or "
                    "FIFO scheduling (tune.* keys, see `vitsweep config show`). Every sampled config is checked "
                    "before any trial starts; invalid ones are pruned.",
    )
    parser.add_argument(
        "--space", dest="spaces", action="append", default=[], metavar="NAME_OR_YAML",
        help=f"a search space: shipped ({', '.join(available_spaces())}) or a YAML file; repeat to search several "
             "together (e.g. --space fsne_code_size --space lr_wd)",
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--resume", metavar="SWEEP_DIR", default=None,
        help="continue an interrupted sweep from its directory (printed when it started); finished trials are "
             "not run again. With it, --set takes only tune.budget_hours (a sweep stopped at its budget goes on "
             "with a larger one)",
    )
    parser.add_argument(
        "--register", default=None, metavar="NAME",
        help="when the sweep ends, register its best trial's model as a version of NAME in the MLflow model "
             "registry (as `vitsweep register SWEEP NAME`)",
    )
    add_alias_argument(parser)
    add_address_argument(parser)
    add_verbose_argument(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from pipeline.console import command_console

    with command_console(args.verbose) as console:
        return _sweep(args, console)


def _sweep(args: argparse.Namespace, console) -> int:
    from pipeline.trained.registry import check_registry_names, register_run
    from pipeline.sweeps.runner import BUDGET_KEY, load_sweep, prepare_sweep, run_sweep
    from pipeline.sweeps.spend import format_spend
    from pipeline.sweeps.importance import format_importance
    from pipeline.sweeps.report import knobs_text
    from pipeline.sweeps.summary import SUMMARY_NAME
    from pipeline.tracking.connection import check_logger_can_reach
    from pipeline.tracking.store import MlflowRun
    from pipeline.tracking.ui import model_line, ui_link, ui_server, where_to_look

    if args.alias and not args.register:
        raise InvalidInputError(f"--alias {args.alias} names an alias of the model --register NAME registers; give both")
    if args.register:
        check_registry_names(args.register, args.alias)
    if args.resume:
        given = [flag for flag, value in (("--space", args.spaces), ("--config", args.config)) if value]
        given += [f"--set {override}" for override in args.overrides if not override.startswith(f"{BUDGET_KEY}=")]
        if given:
            raise InvalidInputError(f"--resume continues the sweep exactly as it started; drop {', '.join(given)} "
                                    f"(only --set {BUDGET_KEY}=HOURS may change)")
        sweep = load_sweep(args.resume, args.overrides)
    else:
        sweep = prepare_sweep(args.config, args.overrides, args.spaces)
    check_logger_can_reach(sweep.tracking_uri, args.address)
    outcome = run_sweep(sweep, address=args.address, resume=bool(args.resume))

    ended = "stopped at its budget" if outcome.stopped_at_budget else "interrupted" if outcome.interrupted else "finished"
    console.line(f"\nsweep {outcome.name} ({ended}):\n{outcome.table}\n\n"
                 f"{format_importance(outcome.knob_importance)}\n\n{format_spend(outcome.spend, sweep.cfg.tune.metric)}")
    if outcome.best is not None:
        metric = sweep.cfg.tune.metric
        model_id = MlflowRun(outcome.tracking_uri, outcome.best.run_id).model_id()
        console.line(f"\nbest trial {outcome.best.trial_id}: {metric} {outcome.best.value(metric):.4g}  "
                     f"{knobs_text(outcome.best.knobs)}" + (f"\n{model_line(model_id)}" if model_id else ""))
    console.line(f"  sweep directory: {outcome.directory}\n"
                 f"  MLflow parent run {outcome.parent_run_id} in {outcome.tracking_uri}\n"
                 + where_to_look(outcome.tracking_uri, outcome.experiment_id, view=outcome.view)
                 + f"\n  the sweep's result on one page: "
                 f"{ui_link(ui_server(outcome.tracking_uri), outcome.experiment_id, outcome.parent_run_id, artifact=SUMMARY_NAME)}")
    if outcome.stopped_at_budget:  # as asked: the best of what the budget bought stands, and may be registered
        console.line(f"vitsweep tune: stopped at its budget: {outcome.stop_reason.partition(': ')[2]}")
    elif outcome.interrupted:
        print(f"vitsweep tune: interrupted; continue with: vitsweep tune --resume {outcome.directory}", file=sys.stderr)
        return 1
    if outcome.best is None:
        print("vitsweep tune: no trial trained every epoch (see the table's reasons)"
              + (f"; nothing registered as {args.register!r}" if args.register else ""), file=sys.stderr)
        return 1
    if args.register:
        console.line(announce(register_run(outcome.tracking_uri, outcome.best.run_id, args.register, args.alias)))
    return 0
