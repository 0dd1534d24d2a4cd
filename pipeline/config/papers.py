"""The papers' training recipes, every value cited, and where a config departs from one.

``pipeline/config/papers/NNN_<name>.yaml`` holds one paper's ImageNet-1k setup:

- ``recipe``: dotted config keys, each with its ``value`` and ``from`` -- the section or table that
  prints it or, where the paper is silent, the authors' released code, named as such. The batch and
  the rate are given as a run derives them (``optim.global_batch_size``, ``optim.lr_effective``): the
  global batch the paper trains at and its peak rate, whatever the split of the batch over GPUs.
- ``rows``: the table rows it trains, each with its own cited keys over the recipe's (its model, its
  stochastic depth, its batch, its epochs).
- ``setup``: what is not the paper's to say, as dotted keys -- where the data is, and a split of the
  global batch over GPUs (a row with another batch has its own ``setup`` over the paper's).

``--config paper:NNN[:ROW]`` trains a row (``pipeline.config.loading.paper_tree``); ``departures``
lists where a config leaves it (`vitsweep config diff --against paper:NNN[:ROW]`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.schema import EFFECTIVE_LR_PARAM, GLOBAL_BATCH_PARAM
from pipeline.errors import ConfigError

PAPER_DIR = Path(__file__).parent / "papers"
SPEC_PREFIX = "paper:"
# A model constructor argument no row cites is the model's own default: a config that sets one departs.
MODEL_ARGS_PREFIX = "model.args."
# The keys a config's flat values hold beside its own, derived from them (pipeline.components.lr_scaling).
DERIVED_KEYS = (GLOBAL_BATCH_PARAM, EFFECTIVE_LR_PARAM)


@dataclass(frozen=True)
class Cited:
    """A recipe value and where it is printed."""

    value: Any
    source: str


@dataclass(frozen=True)
class PaperRow:
    """One row of a paper's table: its label there and the keys it sets over the paper's recipe."""

    name: str
    table: str
    recipe: dict[str, Cited]
    setup: dict[str, Any]


@dataclass(frozen=True)
class PaperRecipe:
    paper: str  # its id in README "Papers", e.g. "003"
    title: str
    setup: dict[str, Any]  # dotted keys
    recipe: dict[str, Cited]
    rows: dict[str, PaperRow]

    def row(self, name: str) -> PaperRow:
        if name not in self.rows:
            raise ConfigError(f"paper {self.paper} ({self.title}) has no row {name!r}; its rows: "
                              f"{', '.join(self.rows)}")
        return self.rows[name]

    def values(self, row: PaperRow) -> dict[str, Cited]:
        """Every key the row trains with, cited: the row's own first (its model), then the recipe's."""
        return {**row.recipe, **{key: cited for key, cited in self.recipe.items() if key not in row.recipe}}

    def row_of(self, flat: dict[str, Any]) -> PaperRow:
        """The row a config's flat values train: of the rows with its model (with a teacher where the config
        has one: a distilled row), the one it departs from least, the first of those; with no row of its
        model, the paper's first row."""
        models = [row for row in self.rows.values() if self.values(row)["model.name"].value == flat.get("model.name")]
        taught = [row for row in models
                  if (self.values(row).get("distill.teacher", Cited(None, "")).value is None)
                  == (_teacher(flat) is None)]
        return min(taught or models or list(self.rows.values())[:1], key=lambda row: len(departures(flat, self, row)))

    def describe(self, row: PaperRow) -> str:
        return f"paper {self.paper} ({self.title}), row {row.name}: {row.table}"


def _cited(entries: dict[str, Any], where: str) -> dict[str, Cited]:
    cited = {}
    for key, entry in entries.items():
        if not isinstance(entry, dict) or set(entry) != {"value", "from"}:
            raise ValueError(f"{where}: {key} must hold `value` and `from` (where the paper prints it)")
        cited[key] = Cited(entry["value"], " ".join(str(entry["from"]).split()))
    return cited


