"""Starting a run from trained weights (``model.init_from``): what of a source fits the model, and how.

A source (``pipeline.trained.model_source``) is made to fit the configured model the way timm makes a
checkpoint fit (``load_pretrained``, ``checkpoint_filter_fn``, ``reset_classifier``,
``resample_abs_pos_embed``). Every weight of the source and of the model is one of:

- loaded: the model has it, under the same name, in the same shape (conv stems, XCiT's Fourier
  encoding, every block);
- reset: kept at the model's own initialisation because it cannot carry over: the classifier when
  the class count differs (every weight whose shape follows the class count: a linear head's, SoT's
  fusion heads'), and a fixed position table (SoT's sinusoids, not trained) on a new token grid;
- resampled: a learned absolute position embedding (ViT, Armour, EIT and SoT where they have one)
  interpolated to a new token grid, bicubic, its class token kept (timm's ``resample_abs_pos_embed``);
- excluded: named by a ``model.init_exclude`` glob, kept at the model's own initialisation on purpose.

Anything else (a weight only one side has, a shape that differs elsewhere) is bad input naming each
weight and both shapes. The plan is computed from shapes alone, against the model built on the meta
device, on the driver before Ray starts; the workers apply it to the weights before DeepSpeed wraps
the model, so every ZeRO stage and precision loads the same way.

Where the weights travel: the driver writes the resolved source once, as a safetensors file with
its provenance and card in the file's metadata (``save_source``), into the run directory (a sweep:
one file per source in the sweep directory), and every worker reads it there. The run directory is
where Ray Train keeps the run's checkpoints, which it requires every node to reach (a shared file
system or an object store), so a worker on any node, and a worker group restarted after a failure,
reads the same bytes; the driver's memory or Ray's object store would not outlive the driver, while
a re-run of the same run name starts again from the weights it started from, even after the source
changed (an alias moved) or went away.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline import uris
from pipeline.config.schema import ModelConfig
from pipeline.config.loading import get_dotted
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.components.model_card import SAFETENSORS_CARD_KEY, ModelCard
from pipeline.components.modeling import build_model

if TYPE_CHECKING:  # the resolver imports MLflow, which the workers (loading the saved source) never need
    from pipeline.trained.model_source import ModelSource, Provenance

SOURCE_FILE = "init_source.safetensors"  # in a run directory: the weights the run started from
SWEEP_SOURCES = "init_sources"  # in a sweep directory: one saved source per model.init_from of its trials
PLAN_ARTIFACT = "init_weights.json"  # on the MLflow run: every weight, loaded, reset, resampled or excluded
POSITION_EMBEDDING = "pos_embed"  # timm's name of an absolute position embedding, [1, prefix + grid, dim]
_METADATA = {"provenance": "vitsweep.provenance", "card": SAFETENSORS_CARD_KEY}  # keys in the saved file's metadata
_TEMPLATE = re.compile(r"\{([A-Za-z_][\w.]*)\}")
_SHOWN = 12  # mismatched weights listed in an error before "... and N more"

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class TransferPlan:
    """How a source's weights start a model: each weight's fate (see the module) and why.

    ``source``: the source's provenance (``Provenance`` as a dict). ``reset``: weight -> why it starts
    fresh. ``resampled``: weight -> (source grid, model grid, prefix tokens). ``fresh``: the model's
    weights that keep their own initialisation (reset or excluded), which loading must leave out.
    """

    source: dict[str, Any]
    source_model: str | None
    loaded: tuple[str, ...]
    reset: dict[str, str] = field(default_factory=dict)
    resampled: dict[str, tuple[tuple[int, int], tuple[int, int], int]] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()
    fresh: tuple[str, ...] = ()

    @property
    def provenance(self) -> Provenance:
        from pipeline.trained.model_source import Provenance

        return Provenance(**self.source)

    def summary(self) -> str:
        """One line: where the weights come from and what became of them."""
        provenance = self.provenance
        origin = [f"run {provenance.run_id}"] if provenance.run_id else []
        if provenance.registered_name:
            origin.append(f"model {provenance.registered_name} version {provenance.registered_version}")
        if provenance.ema:
            origin.append("EMA")
        parts = [f"{len(self.loaded)} weights loaded"]
        if self.reset:
            parts.append(f"{len(self.reset)} reset ({_grouped(self.reset)})")
        if self.resampled:
            parts.append(f"{len(self.resampled)} resampled ("
                         + ", ".join(f"{name}: {_grid(old)} -> {_grid(new)} tokens"
                                     for name, (old, new, _) in self.resampled.items()) + ")")
        if self.excluded:
            parts.append(f"{len(self.excluded)} excluded by model.init_exclude")
        where = f" ({', '.join(origin)})" if origin else ""
        return f"{provenance.given}{where}: " + ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the MLflow artifact, the workers' plan)."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> TransferPlan:
        resampled = {name: (tuple(old), tuple(new), prefix) for name, (old, new, prefix) in record["resampled"].items()}
        return cls(record["source"], record["source_model"], tuple(record["loaded"]), dict(record["reset"]),
                   resampled, tuple(record["excluded"]), tuple(record["fresh"]))


def _grid(size) -> str:
    return "x".join(map(str, size))


def _grouped(reasons: dict[str, str]) -> str:
    """``head.weight, head.bias: classifier, 10 -> 5 classes`` for weights sharing a reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        by_reason.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


