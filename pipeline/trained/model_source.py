"""Model sources: trained weights named by one string, resolved and read on the driver before Ray starts.

A source (``model.init_from``; ``vitsweep evaluate|predict|register SOURCE``) is one of these,
shown with the ``kind`` it resolves as and the weights read:

- ``run_name``: a run's name under ``run.storage_path`` (``e2e``), and ``run_dir``: a run's
  directory (``vitsweep-runs/e2e``): its newest checkpoint's final ``model.safetensors`` (with
  ``ema``: ``model_ema.safetensors``); a run whose newest checkpoint has none has not finished.
- ``checkpoint_dir``: a checkpoint directory vitsweep wrote: its final weights where it has them,
  else its DeepSpeed state (ZeRO 1-3 consolidated by DeepSpeed's ``zero_to_fp32``; EMA: the
  client state's). Only the run's newest, final checkpoint is its logged model; an earlier one is
  ``before_end``, with no ``model_id``.
- ``safetensors``: a ``.safetensors`` file, with its card where vitsweep wrote one into its metadata (a
  run's saved ``model.init_from`` or teacher, ``pipeline.trained.transfer.save_source``) or, for a
  checkpoint's own weights file, its checkpoint's; ``state_dict``:
  any other file, a torch state dict (bare, or under timm's ``state_dict`` / ``model``; EMA:
  ``state_dict_ema`` / ``model_ema``) loaded with ``torch.load(weights_only=True)``.
- ``mlflow_run``: ``runs:/<run_id>/<name>`` (a logged model's name; ``model``: the run's own, whatever its
  name), ``logged_model``: ``models:/<model_id>`` (MLflow 3's URI of a logged model, which training
  prints), and ``registered_model``: ``models:/<name>/<version>`` or ``models:/<name>@<alias>``, in the
  given MLflow store: the weights files logged with the MLflow model (``extra_files/``), and the card in
  its metadata.
- ``mlflow_model_dir``: such an MLflow model downloaded (a directory with its ``MLmodel``): the same
  files, read in place (``read_logged_model_directory``; the model's pyfunc loads itself this way).

A run directory records its MLflow store by an absolute path; when that store is gone (the project
moved), or a downloaded model names no store, its run is looked up in the given store instead.
An existing path is taken as a path; a bare name that is not one is looked up as a run. Nothing
is written: MLflow files are downloaded into a temporary directory, read, and removed; a local
MLflow store that does not exist is refused rather than created. Anything that does not resolve
(a missing path, a directory that is no run or checkpoint, a truncated or corrupt file, a pickle
that is not weights-only loadable, an unknown run, model, version or alias) is an
``InvalidInputError`` (exit 2) naming the source and what was looked for.
"""
from __future__ import annotations

import json
import pickle
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from mlflow.exceptions import MlflowException
from safetensors import SafetensorError, safe_open
from timm.models import clean_state_dict
from torch import nn

from pipeline import uris
from pipeline.components.checkpointing import (EMA_WEIGHTS_FILE, META_FILE, WEIGHTS_FILE, CorruptCheckpointError,
    checkpoint_state_dict, checkpoints_newest_first, read_meta, verify_checkpoint)
from pipeline.console import library_prints
from pipeline.errors import InvalidInputError
from pipeline.components.model_card import MLFLOW_METADATA_KEY, SAFETENSORS_CARD_KEY, ModelCard
from pipeline.components.modeling import build_model, checked_model
from pipeline.tracking.store import FORMER_MODEL_NAME, LOGGED_MODEL_FILES, RUN_RECORD, read_run_record, run_model_id
from pipeline.tracking.connection import is_local_store, is_missing_local_store, open_client, require_reachable

SourceKind = Literal["run_name", "run_dir", "checkpoint_dir", "safetensors", "state_dict", "mlflow_run",
                     "logged_model", "registered_model", "mlflow_model_dir"]
FORMS = ("a run name or directory, a checkpoint directory, a .safetensors or torch state dict file, "
         "runs:/RUN_ID/model, models:/MODEL_ID, models:/NAME/VERSION or models:/NAME@ALIAS, or a downloaded "
         "MLflow model directory")
MLMODEL_FILE = "MLmodel"  # an MLflow model directory's description (flavors, metadata)
_MLFLOW_SCHEMES = ("runs:/", "models:/")
# Where torch training scripts keep a model's weights in a checkpoint dict (timm's names), EMA's first.
_STATE_DICT_KEYS = {False: ("state_dict", "model"), True: ("state_dict_ema", "model_ema")}


