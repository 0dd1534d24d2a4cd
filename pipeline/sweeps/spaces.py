"""Search spaces: declarative YAML over dotted config keys, checked against the config schema.

A space file (``tune_spaces/*.yaml``)::

    description: F-SNE code size c, plain and param-matched (paper 000 §6.5, Fig. 6)
    fixed:                                   # dotted overrides every trial shares
      model.args.qkv: fsne
    params:                                  # the searched knobs: dotted key -> one distribution
      model.args.code_size: {values: [8, 16, 32, 64]}
      optim.lr: {loguniform: [1.0e-4, 3.0e-3], grid: [2.5e-4, 5.0e-4, 1.0e-3]}
      model.args.mha_ratio_range.0: {uniform: [0.0, 1.0], grid: [0.25, 1.0],
                                     when: {model.args.channel_schedule: linear}}
    derive:                                  # named rules filling keys from others
      mgcrp_square: {rounding: up_even}

Distributions: ``values`` (a choice), ``uniform`` / ``loguniform`` ``[low, high]`` (closed ranges;
``grid`` lists the points a grid search takes) and ``randint`` ``[low, high]`` (inclusive). A key
ending in ``.N`` sets element N of a list-valued argument. ``when`` makes a knob apply only to
trials whose config holds that value (or one of a list of values) at another key.

Keys are checked here, before anything runs: each must be a field of the experiment config
(``model.args.*`` are the model's constructor arguments, checked by building it, see
``planning``). Sweep-level settings (``tune``, ``tracking``, ``scaling``, a run's name and storage,
the dataset files) are the same for every trial and cannot be searched.
"""
from __future__ import annotations

import copy
import difflib
import math
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from pipeline.config import ExperimentConfig, read_utf8
from pipeline.errors import InvalidInputError

SPACE_DIR = Path(__file__).resolve().parents[2] / "tune_spaces"
DISTRIBUTIONS = ("values", "uniform", "loguniform", "randint")
# The same for every trial of a sweep: its settings, where runs go, per-trial resources, the data.
UNSEARCHABLE = ("tune", "tracking", "scaling", "run.name", "run.storage_path",
                "data.train", "data.val", "data.prepare", "data.cache_dir")
MAX_RANDINT_GRID = 64
_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class SpaceError(InvalidInputError):
    """A search space is malformed or names something the config does not have."""