# -- the plan -------------------------------------------------------------------------------------------


def shapes_of(weights: dict[str, torch.Tensor] | nn.Module) -> Shapes:
    state = weights.state_dict() if isinstance(weights, nn.Module) else weights
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


@dataclass(frozen=True)
class _PositionEmbedding:
    grid: tuple[int, int]
    prefix: int  # class (and other prefix) tokens before the grid's
    learned: bool  # False: a fixed table the model builds itself (SoT's sinusoids)


def _position_embedding(model: nn.Module) -> _PositionEmbedding | None:
    """The model's absolute position embedding over its patch grid, if it has one (XCiT has none)."""
    table = getattr(model, POSITION_EMBEDDING, None)
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if not isinstance(table, nn.Parameter) or grid is None or table.dim() != 3:
        return None
    grid = tuple(int(side) for side in grid)
    return _PositionEmbedding(grid, table.shape[1] - grid[0] * grid[1], table.requires_grad)


def _source_grid(shape: tuple[int, ...], card: ModelCard | None, prefix: int) -> tuple[int, int] | None:
    """The source's patch grid: its own model's, where its card says what that is; else the square
    the token count makes (as timm assumes); None when it is no square."""
    if card is not None:
        embedding = _position_embedding(build_model(card.model, card.num_classes, device="meta"))
        if embedding is not None:
            return embedding.grid
    side = math.isqrt(max(shape[1] - prefix, 0))
    return (side, side) if side and side * side == shape[1] - prefix else None