@dataclass(frozen=True)
class Provenance:
    """Where a source's weights came from; the MLflow fields are None where the source cannot say.

    ``given``: the source as written. ``kind``: which form it resolved as (see the module). ``location``:
    what was read (a weights file, a checkpoint directory, or a logged model's artifact URI of the
    weights file). ``ema``: whether the EMA's weights were taken. ``tracking_uri``, ``experiment_id``,
    ``run_id``: the MLflow store, experiment and run that trained it (for a run or checkpoint: from
    the run directory's ``mlflow_run.json``). ``model_id``: its MLflow 3 logged model (``m-...``).
    ``registered_name`` / ``registered_version`` / ``registered_alias``: the model registry entry a
    ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` source named (the version is resolved for an alias too).
    ``before_end``: a checkpoint from before its run's end, whose weights are no logged model (``model_id`` None).
    """

    given: str
    kind: SourceKind
    location: str
    ema: bool = False
    tracking_uri: str | None = None
    experiment_id: str | None = None
    run_id: str | None = None
    model_id: str | None = None
    registered_name: str | None = None
    registered_version: str | None = None
    registered_alias: str | None = None
    before_end: bool = False


@dataclass(frozen=True)
class ModelSource:
    """A resolved source: ``weights`` (a complete state dict on the CPU: floating tensors fp32, integer
    buffers as saved; tensors shared between blocks, as F-SNE's codes, under each of their names),
    ``card`` (what the model is: ``model_card.ModelCard``; None for a bare file, which cannot say;
    from a checkpoint older than cards: model and class count only) and ``provenance``."""

    weights: dict[str, torch.Tensor]
    card: ModelCard | None
    provenance: Provenance

    def require_card(self) -> ModelCard:
        """The card; InvalidInputError for a bare weights file, which cannot say what model it holds."""
        if self.card is None:
            raise InvalidInputError(f"model source {self.provenance.given!r} is a bare weights file: it does not say "
                                    "which model it holds (no model card in it, no checkpoint's beside it); give the "
                                    "run or checkpoint directory it came from, or an MLflow model")
        return self.card

    def build(self, img_size: int | None = None) -> nn.Module:
        """The model as it was trained (the card's model section and class count) holding these
        weights exactly, on the CPU, in eval mode; at ``img_size`` instead of its own where the same
        weights fit and the model runs there (XCiT's Fourier encoding does; a learned position
        embedding of another grid does not: InvalidInputError)."""
        given = self.provenance.given
        section = self.require_card().model
        if img_size is not None and img_size != section.img_size:
            section = section.model_copy(update={"img_size": img_size})
            checked_model(section, self.card.num_classes)  # a ConfigError naming the size if it cannot run there
        model = build_model(section, self.card.num_classes)
        try:
            model.load_state_dict(self.weights)
        except RuntimeError as err:
            at = ("" if section is self.card.model
                  else f" at img_size {section.img_size} (trained at {self.card.model.img_size})")
            raise InvalidInputError(f"model source {given!r}: its weights do not fit its own model "
                                    f"{self.card.model.name}{at} ({err})") from None
        return model.eval()


def resolve_model_source(given: str, *, storage_path: str | Path, tracking_uri: str, ema: bool = False) -> ModelSource:
    """Resolve ``given`` and read its weights (the EMA's with ``ema``): a run's name is looked up under
    ``storage_path``, an MLflow URI in the store at ``tracking_uri``. InvalidInputError when it does not resolve."""
    if given.startswith(_MLFLOW_SCHEMES):
        return _mlflow_source(given, tracking_uri, ema)
    if uris.is_uri(given):
        raise InvalidInputError(f"model source {given!r}: a URI other than runs:/ or models:/; a source is {FORMS}")
    return _relocated_lineage(_local_source(given, storage_path, ema), tracking_uri)


