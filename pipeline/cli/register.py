"""`vitsweep register SOURCE NAME [--alias A]`: a run's logged model, or a sweep's best trial's, as a
version of a registered MLflow model (``pipeline.trained.registry``)."""
from __future__ import annotations

import argparse

from pipeline.cli.config import add_config_arguments


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "register", help="Register a run's (or a sweep's best trial's) model in the MLflow model registry.",
        description="A new version of the registered model NAME (created if new) pointing at the run's logged "
                    "model, with the run's description, final metrics, datasets and knobs; a run already "
                    "registered under NAME keeps its version (no second one). A sweep stands for its best trial "
                    "by the sweep's metric (tune.metric).",
    )
    parser.add_argument(
        "source", metavar="SOURCE",
        help="a run's name (under run.storage_path) or directory, runs:/RUN_ID/model, models:/MODEL_ID, "
             "models:/NAME/VERSION or models:/NAME@ALIAS, or a sweep's name (under tune.storage_path, else "
             "run.storage_path) or directory",
    )
    parser.add_argument("name", metavar="NAME", help="the registered model's name")
    add_alias_argument(parser)
    add_config_arguments(parser)
    parser.set_defaults(run=_run)


def add_alias_argument(parser: argparse.ArgumentParser, flag: str = "--alias") -> None:
    parser.add_argument(flag, dest="alias", default=None, metavar="ALIAS",
                        help="point this alias of the registered model at the version (models:/NAME@ALIAS), e.g. "
                             "champion")


def announce(registration) -> str:
    """The console's lines about a registration: what it is, how to load it, where to see it."""
    from pipeline.tracking.ui import where_to_look_at_version

    outcome = (f"registered run {registration.run_id} as {registration.name!r} version {registration.version}"
               if registration.created else
               f"run {registration.run_id} is {registration.name!r} version {registration.version} already: no new "
               "version")
    alias = f"; alias {registration.alias!r} -> version {registration.version}" if registration.alias else ""
    return (f"{outcome}{alias}\n  load it as: {registration.uri} (MLflow store {registration.tracking_uri})\n"
            + where_to_look_at_version(registration.tracking_uri, registration.name, registration.version))


def registered_run(given: str, cfg) -> tuple[str, str, str | None]:
    """(tracking URI, run id, logged model id) of what SOURCE names: a sweep's best trial (its run's own
    model: None), else a model source's MLflow run and model."""
    from pipeline.errors import InvalidInputError
    from pipeline.sweeps.best_trial import best_trial, sweep_directory
    from pipeline.trained.model_source import resolve_model_source
    from pipeline.tracking.connection import resolve_tracking_uri

    sweep = sweep_directory(given, cfg)
    if sweep is not None:
        return *best_trial(given, sweep), None
    provenance = resolve_model_source(given, storage_path=cfg.run.storage_path,
                                      tracking_uri=resolve_tracking_uri(cfg)).provenance
    if not (provenance.run_id and provenance.tracking_uri):
        raise InvalidInputError(
            f"model source {given!r} ({provenance.kind}) names no MLflow run: only a run's logged model can be "
            "registered; give its run (name or directory) or runs:/RUN_ID/model"
            + ("; a run whose project moved is found in the store tracking.mlflow_uri names"
               if provenance.kind in ("run_name", "run_dir", "checkpoint_dir") else "")
        )
    if provenance.before_end:
        raise InvalidInputError(
            f"model source {given!r} is a checkpoint before the run's end, not its logged model (the final "
            "weights); register the run (its name or directory), or start a run from the checkpoint and register that"
        )
    return provenance.tracking_uri, provenance.run_id, provenance.model_id


def _run(args: argparse.Namespace) -> int:
    import os

    from pipeline.config.loading import load_config
    from pipeline.trained.registry import check_registry_names, register_run

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the resolver's downloads
    check_registry_names(args.name, args.alias)
    cfg = load_config(args.config, args.overrides).with_absolute_paths()
    tracking_uri, run_id, model_id = registered_run(args.source, cfg)
    print(announce(register_run(tracking_uri, run_id, args.name, args.alias, model_id)))
    return 0
