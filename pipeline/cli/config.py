"""`vitsweep config show|validate`: the resolved experiment config, as every command sees it."""
from __future__ import annotations

import argparse

from pipeline.config.loading import available_presets, load_config
from pipeline.config.papers import paper_recipes, resolve, shown
from pipeline.components.lr_scaling import describe_lr, recorded_params


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config / --set, shared by every command that takes an experiment config."""
    parser.add_argument(
        "--config", "-c", default=None, metavar="PRESET_OR_YAML",
        help=f"a preset ({', '.join(available_presets())}), a paper's recipe (paper:NNN[:ROW], rows in `vitsweep "
             "config diff --against paper:NNN`) or a YAML file; default: 'default'",
    )
    parser.add_argument(
        "--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a dotted key, e.g. --set optim.lr=1e-3 (repeatable)",
    )


def add_source_argument(parser: argparse.ArgumentParser) -> None:
    """SOURCE, shared by the commands that take a trained model (``pipeline.trained.model_source`` resolves it)."""
    parser.add_argument(
        "source", metavar="SOURCE",
        help="a trained model: a run's name (under run.storage_path) or directory, a checkpoint directory, a "
             ".safetensors file, runs:/RUN_ID/model, models:/MODEL_ID, models:/NAME/VERSION or models:/NAME@ALIAS "
             "(in the config's MLflow store: tracking.mlflow_uri, MLFLOW_TRACKING_URI, or run.storage_path/mlflow.db)",
    )


def add_address_argument(parser: argparse.ArgumentParser) -> None:
    """--address, shared by the commands that run on Ray."""
    parser.add_argument(
        "--address", default=None,
        help="Ray cluster to join: 'auto' (a running `ray start` cluster), ray://host:10001; default: "
             "RAY_ADDRESS if set (a `ray job submit` driver), else a new local Ray in this process",
    )


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    """--verbose, shared by the commands that run on Ray."""
    parser.add_argument(
        "--verbose", "-v", action="store_true",
        help="also show the libraries' output (Ray, DeepSpeed, MLflow, ...) on the console; it is always in the "
             "run's log file",
    )


def add_parser(commands) -> None:
    parser = commands.add_parser("config", help="Show or validate a resolved experiment config.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    show = actions.add_parser("show", help="Print the resolved config as YAML (or dotted keys with --flat).")
    add_config_arguments(show)
    show.add_argument("--flat", action="store_true", help="one dotted key per line, as MLflow params")
    show.set_defaults(run=_show)

    validate = actions.add_parser(
        "validate", help="Validate the config; build and run the model on the meta device (no memory, no compute)."
    )
    add_config_arguments(validate)
    validate.set_defaults(run=_validate)

    diff = actions.add_parser(
        "diff", help="List every key in which the config departs from a paper's recipe, the paper's value beside it.",
        description="Compares the resolved config (with the global batch and peak rate it trains at) with a paper's "
                    "ImageNet-1k recipe, key by key, each paper value with where it is printed (or, where the paper "
                    "is silent, the authors' code it comes from). Without :ROW, the paper's row for the config's "
                    "model. A finished run's config: its MLflow artifact config.yaml, downloaded, as --config.",
    )
    add_config_arguments(diff)
    diff.add_argument("--against", required=True, metavar="paper:NNN[:ROW]",
                      help="the paper's recipe: " + ", ".join(f"paper:{key} ({recipe.title})"
                                                              for key, recipe in paper_recipes().items()))
    diff.set_defaults(run=_diff)


def _show(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    world_size = cfg.scaling.num_workers
    if args.flat:  # as MLflow records them: the derived rate and batch too
        for key, value in {**cfg.flat(), **recorded_params(cfg.optim, world_size)}.items():
            print(f"{key}={value}")
    else:  # the derived values as a comment: the output stays a config file
        print(cfg.to_yaml(), end="")
        print(f"# {describe_lr(cfg.optim, world_size)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from pipeline.components.modeling import check_model, checked_training_sizes
    from pipeline.data.progressive_resolution import describe_sizes

    cfg = load_config(args.config, args.overrides)
    params = check_model(cfg.model)
    crops = ("" if cfg.data.progressive is None else
             f"; training crops {describe_sizes(checked_training_sizes(cfg.model, cfg.data.progressive, cfg.optim.epochs))}")
    start = f"; starts from {_initial_weights(cfg)}" if cfg.model.init_from else ""
    print(f"config ok: model {cfg.model.name} builds and runs with {params / 1e6:.2f}M parameters (1000 classes); "
          f"{describe_lr(cfg.optim, cfg.scaling.num_workers)}{crops}{start}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    from pipeline.config.papers import departures

    recipe, row_name = resolve(args.against)
    cfg = load_config(args.config, args.overrides)
    flat = {**cfg.flat(), **recorded_params(cfg.optim, cfg.scaling.num_workers)}
    row = recipe.row(row_name) if row_name else recipe.row_of(flat)
    found = departures(flat, recipe, row)
    compared = len(recipe.values(row))
    print(f"{args.config or 'default'} against {recipe.describe(row)}")
    if not row_name and flat["model.name"] != recipe.values(row)["model.name"].value:
        print(f"(no row of paper {recipe.paper} trains {flat['model.name']}: compared with its first row)")
    if not found:
        print(f"no departure: all {compared} keys of the recipe hold its values")
        return 0
    print(f"{len(found)} of {compared} keys depart{'s' if len(found) == 1 else ''}:")
    rows = [("KEY", "PAPER", "THIS CONFIG", "WHERE THE PAPER'S VALUE IS FROM")]
    rows += [(d.key, "(model default)" if d.paper is None else shown(d.paper), shown(d.config), d.source)
             for d in found]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for line in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[3])
    others = [name for name in recipe.rows if name != row.name]
    if others:
        print(f"other rows of paper {recipe.paper}: {', '.join(others)}")
    return 0


def _initial_weights(cfg) -> str:
    """``model.init_from`` resolved and fitted to the model as `train` checks it (InvalidInputError naming
    what does not), at the source's own class count (a bare weights file: the 1000 validated above):
    validating reads no dataset."""
    from pipeline.tracking.connection import resolve_tracking_uri
    from pipeline.trained.model_source import resolve_model_source
    from pipeline.trained.transfer import plan_transfer, shapes_of

    cfg = cfg.with_absolute_paths()
    source = resolve_model_source(cfg.model.init_from, storage_path=cfg.run.storage_path,
                                  tracking_uri=resolve_tracking_uri(cfg), ema=cfg.model.init_ema)
    classes = source.card.num_classes if source.card else 1000
    return plan_transfer(shapes_of(source.weights), source.card, source.provenance, cfg.model, classes).summary()
