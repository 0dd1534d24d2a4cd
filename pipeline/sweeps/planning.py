"""Which trials a sweep runs: every sampled config resolved and checked before any trial starts.

A candidate is the base config (preset, the space's ``fixed``, ``--set``) with one value per
searched knob and the derived keys filled in. It is valid when the config validates and its
model builds *and* runs a forward pass on the meta device (shapes only, no memory or compute):
the build catches bad arguments (``svpn_alpha=1.5``, an unknown ``code_sise``), the forward pass
the constraints a constructor cannot see (heads that do not divide the channels).

Before a sweep starts, every value a knob can take (each choice, grid point and both ends of a
range) is checked in combination with the others:

- no valid combination at all: the space is an error;
- a value that is invalid in every combination: an error naming the key and value;
- otherwise invalid combinations are constraints: pruned and recorded, never started.

Trials that start from trained weights (``model.init_from``, which may name other keys of the
trial's config in braces: ``models:/xcit_{model.args.qkv}@pretrained``) have each source resolved
once and fitted to every model it starts (``check_initial_weights``): a source that does not resolve
or fit is an error naming the trials' knobs.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import get_dotted, validate, with_dotted
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.components.modeling import checked_training_sizes, model_problem, training_sizes_problem
from pipeline.sweeps.spaces import Dimension, SearchSpace, SpaceError, same_value
from pipeline.trained.transfer import fill_template, plan_transfer, shapes_of

MAX_CHECKED = 2048  # combinations checked before a sweep; beyond that, a seeded sample of them
MAX_GRID = 1000  # trials a grid search may expand to
SAMPLE_ATTEMPTS = 50  # random search: draws per requested trial before giving up on finding valid ones
_MISSING = object()


@dataclass(frozen=True)
class Candidate:
    assignment: dict[str, Any]  # the searched knobs that apply, in the space's order
    knobs: dict[str, Any]  # the assignment plus the derived keys
    config: ExperimentConfig | None
    problem: str | None  # why it cannot run; None when valid


def resolve_trial(space: SearchSpace, base_tree: dict[str, Any], sampled: dict[str, Any]) -> tuple[ExperimentConfig, dict[str, Any]]:
    """The trial's validated config and its knobs; ConfigError when the combination is invalid."""
    assignment = space.active_assignment(sampled, base_tree)
    tree = with_dotted(base_tree, assignment)
    try:
        derived = space.derived(tree)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tree = with_dotted(tree, derived)
    source = get_dotted(tree, "model.init_from")
    if isinstance(source, str) and "{" in source:  # a knob chooses the trial's weights
        tree = with_dotted(tree, {"model.init_from": fill_template(source, tree)})
    return validate(tree), {**assignment, **derived}


def _knobs_text(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in knobs.items()) or "the base config"


def _one_line(err: Exception) -> str:
    return str(err).removeprefix("invalid config:\n  ").replace("\n  ", "; ")


class TrialChecker:
    """Resolves candidates; each distinct model section (with its progressive crop sizes) is built once."""

    def __init__(self, space: SearchSpace, base_tree: dict[str, Any]):
        self.space, self.base_tree = space, base_tree
        self._models: dict[str, str | None] = {}

    def check(self, sampled: dict[str, Any]) -> Candidate:
        assignment = self.space.active_assignment(sampled, self.base_tree)
        try:
            config, knobs = resolve_trial(self.space, self.base_tree, sampled)
        except ConfigError as err:
            return Candidate(assignment, dict(assignment), None, _one_line(err))
        progressive = config.data.progressive
        key = json.dumps([config.model.model_dump(mode="json"), progressive and progressive.model_dump(),
                          config.optim.epochs], sort_keys=True)
        if key not in self._models:  # the model at its size, and at each crop size data.progressive feeds it
            self._models[key] = (model_problem(config.model)
                                 or training_sizes_problem(config.model, progressive, config.optim.epochs))
        problem = self._models[key]
        return Candidate(assignment, knobs, None if problem else config, problem)


@dataclass
class TrialPlan:
    """What the sweep runs: grid/random trials fixed up front; TPE samples as it goes."""

    variants: list[dict[str, Any]]  # each a valid assignment (grid, random); empty for tpe
    pruned: list[dict[str, Any]] = field(default_factory=list)  # {"knobs": ..., "reason": ...}
    checked: int = 0
    # Every valid candidate seen while planning (not recorded: a resumed sweep was checked when it started).
    candidates: list[Candidate] = field(default_factory=list, repr=False)