def _read(path: Path, tree: dict[str, Any], read: dict[str, PaperRecipe]) -> PaperRecipe:
    rows = {name: PaperRow(name, row["table"], _cited(row.get("recipe", {}), f"{path.name} row {name}"),
                           row.get("setup", {}))
            for name, row in tree["rows"].items()}
    setup, recipe = tree.get("setup", {}), _cited(tree["recipe"], path.name)
    if "inherits" in tree:  # "other experimental setups of the original XCiT": that paper's recipe, said so
        base = read[str(tree["inherits"])]
        inherited = {key: Cited(cited.value, f"paper {base.paper} ({base.title}): {cited.source}")
                     for key, cited in base.recipe.items()}
        setup, recipe = {**base.setup, **setup}, {**inherited, **recipe}
    return PaperRecipe(str(tree["paper"]), tree["title"], setup, recipe, rows)


@functools.cache
def paper_recipes() -> dict[str, PaperRecipe]:
    """Every shipped paper's recipe, by its id (a paper that inherits another's read after it)."""
    trees = {path: yaml.safe_load(path.read_text()) for path in sorted(PAPER_DIR.glob("*.yaml"))}
    read: dict[str, PaperRecipe] = {}
    for path, tree in sorted(trees.items(), key=lambda item: "inherits" in item[1]):
        recipe = _read(path, tree, read)
        read[recipe.paper] = recipe
    return dict(sorted(read.items()))


def is_paper_spec(source: str) -> bool:
    return source.startswith(SPEC_PREFIX)


def resolve(spec: str) -> tuple[PaperRecipe, str | None]:
    """``paper:NNN[:ROW]`` as the paper's recipe and the row it names (None: not named); a ConfigError
    listing the papers or the rows where it names none of them."""
    paper, _, row = spec.removeprefix(SPEC_PREFIX).partition(":")
    recipes = paper_recipes()
    if paper not in recipes:
        shipped = ", ".join(f"paper:{key} ({recipe.title})" for key, recipe in recipes.items())
        raise ConfigError(f"{spec!r} names no shipped paper recipe; they are {shipped}, each optionally "
                          "with :ROW (`vitsweep config diff --against paper:NNN` lists the rows)")
    if row:
        recipes[paper].row(row)
    return recipes[paper], row or None


@dataclass(frozen=True)
class Departure:
    key: str
    paper: Any  # None under model.args: the paper's model takes its own default
    config: Any  # None: the config has no such key
    source: str


def same(paper: Any, config: Any) -> bool:
    """Whether a config value is the paper's: numbers to a relative 1e-9 (a rate computed from a batch),
    sequences element by element, anything else exactly."""
    if isinstance(paper, (list, tuple)) and isinstance(config, (list, tuple)):
        return len(paper) == len(config) and all(same(p, c) for p, c in zip(paper, config))
    if isinstance(paper, bool) or isinstance(config, bool):  # true is no 1
        return paper is config
    numbers = all(isinstance(v, (int, float)) for v in (paper, config))
    return math.isclose(paper, config, rel_tol=1e-9) if numbers else paper == config


def shown(value: Any) -> str:
    """A value as a config file writes it: null, true, numbers without float noise, lists in brackets."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(shown(item) for item in value) + "]"
    return str(value)


def closest_row(flat: dict[str, Any], ignored: set[str]) -> tuple[PaperRecipe, PaperRow, list[Departure]]:
    """The shipped paper row a config's flat values depart from least in the keys not ``ignored`` (the first
    such in paper and row order), with those departures."""
    candidates = [(recipe, row, [d for d in departures(flat, recipe, row) if d.key not in ignored])
                  for recipe in paper_recipes().values() for row in recipe.rows.values()]
    return min(candidates, key=lambda candidate: len(candidate[2]))


def _teacher(flat: dict[str, Any]) -> str | None:
    """The config's teacher, as the papers name one: a timm name, or the model source it is taken from."""
    source = flat.get("distill.teacher_from")
    return flat.get("distill.teacher") or (f"teacher_from={source}" if source else None)


def departures(flat: dict[str, Any], recipe: PaperRecipe, row: PaperRow) -> list[Departure]:
    """Where a config's flat values (``ExperimentConfig.flat()`` with the derived rate and batch, as MLflow
    records them) leave the row's recipe, in the recipe's order; then any model argument the paper's
    model does not take."""
    cited = recipe.values(row)
    given = {**flat, "distill.teacher": _teacher(flat)}
    found = [Departure(key, entry.value, given.get(key), entry.source)
             for key, entry in cited.items() if not same(entry.value, given.get(key))]
    found += [Departure(key, None, value, "not set by the paper: its model's own default")
              for key, value in flat.items() if key.startswith(MODEL_ARGS_PREFIX) and key not in cited]
    return found