def _number(value: Any) -> Any:
    # YAML 1.1 reads 1e-3 (no dot) as a string; a learning rate should be a number.
    if isinstance(value, str) and _SCIENTIFIC.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _number(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------------------
# Dotted keys against the schema
# --------------------------------------------------------------------------------------------------

def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def check_key(key: str, where: str) -> None:
    """Raise SpaceError unless ``key`` names a field of the experiment config (or a model argument)."""
    parts = key.split(".")
    if any(not part for part in parts):
        raise SpaceError(f"{where}: {key!r} has an empty part; keys look like optim.lr or model.args.code_size")
    section: type[BaseModel] = ExperimentConfig
    for depth, part in enumerate(parts):
        fields = section.model_fields
        if part not in fields:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {'.'.join([*parts[:depth], close[0]])!r}?)" if close else ""
            raise SpaceError(
                f"{where}: {key!r} is not a config key{hint}; valid keys under {prefix or 'the config'}: "
                f"{', '.join(fields)}"
            )
        annotation = fields[part].annotation
        if _is_section(annotation):
            section = annotation
            continue
        rest = parts[depth + 1:]
        if typing.get_origin(annotation) is dict:  # model.args: the model's constructor arguments
            if not rest or not rest[0].isidentifier() or not all(p.isdigit() for p in rest[1:]):
                raise SpaceError(
                    f"{where}: {key!r} must name one argument under {'.'.join(parts[:depth + 1])}, "
                    f"e.g. {'.'.join(parts[:depth + 1])}.code_size (a trailing .N sets list element N)"
                )
            return
        if rest and not (len(rest) == 1 and rest[0].isdigit() and typing.get_origin(annotation) in (tuple, list)):
            raise SpaceError(f"{where}: {key!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        return
    raise SpaceError(f"{where}: {key!r} is a whole section; name one of its keys: "
                     f"{', '.join(f'{key}.{name}' for name in section.model_fields)}")


def get_dotted(tree: dict[str, Any], key: str, default: Any = None) -> Any:
    node: Any = tree
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in a config tree, creating sections on the way."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def apply_assignment(tree: dict[str, Any], assignment: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` with each dotted key of ``assignment`` set (``key.N``: list element N)."""
    tree = copy.deepcopy(tree)
    for key, value in assignment.items():
        head, _, tail = key.rpartition(".")
        if tail.isdigit():
            current = get_dotted(tree, head)
            elements = list(current) if isinstance(current, (list, tuple)) else []
            index = int(tail)
            elements += [None] * (index + 1 - len(elements))
            elements[index] = value
            set_dotted(tree, head, elements)
        else:
            set_dotted(tree, key, value)
    return tree


# --------------------------------------------------------------------------------------------------
# Dimensions
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dimension:
    """One searched knob: a dotted key and its distribution."""

    key: str
    kind: str  # one of DISTRIBUTIONS
    values: tuple[Any, ...] = ()  # kind == "values": the choices
    low: float | None = None
    high: float | None = None
    grid: tuple[Any, ...] = ()  # points a grid search takes (values: all of them)
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (key, allowed values): all must hold

    def active(self, lookup) -> bool:
        """Whether this knob applies, given ``lookup(key)`` of the trial's config so far."""
        return all(_same_value(lookup(key), allowed) for key, allowed in self.when)

    def grid_points(self) -> tuple[Any, ...]:
        if self.kind == "values":
            return self.values
        if self.grid:
            return self.grid
        if self.kind == "randint" and self.high - self.low < MAX_RANDINT_GRID:
            return tuple(range(int(self.low), int(self.high) + 1))
        raise SpaceError(
            f"{self.key} is a {self.kind} range [{self.low}, {self.high}]; a grid search needs its points: add "
            f"grid: [...] to it, or use tune.searcher=random or tpe"
        )

    def check_points(self) -> tuple[Any, ...]:
        """The values checked before a sweep: every grid point and both ends of a range."""
        if self.kind == "values":
            return self.values
        ends = (int(self.low), int(self.high)) if self.kind == "randint" else (self.low, self.high)
        return tuple(dict.fromkeys([*self.grid, *ends]))

    def sample(self, rng) -> Any:
        if self.kind == "values":
            return self.values[rng.randrange(len(self.values))]
        if self.kind == "randint":
            return rng.randint(int(self.low), int(self.high))
        if self.kind == "uniform":
            return float(f"{rng.uniform(self.low, self.high):.4g}")
        return float(f"{math.exp(rng.uniform(math.log(self.low), math.log(self.high))):.4g}")

    def tune_domain(self):
        """The Ray Tune distribution (model-based searchers sample from it)."""
        from ray import tune

        if self.kind == "values":
            return tune.choice(list(self.values))
        if self.kind == "randint":
            return tune.randint(int(self.low), int(self.high) + 1)  # Tune's upper bound is exclusive
        return tune.uniform(self.low, self.high) if self.kind == "uniform" else tune.loguniform(self.low, self.high)

    def describe(self, value: Any) -> str:
        """``value`` with where it came from, for error messages."""
        if self.kind != "values" and value not in self.grid:
            end = "lower" if value == self.low else "upper"
            return f"{value!r} ({end} end of {self.kind} [{self.low}, {self.high}])"
        return repr(value)

    @property
    def is_log(self) -> bool:
        return self.kind == "loguniform"


def _same_value(actual: Any, allowed: tuple[Any, ...]) -> bool:
    normal = (lambda v: list(v) if isinstance(v, tuple) else v)  # noqa: E731  (YAML lists vs config tuples)
    return normal(actual) in [normal(a) for a in allowed]


def _parse_dimension(key: str, spec: Any, where: str) -> Dimension:
    where = f"{where}: params.{key}"
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: must be a mapping like {{values: [...]}} or {{uniform: [low, high]}}, got {spec!r}")
    spec = _number(spec)
    kinds = [k for k in DISTRIBUTIONS if k in spec]
    unknown = set(spec) - {*DISTRIBUTIONS, "grid", "when"}
    if unknown:
        raise SpaceError(f"{where}: unknown field(s) {sorted(unknown)}; valid: {', '.join(DISTRIBUTIONS)}, grid, when")
    if len(kinds) != 1:
        raise SpaceError(f"{where}: give exactly one distribution of {', '.join(DISTRIBUTIONS)}, got {kinds or 'none'}")
    kind = kinds[0]
    when = _parse_when(spec.get("when"), where)
    if kind == "values":
        values = spec["values"]
        if not isinstance(values, list):
            raise SpaceError(f"{where}: values must be a list, got {values!r}")
        if not values:
            raise SpaceError(f"{where}: values is an empty list; give at least one value")
        if "grid" in spec:
            raise SpaceError(f"{where}: grid applies to ranges; values are all taken by a grid search")
        return Dimension(key, kind, values=tuple(_hashable(v) for v in values), when=when)
    bounds = spec[kind]
    if not (isinstance(bounds, list) and len(bounds) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)):
        raise SpaceError(f"{where}: {kind} must be [low, high] numbers, got {bounds!r}")
    low, high = bounds
    if not low < high:
        raise SpaceError(f"{where}: {kind} [{low}, {high}] needs low < high")
    if kind == "loguniform" and low <= 0:
        raise SpaceError(f"{where}: loguniform [{low}, {high}] needs low > 0")
    if kind == "randint" and not all(float(b).is_integer() for b in bounds):
        raise SpaceError(f"{where}: randint [{low}, {high}] needs integer bounds")
    grid = spec.get("grid", [])
    if not isinstance(grid, list) or ("grid" in spec and not grid):
        raise SpaceError(f"{where}: grid must be a non-empty list of points in [{low}, {high}], got {grid!r}")
    outside = [g for g in grid if isinstance(g, bool) or not isinstance(g, (int, float)) or not low <= g <= high]
    if outside:
        raise SpaceError(f"{where}: grid points {outside} lie outside {kind} [{low}, {high}]")
    return Dimension(key, kind, low=low, high=high, grid=tuple(grid), when=when)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _parse_when(spec: Any, where: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    if spec is None:
        return ()
    if not isinstance(spec, dict) or not spec:
        raise SpaceError(f"{where}: when must map config keys to a value or a list of values, got {spec!r}")
    conditions = []
    for key, allowed in spec.items():
        check_key(str(key), f"{where}.when")
        allowed = allowed if isinstance(allowed, list) else [allowed]
        conditions.append((str(key), tuple(allowed)))
    return tuple(conditions)


# --------------------------------------------------------------------------------------------------
# Derivations: keys filled from others, after sampling
# --------------------------------------------------------------------------------------------------

def _mgcrp_square(tree: dict[str, Any], rounding: str = "nearest") -> dict[str, Any]:
    """m = n of MGCrP from model.args.repr_size and mgcrp_heads (paper 004 §4.2 sets m = n).

    ``nearest``: the m whose h·m² is closest to repr_size; ``up_even``: the smallest even m with
    h·m² >= repr_size, which gives Table 4a's (32, 24, 16, 14, 12) for h = 1, 2, 4, 6, 8 at ~1K.
    Sets mgcrp_m, mgcrp_n and repr_size = h·m·n (the size the trial really has).
    """
    args = tree.get("model", {}).get("args", {})
    target = args.get("repr_size")
    heads = args.get("mgcrp_heads", 6)  # SoTHead's default (paper 004 Table 4a)
    if not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0:
        raise ValueError(f"derive mgcrp_square needs model.args.repr_size > 0 (the target h·m·n), got {target!r}")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"derive mgcrp_square needs model.args.mgcrp_heads >= 1, got {heads!r}")
    exact = math.sqrt(target / heads)
    if rounding == "up_even":
        side = math.ceil(exact - 1e-9)
        side += side % 2
    else:
        side = min((math.floor(exact), math.ceil(exact)), key=lambda s: (abs(heads * s * s - target), s))
    side = max(side, 1)
    return {"model.args.mgcrp_m": side, "model.args.mgcrp_n": side, "model.args.repr_size": heads * side * side}


