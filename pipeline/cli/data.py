"""`vitsweep data write|inspect|stage|prepare`: FFCV datasets, from sources to node-local copies."""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

from pipeline.cli.config import add_config_arguments
from pipeline.config.schema import DataConfig

SOURCE_HELP = "an ImageFolder directory (one folder per class), a CIFAR-10/100 python-pickle directory, or 'digits'"


def add_parser(commands) -> None:
    parser = commands.add_parser("data", help="Write, inspect and stage FFCV datasets.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    write = actions.add_parser(
        "write", help="Write SOURCE into OUT.beton (+ OUT.beton.json sidecar) with parallel workers.",
        description=f"Write SOURCE ({SOURCE_HELP}) into an FFCV .beton with an RGBImageField and an IntField "
                    "label, plus its JSON sidecar. The file appears only once complete.",
    )
    write.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    write.add_argument("out", metavar="OUT.beton")
    write.add_argument("--split", choices=["train", "val"], default=None,
                       help="digits and CIFAR: which split (digits: fixed, seeded 80/20); "
                            "ImageFolder: the SOURCE/<split> folder")
    write.add_argument("--img-size", type=int, default=None, metavar="PX", help="digits only: image side (default 32)")
    write.add_argument("--classes", default=None, metavar="A,B,...",
                       help="only these classes of SOURCE (its class names), relabelled 0..k-1 in this order")
    write.add_argument("--per-class", type=int, default=None, metavar="N",
                       help="at most N images of each class, the first in SOURCE's order (a few-shot set)")
    from pipeline.data.sidecar import FFCV_IMAGENET_WRITE as default  # ffcv-imagenet's settings

    write.add_argument("--write-mode", choices=["raw", "jpg", "proportion"], default=default.write_mode,
                       help="raw: exact uint8 pixels; jpg: JPEG-compressed; proportion: a random share as JPEG, "
                            f"the rest raw (default {default.write_mode}, as ffcv-imagenet)")
    write.add_argument("--max-resolution", type=int, default=default.max_resolution, metavar="PX",
                       help=f"downscale so the longest side is at most PX (default {default.max_resolution})")
    write.add_argument("--jpeg-quality", type=int, default=default.jpeg_quality, metavar="Q",
                       help=f"JPEG quality 1-100 (default {default.jpeg_quality})")
    write.add_argument("--compress-probability", type=float, default=default.compress_probability, metavar="P",
                       help=f"proportion mode: share of images stored as JPEG (default {default.compress_probability})")
    write.add_argument("--workers", type=int, default=None, metavar="N", help="writer processes (default: all CPUs)")
    write.add_argument("--overwrite", action="store_true", help="replace OUT.beton if it exists")
    write.set_defaults(run=_write)

    inspect = actions.add_parser(
        "inspect", help="Verify FILE against its sidecar; print its counts; with --grid, save decoded samples as a "
                        "PNG grid."
    )
    inspect.add_argument("file", metavar="FILE.beton")
    inspect.add_argument("--samples", type=int, default=16, metavar="N",
                         help="samples in the grid and the export (default 16)")
    inspect.add_argument("--grid", default=None, metavar="PNG",
                         help="save N decoded samples, each with its class, as one PNG grid here (nothing is written "
                              "without it)")
    inspect.add_argument("--no-checksum", action="store_true", help="skip hashing the file (large files)")
    inspect.add_argument("--export", default=None, metavar="DIR",
                         help="also save the same samples, as stored, as DIR/<index>_<class>.png (a new or empty "
                              "directory), e.g. to try `vitsweep predict` on them")
    inspect.set_defaults(run=_inspect)

    stage = actions.add_parser("stage", help="Copy a dataset URI once into this node's cache; print the local path.")
    stage.add_argument("uri", metavar="URI_OR_PATH", help="s3://, gs://, file://, ... or a local path (used in place)")
    stage.add_argument("--cache-dir", required=True, metavar="DIR", help="node-local directory for staged copies")
    streams = DataConfig.model_fields["stage_streams"]
    stage.add_argument("--streams", type=int, default=streams.default, metavar="N",
                       help=f"byte ranges read at once, as data.stage_streams (default {streams.default})")
    stage.set_defaults(run=_stage)

    prepare = actions.add_parser(
        "prepare", help="Write the offline digits dataset to the config's data.train/data.val if they do not exist."
    )
    add_config_arguments(prepare)
    prepare.set_defaults(run=_prepare)


def _user_facing() -> None:
    from pipeline.data.runtime import quiet_numba_finalizers

    quiet_numba_finalizers()