def _relocated_lineage(source: ModelSource, tracking_uri: str) -> ModelSource:
    """A run directory's record names its MLflow store by an absolute path, which a project moved or renamed
    since leaves pointing at nothing (and opening it would create an empty store there); a downloaded MLflow
    model names its run but no store. The run is then looked for in the store at ``tracking_uri`` (the
    config's, if it exists or answers): found, its lineage follows it; else a gone store's lineage is dropped."""
    lineage = source.provenance
    gone = lineage.tracking_uri is not None and is_missing_local_store(lineage.tracking_uri)
    if not (gone or (lineage.run_id and lineage.tracking_uri is None)):
        return source
    if lineage.run_id and not is_missing_local_store(tracking_uri):
        try:
            require_reachable(tracking_uri)
            run = open_client(tracking_uri).get_run(lineage.run_id)
            return replace(source, provenance=replace(lineage, tracking_uri=tracking_uri,
                                                      experiment_id=run.info.experiment_id))
        except (InvalidInputError, MlflowException):  # unreachable, or no such run there
            pass
    return replace(source, provenance=replace(lineage, tracking_uri=None, experiment_id=None, run_id=None,
                                              model_id=None)) if gone else source


def _local_source(given: str, storage_path: str | Path, ema: bool) -> ModelSource:
    path = Path(given).expanduser().absolute()
    if path.is_dir():
        return _directory_source(given, path, ema)
    if path.is_file():
        return _file_source(given, path, ema)
    storage = str(storage_path)
    run_dir = Path(storage).expanduser().absolute() / given
    if Path(given).name == given and not uris.is_uri(storage) and run_dir.is_dir():
        return _run_source(given, run_dir, "run_name", ema)
    if special := uris.special_file_kind(path):
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} is {special}, not a file or directory; "
                                f"a source is {FORMS}")
    remote = " (a URI: a run is looked up by name in a local storage path only)" if uris.is_uri(storage) else ""
    raise InvalidInputError(f"model source {given!r} does not exist: it is no file or directory, and no run "
                            f"{given!r} is under run.storage_path {storage}{remote}; a source is {FORMS}")


# -- runs and checkpoints ----------------------------------------------------------------------------


def _directory_source(given: str, directory: Path, ema: bool) -> ModelSource:
    if (directory / MLMODEL_FILE).is_file():
        return read_logged_model_directory(directory, ema, given)
    if (directory / META_FILE).is_file():
        weights, card, location = _checkpoint_contents(given, directory, ema)
        provenance = _run_provenance(given, "checkpoint_dir", location, ema, directory.parent)
        newest = [path.resolve() for path in checkpoints_newest_first(directory.parent)[:1]]
        if not (newest == [directory.resolve()] and (directory / WEIGHTS_FILE).is_file()):
            # an earlier epoch's weights: not the logged model the run record names, which holds the final ones
            provenance = replace(provenance, model_id=None, before_end=True)
        return ModelSource(weights, card, provenance)
    if (directory / RUN_RECORD).is_file() or checkpoints_newest_first(directory):
        return _run_source(given, directory, "run_dir", ema)
    raise InvalidInputError(
        f"model source {given!r}: directory {str(directory)!r} is neither a vitsweep run (no {RUN_RECORD}, no "
        f"checkpoint directory with {META_FILE} in it) nor a checkpoint (no {META_FILE}); a source is {FORMS}"
    )


def _run_source(given: str, run_dir: Path, kind: SourceKind, ema: bool) -> ModelSource:
    """A run's final weights: its newest checkpoint must hold them (the run finished)."""
    found = checkpoints_newest_first(run_dir)
    if not found:
        raise InvalidInputError(f"model source {given!r}: {str(run_dir)!r} holds no checkpoint: a run that has not "
                                "finished an epoch, or no run (a sweep's directory: give one of its trials' models, "
                                "runs:/RUN_ID/model with a run id `vitsweep compare` lists)")
    newest = found[0]
    if not (newest / WEIGHTS_FILE).is_file():
        raise InvalidInputError(
            f"model source {given!r}: run {str(run_dir)!r} has not finished: its newest checkpoint {str(newest)!r} "
            f"(epoch {read_meta(newest).get('epoch', '?')}) holds no final weights ({WEIGHTS_FILE}); to start "
            "from that checkpoint, give its directory as the source"
        )
    weights, card, location = _checkpoint_contents(given, newest, ema)
    return ModelSource(weights, card, _run_provenance(given, kind, location, ema, run_dir))


def _checkpoint_contents(given: str, directory: Path, ema: bool) -> tuple[dict[str, torch.Tensor], ModelCard, str]:
    """A verified checkpoint's weights (its final safetensors where it has them, else its DeepSpeed
    state), its card, and what was read."""
    try:
        verify_checkpoint(directory)
    except CorruptCheckpointError as err:  # a truncated or changed file, named
        raise CorruptCheckpointError(f"model source {given!r}: {err}") from None
    card = _checkpoint_card(given, directory)
    final = directory / (EMA_WEIGHTS_FILE if ema else WEIGHTS_FILE)
    if final.is_file():
        return _read_safetensors(given, final)[0], card, str(final)
    try:
        return _cpu_fp32(checkpoint_state_dict(directory, ema)), card, str(directory)
    except InvalidInputError as err:
        raise InvalidInputError(f"model source {given!r}: {err}") from None