def _reservoir(items: Iterable[dict[str, Any]], size: int, rng: random.Random) -> list[dict[str, Any]]:
    chosen: list[dict[str, Any]] = []
    for seen, item in enumerate(items):
        if seen < size:
            chosen.append(item)
        else:
            slot = rng.randrange(seen + 1)
            if slot < size:
                chosen[slot] = item
    return chosen


def check_conditions_hold(space: SearchSpace, base_tree: dict[str, Any]) -> None:
    """SpaceError for a knob whose ``when`` no trial meets (a mistyped value would drop the knob unsaid): a
    key searched over choices must be able to take an allowed value; a key not searched must have one."""
    searched = {dim.key: dim for dim in space.dims}
    for dim in space.dims:
        for key, allowed in dim.when:
            over = searched.get(key)
            if over is None:
                value = get_dotted(base_tree, key)
                takes, possible = f"is {value!r} in every trial (the base config)", (value,)
            elif over.kind == "values":  # where its own when does not hold, it keeps the base config's value
                possible = (*over.values, get_dotted(base_tree, key)) if over.when else over.values
                takes = f"is searched over {list(over.values)}"
            else:
                continue  # a range: any value of it may meet the condition
            if not any(same_value(value, allowed) for value in possible):
                raise SpaceError(f"{' + '.join(space.sources)}: params.{dim.key} applies to no trial: its when "
                                 f"{key}: {list(allowed)} never holds, as {key} {takes}")


def check_space(space: SearchSpace, base_tree: dict[str, Any], checker: TrialChecker, seed: int) -> list[Candidate]:
    """Every knob value checked in combination; raise SpaceError for a space that cannot work."""
    check_conditions_hold(space, base_tree)
    combos = _reservoir(space.combinations(base_tree, Dimension.check_points), MAX_CHECKED, random.Random(seed))
    results = [checker.check(combo) for combo in combos]
    where = " + ".join(space.sources)
    valid = [r for r in results if r.problem is None]
    if not valid:
        reasons = list(dict.fromkeys(f"{_knobs_text(r.knobs)}: {r.problem}" for r in results))
        raise SpaceError(
            f"search space {where} yields no valid trial: all {len(results)} combinations checked are invalid:\n  "
            + "\n  ".join(reasons[:5]) + (f"\n  ... and {len(reasons) - 5} more reasons" if len(reasons) > 5 else "")
        )
    for dim in space.dims:
        for value in dim.check_points():
            with_value = [r for r in results if r.assignment.get(dim.key, _MISSING) == value]
            if with_value and all(r.problem for r in with_value):
                raise SpaceError(
                    f"search space {where}: {dim.key} = {dim.describe(value)} is invalid in every combination: "
                    f"{with_value[0].problem}"
                )
    return results


def plan_trials(space: SearchSpace, base_tree: dict[str, Any], searcher: str, num_samples: int | None,
                seed: int) -> TrialPlan:
    checker = TrialChecker(space, base_tree)
    finite = searcher == "random" and all(dim.kind == "values" for dim in space.dims)
    if finite:
        distinct = len(_take(space.combinations(base_tree, Dimension.grid_points), num_samples))
        if distinct < num_samples:
            raise SpaceError(
                f"random search over {' + '.join(space.sources)}: its knobs' choices make {distinct} "
                f"configurations, fewer than tune.num_samples={num_samples}, so trials would repeat; use "
                "tune.searcher=grid (each once), fewer samples, or search run.seed to repeat them on purpose")
    checked = check_space(space, base_tree, checker, seed)
    if searcher == "grid":
        combos = _take(space.combinations(base_tree, Dimension.grid_points), MAX_GRID + 1)
        if len(combos) > MAX_GRID:
            raise SpaceError(f"the grid of {' + '.join(space.sources)} has more than {MAX_GRID} trials; "
                             "use tune.searcher=random or tpe with tune.num_samples")
        results = [checker.check(combo) for combo in combos]
        return TrialPlan(
            variants=[r.assignment for r in results if r.problem is None],
            pruned=[{"knobs": r.knobs, "reason": r.problem} for r in results if r.problem],
            checked=len(checked), candidates=_valid([*checked, *results]),
        )
    if searcher == "random":
        rng = random.Random(seed)
        plan = TrialPlan(variants=[], checked=len(checked), candidates=_valid(checked))
        drawn: set[str] = set()
        for _ in range(SAMPLE_ATTEMPTS * num_samples):
            if len(plan.variants) == num_samples:
                break
            sampled = space.sample(base_tree, rng)
            if finite:  # choices only: each configuration once, as a grid takes it (a repeat trains it again)
                configuration = json.dumps(space.active_assignment(sampled, base_tree), sort_keys=True, default=str)
                if configuration in drawn:
                    continue
                drawn.add(configuration)
            candidate = checker.check(sampled)
            if candidate.problem:
                plan.pruned.append({"knobs": candidate.knobs, "reason": candidate.problem})
            else:
                plan.variants.append(candidate.assignment)
                plan.candidates.append(candidate)
        if len(plan.variants) < num_samples:
            raise SpaceError(
                f"random search over {' + '.join(space.sources)} found {len(plan.variants)} valid trials in "
                f"{SAMPLE_ATTEMPTS * num_samples} draws, fewer than tune.num_samples={num_samples}; "
                f"most common reason: {_most_common(p['reason'] for p in plan.pruned)}"
            )
        return plan
    # tpe: each sample is checked as its trial starts
    return TrialPlan(variants=[], checked=len(checked), candidates=_valid(checked))


