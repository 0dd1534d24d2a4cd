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

import difflib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from pipeline.config.loading import (describe_error, get_dotted, load_yaml, read_utf8, schema_problem, with_dotted,
    yaml_number)
from pipeline.uris import location_problem
from pipeline.errors import InvalidInputError

SPACE_DIR = Path(__file__).resolve().parents[2] / "tune_spaces"
DISTRIBUTIONS = ("values", "uniform", "loguniform", "randint")
# The same for every trial of a sweep: its settings, where runs go, per-trial resources, the data.
UNSEARCHABLE = ("tune", "tracking", "scaling", "run.name", "run.storage_path",
                "data.train", "data.val", "data.prepare", "data.cache_dir")
MAX_RANDINT_GRID = 64


class SpaceError(InvalidInputError):
    """A search space is malformed or names something the config does not have."""


def short_key(key: str) -> str:
    """A knob's short name: ``model.args.code_size`` -> ``code_size``; ``model.args.mha_ratio_range.0`` ->
    ``mha_ratio_range.0``."""
    parts = key.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def short_keys(keys) -> dict[str, str]:
    """Each key's short name, longer where two would read the same (``optim.lr`` and ``model.args.lr``
    -> ``optim.lr``, ``args.lr``)."""
    names = {key: short_key(key) for key in keys}
    while len(set(names.values())) < len(names):
        clashing = {name for name in names.values() if list(names.values()).count(name) > 1}
        grown = False
        for key, name in names.items():
            parts = key.split(".")
            if name in clashing and len(name.split(".")) < len(parts):
                names[key] = ".".join(parts[-len(name.split(".")) - 1:])
                grown = True
        if not grown:
            break
    return names


def log10_param(name: str) -> str:
    """The param a trial logs beside a log-uniform knob ``name``: its value's log10 (``log10_lr``). MLflow
    3.17's scatter and parallel-coordinates charts have no log axis; the sweep's charts plot this one."""
    return f"log10_{name}"


def check_key(key: str, where: str) -> None:
    """Raise SpaceError unless ``key`` names a field of the experiment config (or a model argument)."""
    problem = schema_problem(key)
    if problem:
        raise SpaceError(f"{where}: {problem}")


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
        return all(same_value(lookup(key), allowed) for key, allowed in self.when)

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
        from ray import tune  # here: every `vitsweep` command loads the shipped spaces' names, not Ray

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


def same_value(actual: Any, allowed: tuple[Any, ...]) -> bool:
    normal = (lambda v: list(v) if isinstance(v, tuple) else v)  # noqa: E731  (YAML lists vs config tuples)
    return normal(actual) in [normal(a) for a in allowed]


# --------------------------------------------------------------------------------------------------
# The space file's schema
# --------------------------------------------------------------------------------------------------

class _SpaceSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _checked_when(when: dict[str, Any] | None) -> dict[str, Any] | None:
    if when is None:
        return None
    if not when:
        raise ValueError("when must map config keys to a value or a list of values")
    for key in when:
        problem = schema_problem(str(key))
        if problem:
            raise ValueError(problem)
    return when


class ValuesSpec(_SpaceSection):
    """A choice among ``values`` (a grid search takes all of them)."""

    values: list[Any]
    grid: None = None  # only ranges have grid points; here it is an error saying so
    when: dict[str, Any] | None = None

    @field_validator("values")
    @classmethod
    def _at_least_one(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("give at least one value")
        return values

    @field_validator("grid", mode="before")
    @classmethod
    def _no_grid(cls, grid: Any) -> None:
        raise ValueError("grid applies to ranges; values are all taken by a grid search")

    _when = field_validator("when")(_checked_when)


class _RangeSpec(_SpaceSection):
    """A closed range ``[low, high]``; ``grid`` lists the points a grid search takes."""

    grid: list[float] | None = None
    when: dict[str, Any] | None = None

    _when = field_validator("when")(_checked_when)

    @property
    def kind(self) -> str:
        return next(k for k in DISTRIBUTIONS if k in type(self).model_fields)

    @property
    def bounds(self) -> tuple[float, float]:
        return getattr(self, self.kind)

    @field_validator("uniform", "loguniform", "randint", mode="before", check_fields=False)
    @classmethod
    def _two_numbers(cls, bounds: Any) -> Any:
        if not (isinstance(bounds, list) and len(bounds) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)):
            raise ValueError("must be [low, high] numbers")
        return bounds

    @field_validator("grid", mode="before")
    @classmethod
    def _grid_of_numbers(cls, grid: Any) -> Any:
        if not isinstance(grid, list) or not grid:
            raise ValueError("grid must be a non-empty list of points in the range")
        return grid

    @model_validator(mode="after")
    def _ordered_and_grid_inside(self) -> _RangeSpec:
        (low, high), kind = self.bounds, self.kind
        if not low < high:
            raise ValueError(f"{kind} [{low}, {high}] needs low < high")
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"loguniform [{low}, {high}] needs low > 0")
        outside = [g for g in self.grid or () if not low <= g <= high]
        if outside:
            raise ValueError(f"grid points {outside} lie outside {kind} [{low}, {high}]")
        return self


class UniformSpec(_RangeSpec):
    uniform: tuple[float, float]


class LogUniformSpec(_RangeSpec):
    loguniform: tuple[float, float]


class RandintSpec(_RangeSpec):
    randint: tuple[int, int]


def _distribution_of(spec: Any) -> str | None:
    kinds = [k for k in DISTRIBUTIONS if k in spec] if isinstance(spec, dict) else []
    return kinds[0] if len(kinds) == 1 else None