DERIVATIONS = {"mgcrp_square": (_mgcrp_square, {"rounding": ("nearest", "up_even")})}


@dataclass(frozen=True)
class Derivation:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __call__(self, tree: dict[str, Any]) -> dict[str, Any]:
        rule, _ = DERIVATIONS[self.name]
        return rule(tree, **dict(self.options))


def _parse_derive(spec: Any, where: str) -> tuple[Derivation, ...]:
    if spec is None:
        return ()
    if not isinstance(spec, dict):
        raise SpaceError(f"{where}: derive must map rule names to options, got {spec!r}")
    rules = []
    for name, options in spec.items():
        if name not in DERIVATIONS:
            raise SpaceError(f"{where}: derive rule {name!r} is unknown; valid: {', '.join(DERIVATIONS)}")
        options = options or {}
        allowed = DERIVATIONS[name][1]
        for option, value in options.items():
            if option not in allowed:
                raise SpaceError(f"{where}: derive.{name}.{option} is unknown; valid: {', '.join(allowed)}")
            if value not in allowed[option]:
                raise SpaceError(f"{where}: derive.{name}.{option}={value!r}; valid: {', '.join(allowed[option])}")
        rules.append(Derivation(name, tuple(sorted(options.items()))))
    return tuple(rules)


# --------------------------------------------------------------------------------------------------
# Spaces
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SearchSpace:
    name: str  # file stem(s), joined by '+' when combined
    description: str
    fixed: dict[str, Any]
    dims: tuple[Dimension, ...]
    derive: tuple[Derivation, ...] = ()
    parts: tuple[tuple[str, str, str], ...] = ()  # (name, source, YAML text) of each space file combined

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(d.key for d in self.dims)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(source for _, source, _ in self.parts)

    @property
    def text(self) -> str:
        return "\n---\n".join(f"# {source}\n{text}" for _, source, text in self.parts)

    def active_assignment(self, sampled: dict[str, Any], base_tree: dict[str, Any]) -> dict[str, Any]:
        """The sampled values of the knobs that apply (``when``), in the space's order."""
        assignment: dict[str, Any] = {}
        for dim in self.dims:
            if dim.active(lambda key: assignment[key] if key in assignment else get_dotted(base_tree, key)):
                assignment[dim.key] = sampled[dim.key]
        return assignment

    def combinations(self, base_tree: dict[str, Any], points) -> Iterator[dict[str, Any]]:
        """Every assignment taking ``points(dim)`` for each knob that applies."""

        def extend(index: int, assignment: dict[str, Any]) -> Iterator[dict[str, Any]]:
            if index == len(self.dims):
                yield dict(assignment)
                return
            dim = self.dims[index]
            if not dim.active(lambda key: assignment[key] if key in assignment else get_dotted(base_tree, key)):
                yield from extend(index + 1, assignment)
                return
            for value in points(dim):
                assignment[dim.key] = value
                yield from extend(index + 1, assignment)
            del assignment[dim.key]

        return extend(0, {})

    def sample(self, base_tree: dict[str, Any], rng) -> dict[str, Any]:
        assignment: dict[str, Any] = {}
        for dim in self.dims:
            if dim.active(lambda key: assignment[key] if key in assignment else get_dotted(base_tree, key)):
                assignment[dim.key] = dim.sample(rng)
        return assignment

    def derived(self, tree: dict[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for rule in self.derive:
            values.update(rule(apply_assignment(tree, values)))
        return values


def available_spaces() -> list[str]:
    return sorted(p.stem for p in SPACE_DIR.glob("*.yaml"))


def space_path(ref: str) -> Path:
    """A shipped space's name (``fsne_code_size``) or a path to a YAML file."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise SpaceError(f"search space file {ref!r} does not exist (shipped spaces: {', '.join(available_spaces())})")
        return path
    if ref not in available_spaces():
        close = difflib.get_close_matches(ref, available_spaces(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpaceError(f"search space {ref!r} is neither a shipped space{hint} ({', '.join(available_spaces())}) "
                         "nor a .yaml file")
    return SPACE_DIR / f"{ref}.yaml"


def parse_space(text: str, name: str, where: str) -> SearchSpace:
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise SpaceError(f"{where} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise SpaceError(f"{where} must hold a mapping (description, fixed, params, derive)")
    unknown = set(tree) - {"description", "fixed", "params", "derive"}
    if unknown:
        raise SpaceError(f"{where}: unknown section(s) {sorted(unknown)}; valid: description, fixed, params, derive")
    params = tree.get("params")
    if not isinstance(params, dict) or not params:
        raise SpaceError(f"{where}: params must map at least one dotted config key to a distribution")
    fixed = tree.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise SpaceError(f"{where}: fixed must map dotted config keys to values, got {fixed!r}")
    for key in fixed:
        check_key(str(key), f"{where}: fixed")
    dims = []
    for key, spec in params.items():
        key = str(key)
        check_key(key, f"{where}: params")
        blocked = next((p for p in UNSEARCHABLE if key == p or key.startswith(p + ".")), None)
        if blocked:
            raise SpaceError(f"{where}: params.{key} cannot be searched: {blocked} is the same for every trial of "
                             "a sweep (set it with --set or in fixed)")
        if key in fixed:
            raise SpaceError(f"{where}: {key} is both fixed and searched; keep one")
        dims.append(_parse_dimension(key, spec, where))
    _check_conditions(dims, where)
    return SearchSpace(
        name=name, description=str(tree.get("description", "")).strip(), fixed=_number(dict(fixed)),
        dims=tuple(dims), derive=_parse_derive(tree.get("derive"), where), parts=((name, where, text),),
    )


def _check_conditions(dims: list[Dimension], where: str) -> None:
    seen = set()
    searched = {d.key for d in dims}
    for dim in dims:
        for key, _ in dim.when:
            if key == dim.key:
                raise SpaceError(f"{where}: params.{dim.key} cannot depend on itself (when)")
            if key in searched and key not in seen:
                raise SpaceError(f"{where}: params.{dim.key} depends on {key} (when), which must come before it")
        seen.add(dim.key)


def load_space(ref: str) -> SearchSpace:
    path = space_path(ref)
    return parse_space(read_utf8(path, "search space file"), path.stem, str(path))


def combine(spaces: list[SearchSpace]) -> SearchSpace:
    """Several spaces searched together (e.g. a paper study + lr/weight decay); keys must not clash."""
    if len(spaces) == 1:
        return spaces[0]
    fixed: dict[str, Any] = {}
    dims: list[Dimension] = []
    derive: list[Derivation] = []
    owner: dict[str, str] = {}
    for space in spaces:
        for key, value in space.fixed.items():
            if key in fixed and fixed[key] != value:
                raise SpaceError(f"{space.sources[0]} fixes {key}={value!r} but {owner[key]} fixes {key}={fixed[key]!r}")
            fixed[key], owner[key] = value, space.sources[0]
        for dim in space.dims:
            if dim.key in owner:
                raise SpaceError(f"{dim.key} is set by both {owner[dim.key]} and {space.sources[0]}; keep it in one")
            dims.append(dim)
            owner[dim.key] = space.sources[0]
        derive += [rule for rule in space.derive if rule not in derive]
    clash = set(fixed) & {d.key for d in dims}
    if clash:
        key = sorted(clash)[0]
        raise SpaceError(f"{key} is fixed in one space and searched in another ({owner[key]})")
    return SearchSpace(
        name="+".join(s.name for s in spaces), description=" + ".join(s.description for s in spaces if s.description),
        fixed=fixed, dims=tuple(dims), derive=tuple(derive), parts=tuple(p for s in spaces for p in s.parts),
    )


def load_spaces(refs: list[str]) -> SearchSpace:
    if not refs:
        raise SpaceError(f"give a search space with --space (shipped: {', '.join(available_spaces())})")
    return combine([load_space(ref) for ref in refs])


def spaces_from_record(texts: list[tuple[str, str, str]]) -> SearchSpace:
    """Rebuild a sweep's space from its record: (name, source, YAML text) per space."""
    return combine([parse_space(text, name, source) for name, source, text in texts])