@contextlib.contextmanager
def _warnings_on_stderr():
    """The sources' warnings (files left out) as ``warning:`` lines on stderr, when the block ends."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for warning in caught:
                print(f"warning: {warning.message}", file=sys.stderr)


def _write(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from pipeline.data.sidecar import WriteOptions
    from pipeline.data.sources import DIGITS, SubsetSource, check_per_class, open_source
    from pipeline.data.writing import WriteFailedError, check_output, write_beton
    from pipeline.errors import InvalidInputError
    from pipeline.training.locations import check_can_create

    _user_facing()
    check_can_create(files={"OUT.beton": args.out})
    check_output(args.out, args.overwrite)  # before the source is scanned (ImageNet: every image's header)
    check_per_class(args.per_class)
    if args.img_size is not None and args.source != DIGITS:
        raise InvalidInputError(f"--img-size applies to {DIGITS!r} only; for {args.source!r} use --max-resolution")
    try:
        options = WriteOptions(
            write_mode=args.write_mode, max_resolution=args.max_resolution,
            jpeg_quality=args.jpeg_quality, compress_probability=args.compress_probability,
        )
    except ValidationError as err:
        problems = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')} = {e['input']!r}: {e['msg']}"
                             for e in err.errors(include_url=False))
        raise InvalidInputError(problems) from None
    if args.workers is not None and args.workers < 1:
        raise InvalidInputError(f"--workers {args.workers}: need at least 1 writer process")
    classes = [name.strip() for name in args.classes.split(",")] if args.classes is not None else None
    if classes is not None and not all(classes):
        raise InvalidInputError(f"--classes {args.classes!r}: give class names separated by commas")
    try:
        with _warnings_on_stderr():
            source = open_source(args.source, args.split, args.img_size)
            if classes is not None or args.per_class is not None:
                source = SubsetSource(source, classes, args.per_class)
            sidecar = write_beton(source, args.out, options, num_workers=args.workers, overwrite=args.overwrite)
    except WriteFailedError as err:
        print(f"vitsweep data write: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {sidecar.num_samples} samples, {sidecar.num_classes} classes, "
          f"{sidecar.size_bytes / 1e6:.1f} MB, {options.write_mode} mode; sha256 {sidecar.sha256[:16]}...")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from PIL import Image

    from pipeline.data.inspection import decode_samples, export_samples, sample_grid, spread_indices
    from pipeline.data.integrity import check_beton
    from pipeline.uris import location_problem
    from pipeline.errors import InvalidInputError
    from pipeline.training.locations import check_can_create

    _user_facing()
    if args.samples < 1:
        raise InvalidInputError(f"--samples {args.samples}: need at least 1")
    export = Path(args.export) if args.export else None
    if export is not None and (export.is_file() or (export.is_dir() and any(export.iterdir()))):
        raise InvalidInputError(f"--export {args.export}: not an empty directory; give a new or empty one")
    problem = location_problem(args.file, kind="file")
    if problem:
        raise InvalidInputError(f"FILE.beton: {problem}")
    grid_path = Path(args.grid) if args.grid else None
    if grid_path is not None and grid_path.suffix.lower() not in Image.registered_extensions():
        raise InvalidInputError(f"--grid {args.grid}: name an image file (.png, .jpg, ...): its suffix says the format")
    check_can_create(directories={"--export": export} if export is not None else None,
                     files={"--grid": grid_path} if grid_path is not None else None)
    sidecar = check_beton(args.file, verify_checksum=not args.no_checksum)
    size = sidecar.image_size
    print(f"file      {args.file}")
    print(f"integrity ok (structure, size, labels{'' if args.no_checksum else ', sha256'})")
    print(f"source    {sidecar.source.kind} {sidecar.source.location}"
          f"{f' split={sidecar.source.split}' if sidecar.source.split else ''}")
    if sidecar.source.selected_classes or sidecar.source.per_class:
        kept = ", ".join(sidecar.source.selected_classes or ["every class"])
        print(f"subset    {kept}" + (f"; at most {sidecar.source.per_class} images each" if sidecar.source.per_class else ""))
    print(f"samples   {sidecar.num_samples} in {sidecar.num_classes} classes")
    print(f"images    {size.min_width}-{size.max_width} x {size.min_height}-{size.max_height} px "
          f"(mean {size.mean_width:g} x {size.mean_height:g}); stored {sidecar.write.write_mode}"
          f"{f', max {sidecar.write.max_resolution}px' if sidecar.write.max_resolution else ''}")
    width = max(len(name) for name in sidecar.classes)
    print("counts per class:")
    for name, count in sidecar.counts_per_class.items():
        print(f"  {name:<{width}}  {count}")
    indices = spread_indices(sidecar.num_samples, args.samples)
    if grid_path is not None:
        images, labels = decode_samples(args.file, indices)
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        sample_grid(images, [sidecar.classes[label] for label in labels]).save(grid_path)
        print(f"saved {len(indices)} decoded samples to {grid_path}")
    if export is not None:
        written = export_samples(args.file, indices, sidecar.classes, export)
        print(f"exported {len(written)} samples, as stored, to {export}/")
    return 0


def _stage(args: argparse.Namespace) -> int:
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    from pipeline.uris import location_problem
    from pipeline.data.staging import stage_dataset
    from pipeline.errors import InvalidInputError
    from pipeline.training.locations import check_can_create

    problem = location_problem(args.uri, kind="file")
    if problem:
        raise InvalidInputError(f"URI_OR_PATH: {problem}")
    streams = DataConfig.model_fields["stage_streams"]  # the flag takes what the config key takes
    try:
        TypeAdapter(Annotated[streams.annotation, streams]).validate_python(args.streams)
    except ValidationError as err:
        raise InvalidInputError(f"--streams {args.streams}: {err.errors(include_url=False)[0]['msg']}") from None
    check_can_create({"--cache-dir": args.cache_dir})
    print(stage_dataset(args.uri, args.cache_dir, args.streams))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from pipeline.config.loading import load_config
    from pipeline.data.prepare import prepare_digits
    from pipeline.training.locations import check_can_create

    _user_facing()
    cfg = load_config(args.config, args.overrides)
    check_can_create(files={"data.train": cfg.data.train, "data.val": cfg.data.val})
    train, val = prepare_digits(cfg.data, cfg.model.img_size)
    print(f"digits at {cfg.model.img_size}px: train {train}, val {val}")
    return 0
