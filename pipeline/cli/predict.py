"""`vitsweep predict SOURCE IMAGE... | DIR`: the most probable classes of image files, each fed to the model
as its validation fed images (``pipeline.trained.prediction``). Writes nothing."""
from __future__ import annotations

import argparse
import json
import sys

from pipeline.cli.config import add_config_arguments, add_source_argument


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "predict", help="Classify image files with a trained model: top-K class names and probabilities.",
        description="Each image is decoded, center-cropped and normalised as the model's validation was "
                    "(its card: size, crop, mean, std); the class names are those of the dataset it was trained "
                    "on. A file that is not a readable image is named and skipped; the exit status is 1 if no "
                    "file could be classified.",
    )
    add_source_argument(parser)
    parser.add_argument("images", nargs="+", metavar="IMAGE_OR_DIR",
                        help="image files, and directories whose image files (by suffix, recursively) to classify")
    parser.add_argument("--topk", type=int, metavar="K",
                        help="how many classes per image, most probable first (default 5, or every class of a "
                             "model with fewer)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON list: {image, labels, probabilities, classes} per classified image")
    add_config_arguments(parser)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from pipeline.config.loading import load_config
    from pipeline.console import command_console
    from pipeline.data.images import UnreadableImageError
    from pipeline.trained.model_source import resolve_model_source
    from pipeline.trained.prediction import ImageClassifier, classify_files, image_files
    from pipeline.tracking.connection import resolve_tracking_uri

    with command_console() as console:  # library chatter (MLflow's download bars) stays off the output
        cfg = load_config(args.config, args.overrides).with_absolute_paths()
        files = image_files(args.images)
        source = resolve_model_source(args.source, storage_path=cfg.run.storage_path,
                                      tracking_uri=resolve_tracking_uri(cfg))
        classifier = ImageClassifier.of(source, source.require_card().eval_preprocessing(cfg.data))
        topk = classifier.resolve_topk(args.topk)
        found = []
        for path, outcome in classify_files(classifier, files, topk):
            if isinstance(outcome, UnreadableImageError):
                print(f"vitsweep predict: {outcome}; skipped", file=sys.stderr)
            elif args.json:
                found.append({"image": str(path), **outcome.as_dict()})
            else:
                found.append(path)
                console.line(f"{path}: " + ", ".join(f"{label} {probability:.1%}" for label, probability
                                                     in zip(outcome.labels, outcome.probabilities)))
    if args.json and found:
        print(json.dumps(found, indent=1))
    if not found:
        print(f"vitsweep predict: none of the {len(files)} file(s) is a readable image", file=sys.stderr)
        return 1
    return 0