def _checkpoint_card(given: str, directory: Path) -> ModelCard:
    meta = read_meta(directory)
    where = f"model source {given!r}: checkpoint {str(directory)!r}"
    return (ModelCard.from_dict(meta["card"], where) if "card" in meta
            else ModelCard.from_identity(meta.get("model") or {}, where))


def _run_provenance(given: str, kind: SourceKind, location: str, ema: bool, run_dir: Path) -> Provenance:
    """What the run directory's record of its MLflow run says (nothing for a copied checkpoint)."""
    record = read_run_record(run_dir) or {}
    return Provenance(given, kind, location, ema, tracking_uri=record.get("tracking_uri"),
                      experiment_id=record.get("experiment_id"), run_id=record.get("run_id"),
                      model_id=record.get("model_id"))


# -- files ---------------------------------------------------------------------------------------------


def _file_source(given: str, path: Path, ema: bool) -> ModelSource:
    if path.suffix == ".safetensors":
        if ema:
            raise InvalidInputError(f"model source {given!r} is one safetensors file, with no separate EMA weights; "
                                    "give the EMA's own file (model_ema.safetensors) and do not ask for EMA")
        weights, card = _read_safetensors(given, path)
        if card is None and (path.parent / META_FILE).is_file():  # a checkpoint's final weights: its card beside it
            card = _checkpoint_card(given, path.parent)
        return ModelSource(weights, card, Provenance(given, "safetensors", str(path), ema))
    return ModelSource(_read_state_dict(given, path, ema), None, Provenance(given, "state_dict", str(path), ema))


def _read_safetensors(given: str, path: Path) -> tuple[dict[str, torch.Tensor], ModelCard | None]:
    """Every tensor, and the names ``safetensors.torch.save_model`` dropped for tensors shared between
    blocks (its metadata maps each dropped name to the one kept); and the card vitsweep's saved sources
    carry in their metadata (``SAFETENSORS_CARD_KEY``), else None."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as weights:
            metadata = weights.metadata() or {}
            state = {name: weights.get_tensor(name) for name in weights.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} is not a readable safetensors file "
                                f"(truncated or not safetensors: {err})") from None
    state.update({alias: state[kept] for alias, kept in metadata.items() if kept in state and alias not in state})
    card = metadata.get(SAFETENSORS_CARD_KEY)
    return _cpu_fp32(state), (ModelCard.from_dict(json.loads(card), given) if card else None)


# What a file that is not a torch file often is, by its first bytes (torch.save writes a zip archive, or
# before torch 1.6 a pickle, whose first byte is 0x80).
_OTHER_FORMATS = {b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image",
                  b"%PDF": "a PDF document", b"\x1f\x8b": "gzip-compressed"}


def _read_state_dict(given: str, path: Path, ema: bool) -> dict[str, torch.Tensor]:
    """A torch file loaded weights-only: a state dict, bare or under timm's checkpoint keys."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    if not head.startswith((b"PK\x03\x04", b"\x80")):
        kind = next((name for magic, name in _OTHER_FORMATS.items() if head.startswith(magic)), "not a torch file")
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} is neither safetensors (by its name) nor a "
                                f"torch file ({kind}); a source is {FORMS}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise InvalidInputError(
            f"model source {given!r}: {str(path)!r} is not loadable weights-only, and vitsweep never unpickles code "
            f"({str(err).splitlines()[0]}); save a state dict of tensors (or safetensors)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} is neither safetensors (by its name) nor a "
                                f"readable torch file ({err})") from None
    if not isinstance(checkpoint, dict):
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} holds a {type(checkpoint).__name__}, not a "
                                "state dict")
    nested = next((checkpoint[key] for key in _STATE_DICT_KEYS[ema] if isinstance(checkpoint.get(key), dict)), None)
    if ema and nested is None:
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} holds no EMA weights (no "
                                f"{' or '.join(map(repr, _STATE_DICT_KEYS[True]))} entry)")
    state = clean_state_dict(nested if nested is not None else checkpoint)  # DDP's / torch.compile's prefixes
    not_tensors = [key for key, value in state.items() if not isinstance(value, torch.Tensor)]
    if not state or not_tensors:
        raise InvalidInputError(f"model source {given!r}: {str(path)!r} is not a state dict of tensors "
                                f"({'empty' if not state else f'{not_tensors[0]!r} is not a tensor'})")
    return _cpu_fp32(state)