def plan_transfer(shapes: Shapes, card: ModelCard | None, provenance: Provenance, model: ModelConfig,
                  num_classes: int) -> TransferPlan:
    """How the source (its weights' ``shapes``, its ``card``) starts ``model`` with ``num_classes``
    classes; InvalidInputError naming every weight that does not fit, with both shapes."""
    target = build_model(model, num_classes, device="meta")  # shapes only: no memory, no compute
    wanted = shapes_of(target)
    # The weights whose shape follows the class count: the classifier, however many heads it has.
    follows_classes = {name for name, shape in shapes_of(build_model(model, num_classes + 1, device="meta")).items()
                       if wanted.get(name) != shape}
    position = _position_embedding(target)
    excluded = sorted(name for name in shapes.keys() | wanted.keys()
                      if any(fnmatch.fnmatchcase(name, glob) for glob in model.init_exclude))
    loaded, reset, resampled, only_one_side = [], {}, {}, []
    names = shapes.keys() | wanted.keys()
    problems = [f"model.init_exclude {glob!r} matches no weight of the source or the model"
                for glob in model.init_exclude if not any(fnmatch.fnmatchcase(name, glob) for name in names)]
    for name in sorted((shapes.keys() | wanted.keys()) - set(excluded)):
        have, want = shapes.get(name), wanted.get(name)
        if want is None:
            only_one_side.append(f"{name} {list(have)}: the model has no such weight")
        elif have is None:
            only_one_side.append(f"{name} {list(want)}: the source has no such weight")
        elif have == want:
            loaded.append(name)
        elif name in follows_classes:
            before = card.num_classes if card is not None else have[0]
            reset[name] = f"classifier, {before} -> {num_classes} classes"
        elif name == POSITION_EMBEDDING and position is not None:
            old = _source_grid(have, card, position.prefix)
            if have[2] != want[2] or old is None:
                problems.append(f"{name}: source {list(have)} vs model {list(want)} (not the same embedding "
                                f"width and {position.prefix} prefix token(s) over a patch grid)")
            elif position.learned:
                resampled[name] = (old, position.grid, position.prefix)
            else:
                reset[name] = f"fixed position table, rebuilt for {_grid(old)} -> {_grid(position.grid)} tokens"
        else:
            problems.append(f"{name}: source {list(have)} vs model {list(want)}")
    problems += only_one_side  # after the shapes that differ, which say more about what went wrong
    if problems:
        shown = problems[:_SHOWN] + ([f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else [])
        from_model = f" (trained as {card.model.name})" if card is not None else ""
        raise InvalidInputError(
            f"model.init_from={provenance.given!r}{from_model} does not fit model.name={model.name!r} with "
            f"model.args={model.args!r}: {len(problems)} weight(s) cannot be taken:\n  " + "\n  ".join(shown)
            + "\n  Leave weights at their fresh initialisation on purpose with model.init_exclude "
              "(fnmatch globs, e.g. ['head.*'])")
    fresh = sorted((set(reset) | set(excluded)) & wanted.keys())
    return TransferPlan(asdict(provenance), card.model.name if card is not None else None, tuple(loaded), reset,
                        resampled, tuple(excluded), tuple(fresh))


def fill_template(init_from: str | None, tree: dict[str, Any]) -> str | None:
    """``init_from`` with each ``{dotted.key}`` replaced by that key's value in the config ``tree``
    (a sweep's knob choosing a trial's source); ConfigError for a key with no value."""
    if init_from is None:
        return None

    def value(match: re.Match) -> str:
        found = get_dotted(tree, match.group(1))
        if found is None or isinstance(found, (dict, list)):
            raise ConfigError(f"model.init_from={init_from!r}: {{{match.group(1)}}} names no value of the config")
        return str(found)

    return _TEMPLATE.sub(value, init_from)


# -- the weights ----------------------------------------------------------------------------------------


def adapt_weights(weights: dict[str, torch.Tensor], plan: TransferPlan) -> dict[str, torch.Tensor]:
    """The source's weights as the model takes them: the loaded ones, the resampled ones interpolated."""
    from timm.layers import resample_abs_pos_embed

    state = {name: weights[name] for name in plan.loaded}
    for name, (old, new, prefix) in plan.resampled.items():
        state[name] = resample_abs_pos_embed(weights[name], new_size=list(new), old_size=list(old),
                                             num_prefix_tokens=prefix)
    return state


def load_initial_weights(model: nn.Module, weights: dict[str, torch.Tensor], plan: TransferPlan) -> None:
    """Load the adapted weights into ``model`` (before DeepSpeed wraps it); exactly ``plan.fresh`` stays as
    initialised. A RuntimeError if the model is not the one the plan was made for."""
    missing, unexpected = model.load_state_dict(adapt_weights(weights, plan), strict=False)
    if set(missing) != set(plan.fresh) or unexpected:
        raise RuntimeError(f"the initial weights of {plan.source['given']!r} do not fit the model they were planned "
                           f"for: missing {sorted(set(missing) - set(plan.fresh))}, unexpected {unexpected}")


def classifier_heads(model: nn.Module) -> list[nn.Module]:
    """The model's classifier heads (timm's ``get_classifier()``): one, or two with DeiT's distillation token."""
    heads = model.get_classifier()
    return list(heads) if isinstance(heads, tuple) else [heads]


def freeze_backbone(model: nn.Module) -> None:
    """A linear probe: every parameter but the classifier heads' stops training."""
    head = {id(parameter) for module in classifier_heads(model) for parameter in module.parameters()}
    for parameter in model.parameters():
        if id(parameter) not in head:
            parameter.requires_grad_(False)


def train_head_only(model: nn.Module) -> None:
    """Training mode for the heads alone: the frozen backbone is a fixed feature extractor (no dropout,
    no drop-path, BatchNorm on its running statistics, which then stay as loaded)."""
    model.eval()
    for head in classifier_heads(model):
        head.train()


# -- saved sources ----------------------------------------------------------------------------------------


def save_source(source: ModelSource, location: str) -> None:
    """The source's weights as one safetensors file at ``location`` (a local path or a URI), its
    provenance and card in the file's metadata; written whole or not at all."""
    from safetensors.torch import save

    seen: set[int] = set()
    tensors = {}
    for name, tensor in source.weights.items():  # safetensors stores shared tensors (F-SNE's codes) once each
        pointer = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    metadata = {_METADATA["provenance"]: json.dumps(asdict(source.provenance))}
    if source.card is not None:
        metadata[_METADATA["card"]] = json.dumps(source.card.as_dict())
    uris.write_bytes(location, save(tensors, metadata=metadata))


def saved_source_exists(location: str) -> bool:
    return uris.read_bytes(location, length=0) is not None


def read_saved_weights(location: str) -> dict[str, torch.Tensor]:
    """The weights of a source written by ``save_source`` (what a worker needs of it)."""
    from safetensors.torch import load

    data = uris.read_bytes(location)
    if data is None:
        raise InvalidInputError(f"the saved initial weights {location} are missing")
    return load(data)


def read_saved_source(location: str) -> ModelSource:
    """A source written by ``save_source``: its weights, card and provenance."""
    from pipeline.trained.model_source import ModelSource

    card, provenance = saved_source_header(location)[1:]
    return ModelSource(read_saved_weights(location), card, provenance)


def saved_source_header(location: str) -> tuple[Shapes, ModelCard | None, Provenance]:
    """A saved source's weight shapes, card and provenance, read from its header only."""
    header = _header(uris.read_bytes(location, 8), lambda size: uris.read_bytes(location, size, offset=8), location)
    card, provenance = _described(header, location)
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}, card, provenance