DistributionSpec = Annotated[
    Union[Annotated[ValuesSpec, Tag("values")], Annotated[UniformSpec, Tag("uniform")],
          Annotated[LogUniformSpec, Tag("loguniform")], Annotated[RandintSpec, Tag("randint")]],
    Discriminator(_distribution_of, custom_error_type="distribution",
                  custom_error_message=f"give exactly one distribution of {', '.join(DISTRIBUTIONS)}, e.g. "
                                       "{values: [...]} or {uniform: [low, high]}"),
]


class MgcrpSquareOptions(_SpaceSection):
    rounding: Literal["nearest", "up_even"] = "nearest"


class DeriveSpec(_SpaceSection):
    """Named rules filling keys from others, after sampling (see DERIVATIONS)."""

    mgcrp_square: MgcrpSquareOptions | None = None


class SpaceFile(_SpaceSection):
    """A space file as written (``tune_spaces/*.yaml``)."""

    description: str = ""
    fixed: dict[str, Any] = Field(default_factory=dict)  # dotted overrides every trial shares
    params: dict[str, DistributionSpec]  # the searched knobs: dotted key -> one distribution
    derive: DeriveSpec = Field(default_factory=DeriveSpec)

    @field_validator("fixed", "derive", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("params")
    @classmethod
    def _at_least_one_knob(cls, params: dict[str, Any]) -> dict[str, Any]:
        if not params:
            raise ValueError("params must map at least one dotted config key to a distribution")
        return params


def _space_error(err: ValidationError, where: str) -> SpaceError:
    lines = []
    for error in err.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        model: type[BaseModel] = SpaceFile
        if loc[:1] == ["params"] and len(loc) > 2:
            # loc[2] is the distribution's tag: its spec lists the valid keys; the knob's key names it
            model = {"values": ValuesSpec, "uniform": UniformSpec, "loguniform": LogUniformSpec,
                     "randint": RandintSpec}[loc.pop(2)]
        elif loc[:1] == ["derive"]:
            model = DeriveSpec if len(loc) == 2 else MgcrpSquareOptions
        lines.append(describe_error(error, ".".join(loc) or "<space>", list(model.model_fields)))
    return SpaceError(f"{where}: " + "; ".join(lines))


def _dimension(key: str, spec: ValuesSpec | _RangeSpec) -> Dimension:
    when = tuple((str(k), tuple(v if isinstance(v, list) else [v])) for k, v in (spec.when or {}).items())
    if isinstance(spec, ValuesSpec):
        return Dimension(key, "values", values=tuple(tuple(v) if isinstance(v, list) else v for v in spec.values),
                         when=when)
    low, high = spec.bounds
    return Dimension(key, spec.kind, low=low, high=high, grid=tuple(spec.grid or ()), when=when)


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


DERIVATIONS = {"mgcrp_square": _mgcrp_square}
DERIVED_KEYS = {"mgcrp_square": ("model.args.mgcrp_m", "model.args.mgcrp_n", "model.args.repr_size")}
TARGET_KEYS = {"mgcrp_square": ("model.args.repr_size",)}  # read as the target, then set to the size reached


@dataclass(frozen=True)
class Derivation:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def __call__(self, tree: dict[str, Any]) -> dict[str, Any]:
        return DERIVATIONS[self.name](tree, **dict(self.options))

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys the rule fills."""
        return DERIVED_KEYS[self.name]

    @property
    def replaced_keys(self) -> tuple[str, ...]:
        """The keys it fills without reading them first: a value given for one is lost."""
        return tuple(key for key in self.keys if key not in TARGET_KEYS.get(self.name, ()))


def _derivations(derive: DeriveSpec) -> tuple[Derivation, ...]:
    return tuple(Derivation(name, tuple(sorted(options.model_dump().items())))
                 for name, options in derive if options is not None)


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
            values.update(rule(with_dotted(tree, values)))
        return values


def available_spaces() -> list[str]:
    return sorted(p.stem for p in SPACE_DIR.glob("*.yaml"))


def space_path(ref: str) -> Path:
    """A shipped space's name (``fsne_code_size``) or a path to a YAML file."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        problem = location_problem(path, kind="file")
        if problem:
            raise SpaceError(f"search space file: {problem}")
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
        tree = load_yaml(text) or {}
    except yaml.YAMLError as err:
        raise SpaceError(f"{where} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise SpaceError(f"{where} must hold a mapping (description, fixed, params, derive)")
    try:
        space = SpaceFile.model_validate(yaml_number(tree))
    except ValidationError as err:
        raise _space_error(err, where) from None
    for key in space.fixed:
        check_key(str(key), f"{where}: fixed")
    dims = []
    for key, spec in space.params.items():
        check_key(key, f"{where}: params")
        blocked = next((p for p in UNSEARCHABLE if key == p or key.startswith(p + ".")), None)
        if blocked:
            raise SpaceError(f"{where}: params.{key} cannot be searched: {blocked} is the same for every trial of "
                             "a sweep (set it with --set or in fixed)")
        if key in space.fixed:
            raise SpaceError(f"{where}: {key} is both fixed and searched; keep one")
        dims.append(_dimension(key, spec))
    _check_condition_order(dims, where)
    return SearchSpace(name=name, description=space.description.strip(), fixed=dict(space.fixed), dims=tuple(dims),
                       derive=_derivations(space.derive), parts=((name, where, text),))


def _check_condition_order(dims: list[Dimension], where: str) -> None:
    seen = set()
    searched = {d.key for d in dims}
    for dim in dims:
        for key, _ in dim.when:
            if key == dim.key:
                raise SpaceError(f"{where}: params.{dim.key} cannot depend on itself (when)")
            if key in searched and key not in seen:
                raise SpaceError(f"{where}: params.{dim.key} depends on {key} (when), which must come before it "
                                 "(earlier in its file, or in an earlier --space)")
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
    _check_condition_order(dims, " + ".join(source for space in spaces for source in space.sources))
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