def _cpu_fp32(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating tensors as fp32 on the CPU (a tensor already so stays the same object, shared or not)."""
    return {name: tensor.detach().to("cpu", torch.float32 if tensor.is_floating_point() else tensor.dtype)
            for name, tensor in state.items()}


# -- MLflow ----------------------------------------------------------------------------------------------


def _mlflow_source(given: str, tracking_uri: str, ema: bool) -> ModelSource:
    client = _open_store(given, tracking_uri)
    registered: dict[str, str] = {}
    kind = _mlflow_kind(given)
    try:
        if kind == "mlflow_run":
            run_id, model_id = _logged_model_of_run(given, client)
        elif kind == "logged_model":
            run_id, model_id = None, given.removeprefix("models:/")
        else:
            version, registered = _registered_version(given, client)
            run_id, model_id = version.run_id, _logged_model_of_version(given, version)
        logged = client.get_logged_model(model_id)
        files = {Path(info.path).name for info in client.list_logged_model_artifacts(model_id, LOGGED_MODEL_FILES)}
    except MlflowException as err:
        # one word after models:/ is a logged model's id to MLflow 3, which a registered model's name alone reads as
        hint = " (a registered model is models:/NAME/VERSION or models:/NAME@ALIAS)" if kind == "logged_model" else ""
        raise InvalidInputError(f"model source {given!r} does not resolve in MLflow store {tracking_uri}: "
                                f"{err.message}{hint}") from None
    wanted = EMA_WEIGHTS_FILE if ema else WEIGHTS_FILE
    if wanted not in files:
        reason = ("holds no EMA weights: its run trained without optim.ema_decay" if ema and WEIGHTS_FILE in files
                  else f"was not logged by vitsweep with its weights (no {LOGGED_MODEL_FILES}/{WEIGHTS_FILE})")
        raise InvalidInputError(f"model source {given!r}: MLflow model {model_id} {reason}")
    artifacts = logged.artifact_location.rstrip("/")
    location = f"{artifacts}/{LOGGED_MODEL_FILES}/{wanted}"
    with tempfile.TemporaryDirectory(prefix="vitsweep-source-") as directory:
        weights = _read_safetensors(given, _download(given, location, directory, tracking_uri))[0]
        card = _logged_card(given, _download(given, f"{artifacts}/MLmodel", directory, tracking_uri))
    provenance = Provenance(given, kind, location, ema,
                            tracking_uri=tracking_uri, experiment_id=logged.experiment_id,
                            run_id=logged.source_run_id or run_id, model_id=model_id, **registered)
    return ModelSource(weights, card, provenance)


def _open_store(given: str, tracking_uri: str):
    """A client of the store; a local store must exist already (opening one creates it)."""
    if is_local_store(tracking_uri):
        if is_missing_local_store(tracking_uri):
            location = Path(tracking_uri.removeprefix("sqlite:///").removeprefix("file://"))
            raise InvalidInputError(f"model source {given!r}: there is no MLflow store at {tracking_uri} "
                                    f"({location} does not exist)")
    else:
        require_reachable(tracking_uri)
    return open_client(tracking_uri)


def _mlflow_kind(given: str) -> SourceKind:
    """Which MLflow URI ``given`` is: a run's model, a logged model's id (one word), or a registry version."""
    if given.startswith("runs:/"):
        return "mlflow_run"
    reference = given.removeprefix("models:/")
    return "registered_model" if "/" in reference or "@" in reference else "logged_model"


def _logged_model_of_run(given: str, client) -> tuple[str, str]:
    """``runs:/<run_id>/<name>``: the model named ``name`` that the run logged (as MLflow 3 resolves it), and
    ``runs:/<run_id>/model`` the run's own, as vitsweep named every run's model before naming it after the run."""
    run_id, _, name = given.removeprefix("runs:/").partition("/")
    if not run_id or not name or "/" in name:
        raise InvalidInputError(f"model source {given!r}: a run's model is runs:/RUN_ID/model (or "
                                "runs:/RUN_ID/NAME, NAME its logged model's name)")
    run = client.get_run(run_id)
    logged = {model.name: model.model_id
              for model in (client.get_logged_model(o.model_id) for o in run.outputs.model_outputs)}
    model_id = logged.get(name) or (run_model_id(client, run) if name == FORMER_MODEL_NAME else None)
    if model_id is None:
        raise InvalidInputError(f"model source {given!r}: run {run_id} logged no model named {name!r} "
                                f"(its models: {', '.join(sorted(logged)) or 'none'})")
    return run_id, model_id


def _registered_version(given: str, client):
    """``models:/<name>/<version>`` or ``models:/<name>@<alias>``: the model version, and what named it."""
    reference = given.removeprefix("models:/")
    if "@" in reference:
        name, _, alias = reference.rpartition("@")
        version = client.get_model_version_by_alias(name, alias)
        return version, {"registered_name": name, "registered_version": str(version.version), "registered_alias": alias}
    name, _, number = reference.rpartition("/")
    if not name or not number:
        raise InvalidInputError(f"model source {given!r}: a registered model is models:/NAME/VERSION or "
                                "models:/NAME@ALIAS")
    version = client.get_model_version(name, number)
    return version, {"registered_name": name, "registered_version": str(version.version)}


def _logged_model_of_version(given: str, version) -> str:
    """The logged model a registry version points at (MLflow 3 registers ``models:/<model_id>``)."""
    reference = version.source.removeprefix("models:/") if version.source.startswith("models:/") else ""
    if version.model_id or (reference and "/" not in reference):
        return version.model_id or reference
    raise InvalidInputError(f"model source {given!r}: version {version.version} of {version.name!r} points at "
                            f"{version.source}, not at an MLflow logged model")


def _download(given: str, artifact_uri: str, directory: str, tracking_uri: str) -> Path:
    from mlflow.artifacts import download_artifacts

    try:
        with library_prints():  # MLflow's progress bars
            local = download_artifacts(artifact_uri=artifact_uri, dst_path=directory, tracking_uri=tracking_uri)
    except MlflowException as err:
        raise InvalidInputError(f"model source {given!r}: {artifact_uri} cannot be downloaded "
                                f"({err.message})") from None
    return Path(local)


def read_logged_model_directory(directory: str | Path, ema: bool = False, given: str | None = None) -> ModelSource:
    """A vitsweep MLflow model on disk (``MLmodel`` + ``extra_files/``): its weights, card and the run
    and logged model it names; InvalidInputError when it is not one."""

    directory = Path(directory)
    given = given or str(directory)
    wanted = directory / LOGGED_MODEL_FILES / (EMA_WEIGHTS_FILE if ema else WEIGHTS_FILE)
    card = _logged_card(given, directory / MLMODEL_FILE)
    if card is None or not wanted.is_file():
        reason = ("holds no EMA weights: its run trained without optim.ema_decay" if card and ema
                  else f"was not logged by vitsweep (no card in its MLmodel metadata, or no {LOGGED_MODEL_FILES}/"
                       f"{WEIGHTS_FILE})")
        raise InvalidInputError(f"model source {given!r}: MLflow model directory {str(directory)!r} {reason}")
    logged = _load_mlmodel(given, directory / MLMODEL_FILE)
    provenance = Provenance(given, "mlflow_model_dir", str(wanted), ema, run_id=logged.run_id,
                            model_id=getattr(logged, "model_id", None))
    return ModelSource(_read_safetensors(given, wanted)[0], card, provenance)


def _logged_card(given: str, mlmodel: Path) -> ModelCard | None:
    """The card in an MLflow model's metadata (None: logged without one)."""
    record = (_load_mlmodel(given, mlmodel).metadata or {}).get(MLFLOW_METADATA_KEY)
    return None if record is None else ModelCard.from_dict(record, f"model source {given!r}: its MLflow model")


def _load_mlmodel(given: str, mlmodel: Path):
    """An ``MLmodel`` file read as MLflow does; InvalidInputError naming it when it is not one."""
    from mlflow.models import Model

    try:
        return Model.load(str(mlmodel))
    except Exception as err:  # noqa: BLE001  (YAML's, MLflow's and a wrong shape's errors alike: not an MLflow model)
        reason = (str(err).strip().splitlines() or [""])[0]
        raise InvalidInputError(f"model source {given!r}: {str(mlmodel)!r} is not an MLflow model description "
                                f"({type(err).__name__}: {reason})") from None
