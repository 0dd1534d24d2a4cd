"""`vitsweep evaluate SOURCE --data X.beton`: top-1, top-5, loss, per-class accuracy and the confusion
matrix of a trained model on any dataset, recorded as an MLflow run beside the model's training run."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pipeline.cli.config import add_address_argument, add_config_arguments, add_source_argument, add_verbose_argument

DEFAULT_BATCH_SIZE = 64  # images per forward pass, per process
PER_CLASS_SHOWN = 20  # classes listed on the console; more: the least accurate ones


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "evaluate", help="Evaluate a trained model on a .beton: top-1/top-5/loss, per class, confusion matrix.",
        description="The dataset is read as training's validation reads it (center crop, every sample once), "
                    "with the model's own evaluation preprocessing unless --img-size / --crop-ratio say otherwise. "
                    "The result is an MLflow run in the source's experiment (tag vitsweep.role=evaluation), its "
                    "metrics also listed on the source's logged model.",
    )
    add_source_argument(parser)
    parser.add_argument("--data", required=True, metavar="X.beton", help="the dataset: a local path or a URI")
    parser.add_argument("--img-size", type=int, default=None, metavar="N",
                        help="evaluate at N px instead of the model's own size (where its weights allow)")
    parser.add_argument("--crop-ratio", type=float, default=None, metavar="R",
                        help="center crop of R x the shorter side, instead of the model's own (data.val_crop_ratio)")
    parser.add_argument("--flip-tta", action="store_true",
                        help="test-time augmentation: average each image's logits with its mirror image's")
    parser.add_argument("--ema", action="store_true", help="the EMA's weights (a run trained with optim.ema_decay)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="spread the dataset over N Ray Train workers (default: this one process)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="B",
                        help=f"images per forward pass, per process (default {DEFAULT_BATCH_SIZE})")
    add_config_arguments(parser)
    add_address_argument(parser)
    add_verbose_argument(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from pipeline.console import command_console

    with command_console(args.verbose) as console:
        return _evaluate(args, console)


def _evaluate(args: argparse.Namespace, console) -> int:
    from pipeline.config.loading import load_config
    from pipeline.data.runtime import quiet_numba_finalizers
    from pipeline.errors import InvalidInputError
    from pipeline.trained.evaluation import (announce, class_name_differences, evaluate_here, evaluate_on_ray,
        plan_evaluation, record_evaluation)
    from pipeline.tracking.ui import where_to_look

    quiet_numba_finalizers()
    if args.address and not args.workers:
        raise InvalidInputError(f"--address {args.address} runs the evaluation on Ray workers: give --workers N")
    plan = plan_evaluation(args.source, args.data, load_config(args.config, args.overrides), ema=args.ema,
                           img_size=args.img_size, crop_ratio=args.crop_ratio, workers=args.workers,
                           batch_size=args.batch_size, flip_tta=args.flip_tta)
    announce(plan, bool(args.address))
    differences = class_name_differences(plan)
    if differences:
        console.line(f"warning: the data's class names differ from the model's: {'; '.join(differences[:5])}"
                     + (f"; and {len(differences) - 5} more" if len(differences) > 5 else ""))
    with tempfile.TemporaryDirectory(prefix="vitsweep-evaluate-") as directory:
        log_file = Path(directory) / "vitsweep.log"
        console.open_log(log_file)
        evaluation = evaluate_on_ray(plan, args.address) if plan.workers else evaluate_here(plan)
        recorded = record_evaluation(plan, evaluation, log_file)
    m, suffix = evaluation.metrics, plan.metric_suffix
    console.line(f"val_top1{suffix} {m['val_top1']:.2f}%  val_top5{suffix} {m['val_top5']:.2f}%  "
                 f"val_loss{suffix} {m['val_loss']:.4f}  ({len(evaluation.labels)} images)")
    console.line(_per_class_line(evaluation.confusion, plan.classes))
    console.line(f"recorded as MLflow run {recorded.run_id} ({recorded.run_name!r}) in {recorded.tracking_uri}\n"
                 + where_to_look(recorded.tracking_uri, recorded.experiment_id, recorded.run_id))
    return 0


def _per_class_line(confusion, classes) -> str:
    from pipeline.trained.evaluation_report import per_class_rows

    rows = [row for row in per_class_rows(confusion, classes) if row["samples"]]
    if len(rows) > PER_CLASS_SHOWN:
        rows = sorted(rows, key=lambda row: row["accuracy"])[:PER_CLASS_SHOWN]
        head = f"the {PER_CLASS_SHOWN} least accurate of {len(classes)} classes (top-1): "
    else:
        head = "per class (top-1): "
    return head + "  ".join(f"{row['class']} {row['accuracy']:.1f}%" for row in rows)