def _valid(candidates: list[Candidate]) -> list[Candidate]:
    return [candidate for candidate in candidates if candidate.problem is None]


def check_initial_weights(candidates: list[Candidate], num_classes: int, tracking_uri: str) -> dict[str, Any]:
    """Every trial's ``model.init_from`` resolved once (``pipeline.trained.model_source``) and fitted to each
    model it starts (``pipeline.trained.transfer``), before any trial runs: SpaceError naming the trials' knobs
    when one does not resolve or fit. Returns the sources by ``model.init_from``, ``model.init_ema``."""
    from pipeline.trained.model_source import resolve_model_source

    sources: dict[tuple[str, bool], Any] = {}
    fitted: set[str] = set()
    for candidate in candidates:
        model = candidate.config.model
        if model.init_from is None:
            continue
        key = (model.init_from, model.init_ema)
        try:
            if key not in sources:
                sources[key] = resolve_model_source(model.init_from, storage_path=candidate.config.run.storage_path,
                                                    tracking_uri=tracking_uri, ema=model.init_ema)
            fit = json.dumps([*key, model.model_dump(mode="json")], sort_keys=True)
            if fit not in fitted:
                source = sources[key]
                plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, num_classes)
                fitted.add(fit)
        except InvalidInputError as err:
            raise SpaceError(f"trials with {_knobs_text(candidate.knobs)}: {err}") from None
    return sources


def crop_sizes(config: ExperimentConfig) -> list[int]:
    """The input sizes a trial's model (and teacher) is fed: data.progressive's, else model.img_size."""
    if config.data.progressive is None:
        return [config.model.img_size]
    return checked_training_sizes(config.model, config.data.progressive, config.optim.epochs)


def check_teachers(candidates: list[Candidate], num_classes: int, tracking_uri: str) -> dict[tuple[str, bool], Any]:
    """Every trial's ``distill.teacher_from`` resolved once and checked at each input size it teaches
    (``pipeline.trained.teacher``), before any trial runs: SpaceError naming the trials' knobs when one does not
    resolve or teach. Returns the sources keyed as ``check_initial_weights``' are (the source, its EMA?): the
    sweep saves both alike."""
    from pipeline.trained.teacher import check_teacher, resolved_teacher

    sources: dict[tuple[str, bool], Any] = {}
    checked: set[str] = set()
    for candidate in candidates:
        config = candidate.config
        key = (config.distill.teacher_from, config.distill.teacher_ema)
        if key[0] is None:
            continue
        try:
            if key not in sources:
                sources[key] = resolved_teacher(*key, config.run.storage_path, tracking_uri)
            fit = json.dumps([*key, config.model.img_size, config.data.progressive and
                              config.data.progressive.model_dump(), config.optim.epochs])
            if fit not in checked:
                check_teacher(sources[key], num_classes, config.model.img_size, crop_sizes(config))
                checked.add(fit)
        except InvalidInputError as err:
            raise SpaceError(f"trials with {_knobs_text(candidate.knobs)}: {err}") from None
    return sources


def _take(items: Iterator[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    taken = []
    for item in items:
        taken.append(item)
        if len(taken) >= limit:
            break
    return taken


def _most_common(reasons: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return max(counts, key=counts.get) if counts else "none"