def _header(prefix: bytes | None, read, location: str) -> dict[str, Any]:
    """safetensors' layout: an 8-byte little-endian header size, then the header's JSON."""
    if prefix is None or len(prefix) < 8:
        raise InvalidInputError(f"the saved initial weights {location} are missing or truncated")
    (size,) = struct.unpack("<Q", prefix)
    return json.loads(read(size))


def saved_source_card(location: str) -> ModelCard | None:
    """A saved source's card, read from its header only (and without MLflow: a worker reads it)."""
    header = _header(uris.read_bytes(location, 8), lambda size: uris.read_bytes(location, size, offset=8), location)
    return _card(header, location)


def _card(header: dict[str, Any], location: str) -> ModelCard | None:
    card = (header.get("__metadata__") or {}).get(_METADATA["card"])
    return ModelCard.from_dict(json.loads(card), location) if card else None


def _described(header: dict[str, Any], location: str) -> tuple[ModelCard | None, Provenance]:
    from pipeline.trained.model_source import Provenance

    metadata = header.get("__metadata__") or {}
    if _METADATA["provenance"] not in metadata:
        raise InvalidInputError(f"{location} was not written by vitsweep's save_source (no provenance)")
    return _card(header, location), Provenance(**json.loads(metadata[_METADATA["provenance"]]))


# -- a run's initial weights ------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitialWeights:
    """A run's start: the ``plan``, and ``location``, the saved source the workers read. ``source``:
    the resolved source while only the driver holds it (written to ``location`` at launch)."""

    plan: TransferPlan
    location: str
    source: ModelSource | None = None

    def save(self) -> None:
        """Write the source where the workers read it, once: a restarted run keeps the file it started from."""
        if self.source is not None and not saved_source_exists(self.location):
            save_source(self.source, self.location)

    def for_workers(self) -> dict[str, Any]:
        return {"location": self.location, "plan": self.plan.as_dict()}


def resolve_initial_weights(model: ModelConfig, num_classes: int, run_dir: str, storage_path: str,
                            tracking_uri: str) -> InitialWeights:
    """A run's ``model.init_from`` resolved and fitted to its model, before anything starts; a run
    restarted under its name takes the source it saved when it first started."""
    from pipeline.trained.model_source import resolve_model_source

    location = uris.join(run_dir, SOURCE_FILE)
    if saved_source_exists(location):
        source = read_saved_source(location)
    else:
        source = resolve_model_source(model.init_from, storage_path=storage_path, tracking_uri=tracking_uri,
                                      ema=model.init_ema)
    return InitialWeights(plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, num_classes),
                          location, source)


def sweep_source_location(directory: str, init_from: str, init_ema: bool) -> str:
    """Where a sweep keeps the saved source of its trials with this ``model.init_from`` and
    ``model.init_ema``: one file per source under ``directory``, named by a digest of both."""
    digest = hashlib.sha256(f"{init_from}\n{init_ema}".encode()).hexdigest()[:16]
    return uris.join(directory, f"{digest}.safetensors")


def saved_initial_weights(location: str, model: ModelConfig, num_classes: int) -> InitialWeights:
    """A sweep trial's start: the source its sweep saved, fitted to the trial's model (from the file's header)."""
    shapes, card, provenance = saved_source_header(location)
    return InitialWeights(plan_transfer(shapes, card, provenance, model, num_classes), location)
