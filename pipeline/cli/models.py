"""`vitsweep models list|show`: every registered variant with our counts beside the paper's."""
from __future__ import annotations

import argparse
import json

from pipeline.errors import InvalidInputError


def add_parser(commands) -> None:
    parser = commands.add_parser("models", help="List registered model variants or show one's parameters.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="Params, GFLOPs, the paper's params/top-1, per variant.")
    listing.add_argument("--json", action="store_true", help="machine-readable rows")
    listing.add_argument("--family", default=None, help="only this family (xcit, vit, eit, sot)")
    listing.set_defaults(run=_list)

    show = actions.add_parser("show", help="Per-module parameter breakdown of one variant.")
    show.add_argument("name")
    show.add_argument("--depth", type=int, default=2, help="module nesting level to aggregate at")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="constructor override, e.g. --set qkv=fsne --set code_size=16")
    show.set_defaults(run=_show)


def catalog_rows(family: str | None = None) -> list[dict]:
    from models import VARIANTS
    from models.measure import build_on_meta, count_params, count_reported_gflops

    rows = []
    for name, facts in sorted(VARIANTS.items()):
        if family and facts.family != family:
            continue
        model = build_on_meta(name, img_size=facts.img_size)
        rows.append({
            "name": name,
            "family": facts.family,
            "paper": facts.paper,
            "row": facts.row,
            "img_size": facts.img_size,
            "params": count_params(model),
            "gflops": round(count_reported_gflops(model, facts), 3),  # as the paper counts, see flop_ops
            "flop_ops": facts.flop_ops,
            "flops_per_mac": facts.flops_per_mac,
            "paper_params": facts.params,
            "paper_gflops": facts.gflops,
            "paper_top1": facts.top1,
        })
    return rows


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def _list(args: argparse.Namespace) -> int:
    rows = catalog_rows(args.family)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'name':<30}{'family':<7}{'paper':<6}{'px':>5}{'params(M)':>11}{'GFLOPs':>9}" \
             f"{'paper M':>9}{'paper GF':>9}{'top-1':>7}  FLOPs counted"
    print(header)
    print("-" * len(header))
    for r in rows:
        counted = r["flop_ops"] + (f", {r['flops_per_mac']}/MAC" if r["flops_per_mac"] != 1 else "")
        print(f"{r['name']:<30}{r['family']:<7}{r['paper']:<6}{r['img_size']:>5}{_fmt(r['params'], 1e6):>11}"
              f"{_fmt(r['gflops']):>9}{_fmt(r['paper_params'], 1e6):>9}{_fmt(r['paper_gflops']):>9}"
              f"{_fmt(r['paper_top1'], digits=1):>7}  {counted}")
    print("\nGFLOPs per image at the variant's paper resolution, counted as its paper counts them: multiply-adds of\n"
          "all ops ('all') or of convolutions and linear layers only ('conv_linear', SoT); '2/MAC': the paper\n"
          "prints 2 FLOPs per multiply-add (EIT Table 6). See models/measure.py.")
    return 0


def _show(args: argparse.Namespace) -> int:
    import timm

    from models import VARIANTS
    from models.measure import build_on_meta, count_params, params_by_module
    from pipeline.config.loading import parse_override

    if not timm.is_model(args.name):
        raise InvalidInputError(f"{args.name!r} is not a registered model (see `vitsweep models list`)")
    overrides = {}
    for assignment in args.overrides:
        key, value = parse_override(assignment)
        overrides[key] = value
    try:
        model = build_on_meta(args.name, **overrides)
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"{args.name} with {overrides}: {err}") from None
    total = count_params(model)
    facts = VARIANTS.get(args.name)
    print(f"{args.name} {overrides or ''}".rstrip())
    if facts:
        print(f"  paper {facts.paper} ({facts.row}): reported params {_fmt(facts.params, 1e6)}M, "
              f"top-1 {_fmt(facts.top1, digits=1)}")
    for module, count in params_by_module(model, args.depth):
        print(f"  {module:<40}{count:>12,}  {100 * count / total:5.1f}%")
    print(f"  {'total':<40}{total:>12,}")
    return 0
