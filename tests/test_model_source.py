"""Model sources: every form that names a trained model's weights resolves to those weights, its card and
its provenance; anything that does not resolve is bad input naming it, and nothing is written.

The sources are written by training's own code paths: a one-process DeepSpeed engine checkpointed by
``save_checkpoint`` / ``save_final_weights``, the final model logged by ``log_final_model`` into a
real sqlite MLflow store, then registered with MLflow's registry. The model is F-SNE XCiT, whose
blocks share their code tensors, so every source must give back the shared names too.
"""
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from conftest import refused_in_process
from pipeline.cli import main
from pipeline.components.checkpointing import (EMA_WEIGHTS_FILE, WEIGHTS_FILE, CorruptCheckpointError, model_identity,
    save_checkpoint, save_final_weights, use_weights_only_loading)
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.components.model_card import ModelCard
from pipeline.trained.model_source import resolve_model_source
from pipeline.components.modeling import build_model
from pipeline.tracking.store import MlflowRun, MlflowStore

CLASSES = tuple(f"digit {i}" for i in range(10))
REGISTERED = "xcit-fsne-tiny"
SHARED_CODE = "blocks.1.attn.qkv.codes.q"  # the same tensor as blocks.0's: safetensors keeps one name


@dataclass(frozen=True)
class TrainedRun:
    storage: Path
    run_dir: Path
    uri: str
    run_id: str
    experiment_id: str
    model_id: str
    card: ModelCard
    first: Path  # the epoch-1 checkpoint: DeepSpeed state only
    final: Path  # the epoch-2 checkpoint: with final weights
    weights: dict[str, dict[str, torch.Tensor]]  # "first", "first_ema", "final", "final_ema"


def _engine(overrides: list[str]):
    import deepspeed

    from pipeline.components.engine import deepspeed_config
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler

    cfg = load_config("smoke", ["scaling.num_workers=1", "model.args.qkv=fsne", "model.args.code_size=8", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=len(CLASSES))
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, 1),
                                           lr_scheduler=build_scheduler(optimizer, cfg.optim, 4),
                                           dist_init_required=False)
    use_weights_only_loading(engine)
    return cfg, engine


def _step(engine, ema=None, dtype: torch.dtype = torch.float32) -> None:
    images, labels = torch.randn(4, 3, 16, 16, dtype=dtype), torch.arange(4)
    engine.backward(F.cross_entropy(engine(images), labels))
    engine.step()
    if ema is not None:
        ema.update(engine.module, step=engine.global_steps)


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone().to(torch.float32 if tensor.is_floating_point() else tensor.dtype)
            for name, tensor in module.state_dict().items()}


@pytest.fixture(scope="module")
def trained(single_process_group, tmp_path_factory) -> TrainedRun:
    """A finished two-epoch run (ZeRO-1, EMA) in a run directory and its MLflow run, its model
    registered as version 1 of REGISTERED with the alias ``champion``."""
    from ray.train import Checkpoint, Result

    from pipeline.components.optim import build_ema
    from pipeline.training.runs import CheckedRun, ModelFacts, ResolvedData, log_final_model

    storage = tmp_path_factory.mktemp("runs")
    uri = f"sqlite:///{storage}/mlflow.db"
    cfg, engine = _engine(["optim.ema_decay=0.9", f"run.storage_path={storage}", "run.name=tiny"])
    ema = build_ema(engine.module, cfg.optim)
    run = CheckedRun(cfg, ResolvedData("train.beton", "val.beton", len(CLASSES), classes=CLASSES),
                     ModelFacts.measure(cfg.model, len(CLASSES)), "tiny", str(storage), uri)
    tracking = MlflowRun.open_or_continue(uri, cfg.tracking.experiment, run.run_dir, run.run_name)
    identity, weights = model_identity(cfg.model, len(CLASSES)), {}
    for epoch, name in enumerate(("first", "final")):
        _step(engine, ema)
        directory = run.run_dir / f"checkpoint_epoch{epoch + 1}"
        directory.mkdir()
        save_checkpoint(engine, directory, epoch=epoch, identity=identity, rank=0, ema=ema, card=run.card.as_dict())
        weights[name], weights[f"{name}_ema"] = _snapshot(engine.module), _snapshot(ema.module)
    save_final_weights(engine, directory, rank=0, ema=ema)
    log_final_model(run, Result(metrics={"epoch": 2}, checkpoint=Checkpoint.from_directory(directory), error=None,
                                path=str(run.run_dir)), tracking)
    logged = tracking.get()
    model_id = logged.outputs.model_outputs[0].model_id
    with pytest.MonkeyPatch.context() as patch:  # MLflow's registry finds the logged model through the global URI
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        version = mlflow.register_model(f"models:/{model_id}", REGISTERED)
    MlflowClient(uri).set_registered_model_alias(REGISTERED, "champion", version.version)
    return TrainedRun(storage, run.run_dir, uri, tracking.run_id, logged.info.experiment_id, model_id, run.card,
                      run.run_dir / "checkpoint_epoch1", directory, weights)


def resolve(trained: TrainedRun, given: str, ema: bool = False):
    return resolve_model_source(given, storage_path=trained.storage, tracking_uri=trained.uri, ema=ema)


def assert_same_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == expected.keys()
    assert all(tensor.device.type == "cpu" for tensor in weights.values())
    assert all(weights[name].dtype == torch.float32 for name, tensor in expected.items() if tensor.is_floating_point())
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


# -- each form of source ------------------------------------------------------------------------------


def test_a_run_name_gives_the_runs_final_weights_card_and_mlflow_lineage(trained):
    source = resolve(trained, "tiny")
    assert_same_weights(source.weights, trained.weights["final"])
    assert source.card == trained.card and source.card.class_names == CLASSES
    assert source.card.preprocessing.crop_ratio == 1.0 and source.card.preprocessing.img_size == 16
    provenance = source.provenance
    assert (provenance.given, provenance.kind, provenance.location) == ("tiny", "run_name",
                                                                        str(trained.final / WEIGHTS_FILE))
    assert (provenance.tracking_uri, provenance.experiment_id, provenance.run_id, provenance.model_id) == (
        trained.uri, trained.experiment_id, trained.run_id, trained.model_id)


def test_a_run_directory_gives_what_its_name_gives(trained):
    source = resolve(trained, str(trained.run_dir))
    assert source.provenance.kind == "run_dir" and source.provenance.model_id == trained.model_id
    assert_same_weights(source.weights, trained.weights["final"])


def test_ema_takes_the_runs_ema_weights(trained):
    source = resolve(trained, "tiny", ema=True)
    assert source.provenance.ema and source.provenance.location == str(trained.final / EMA_WEIGHTS_FILE)
    assert_same_weights(source.weights, trained.weights["final_ema"])
    assert not torch.equal(source.weights["head.weight"], trained.weights["final"]["head.weight"])


def test_a_finished_checkpoint_directory_gives_its_final_weights_and_its_runs_lineage(trained):
    source = resolve(trained, str(trained.final))
    assert source.provenance.kind == "checkpoint_dir" and source.provenance.run_id == trained.run_id
    assert source.provenance.model_id == trained.model_id  # the final weights are the run's logged model
    assert_same_weights(source.weights, trained.weights["final"])
    assert source.card == trained.card


def test_an_earlier_checkpoint_is_consolidated_from_its_zero_shards_with_its_card(trained):
    source = resolve(trained, str(trained.first))
    assert source.provenance.location == str(trained.first)
    # its run's, but not the run's logged model: evaluating it must not score that model
    assert source.provenance.run_id == trained.run_id and source.provenance.model_id is None
    assert source.provenance.before_end and not resolve(trained, str(trained.final)).provenance.before_end
    assert_same_weights(source.weights, trained.weights["first"])  # fp32 masters = the fp32 module
    assert source.card == trained.card


def test_a_sweeps_name_is_no_run_and_the_refusal_says_what_to_give(tmp_path):
    (tmp_path / "lr_wd-20261207-180903").mkdir()  # a sweep's directory: its trials' runs are below, not in it
    with pytest.raises(InvalidInputError) as refused:
        resolve_model_source("lr_wd-20261207-180903", storage_path=tmp_path, tracking_uri="unused:")
    assert str(refused.value).endswith("holds no checkpoint: a run that has not finished an epoch, or no run (a "
                                       "sweep's directory: give one of its trials' models, runs:/RUN_ID/model with a "
                                       "run id `vitsweep compare` lists)")


@pytest.mark.parametrize("recorded", ["sqlite:///{old}/mlflow.db", "file://{old}/mlruns", "{old}/mlruns"])
def test_a_run_of_a_moved_project_finds_its_mlflow_run_in_the_stores_new_place(trained, tmp_path, recorded):
    """The run record names its store by an absolute path (a SQLite file, or a file store's directory as a
    URI or bare): after the project moved, that path is gone. The run is found in the config's store (the
    moved one), and no empty store appears at the old path."""
    old, new = tmp_path / "project", tmp_path / "renamed"
    shutil.copytree(trained.storage, old)
    record = old / "tiny" / "mlflow_run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "tracking_uri": recorded.format(old=old)}))
    old.rename(new)
    source = resolve_model_source("tiny", storage_path=new, tracking_uri=f"sqlite:///{new}/mlflow.db")
    assert (source.provenance.tracking_uri, source.provenance.run_id, source.provenance.model_id) == (
        f"sqlite:///{new}/mlflow.db", trained.run_id, trained.model_id)
    elsewhere = resolve_model_source("tiny", storage_path=new, tracking_uri=f"sqlite:///{trained.storage}/absent.db")
    assert (elsewhere.provenance.tracking_uri, elsewhere.provenance.run_id) == (None, None)  # no store holds it
    assert_same_weights(elsewhere.weights, trained.weights["final"])
    assert not old.exists() and not (trained.storage / "absent.db").exists()


def test_an_earlier_checkpoint_is_not_registered_as_its_runs_logged_model(trained, capsys):
    err = refused_in_process(["register", str(trained.first), "early", "--set", f"tracking.mlflow_uri={trained.uri}",
                              "--set", f"run.storage_path={trained.storage}"], capsys)
    assert f"model source {str(trained.first)!r} is a checkpoint before the run's end, not its logged model" in err
    assert not MlflowClient(trained.uri).search_registered_models("name = 'early'")


def test_the_final_checkpoint_of_a_run_recorded_before_model_ids_registers_the_runs_model(trained, tmp_path, capsys):
    copy = tmp_path / "project"
    shutil.copytree(trained.storage, copy)
    record = copy / "tiny" / "mlflow_run.json"
    older = {key: value for key, value in json.loads(record.read_text()).items() if key != "model_id"}
    record.write_text(json.dumps({**older, "tracking_uri": f"sqlite:///{copy}/mlflow.db"}))
    final = copy / "tiny" / trained.final.name
    assert main(["register", str(final), "from-final", "--set", f"tracking.mlflow_uri=sqlite:///{copy}/mlflow.db",
                 "--set", f"run.storage_path={copy}"]) == 0, capsys.readouterr().err
    (version,) = MlflowClient(f"sqlite:///{copy}/mlflow.db").search_model_versions("name = 'from-final'")
    assert (version.run_id, version.source) == (trained.run_id, f"models:/{trained.model_id}")


def test_zero_shards_are_consolidated_weights_only_even_where_torch_is_told_to_unpickle(trained, monkeypatch):
    """zero_to_fp32 reads under torch's weights-only switch; a user's opposite switch, which torch refuses
    beside it, is lifted for the read and then put back."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert_same_weights(resolve(trained, str(trained.first)).weights, trained.weights["first"])
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1" and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_an_earlier_checkpoints_ema_comes_from_its_deepspeed_state(trained):
    assert_same_weights(resolve(trained, str(trained.first), ema=True).weights, trained.weights["first_ema"])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpoint_of_any_zero_stage_gives_the_engines_weights(single_process_group, tmp_path, stage):
    import deepspeed

    cfg, engine = _engine([f"deepspeed.zero_stage={stage}", "model.args.depth=1"])
    _step(engine)
    save_checkpoint(engine, tmp_path, epoch=0, identity=model_identity(cfg.model, len(CLASSES)), rank=0)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        expected = _snapshot(engine.module)
    source = resolve_model_source(str(tmp_path), storage_path=tmp_path, tracking_uri="sqlite:///unused.db")
    assert_same_weights(source.weights, expected)
    assert source.card.model.args["depth"] == 1 and source.card.class_names is None  # a checkpoint without a card
    with pytest.raises(InvalidInputError, match=re.escape(
            f"checkpoint {str(tmp_path)!r} holds no EMA weights: it was trained without optim.ema_decay")):
        resolve_model_source(str(tmp_path), storage_path=tmp_path, tracking_uri="sqlite:///unused.db", ema=True)
    save_final_weights(engine, tmp_path, rank=0)  # ZeRO-3: gathered from the rank's partitions
    source = resolve_model_source(str(tmp_path), storage_path=tmp_path, tracking_uri="sqlite:///unused.db")
    assert source.provenance.location == str(tmp_path / WEIGHTS_FILE)
    assert_same_weights(source.weights, expected)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_runs_final_weights_are_the_optimizers_fp32_master_weights_not_their_bf16_copies(
        single_process_group, tmp_path, stage):
    import deepspeed

    cfg, engine = _engine([f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16", "model.args.depth=1"])
    for _ in range(3):
        _step(engine, dtype=torch.bfloat16)
    save_checkpoint(engine, tmp_path, epoch=0, identity=model_identity(cfg.model, len(CLASSES)), rank=0)
    # DeepSpeed's own zero_to_fp32 consolidates the fp32 partitions the optimizer saved in the checkpoint
    masters = resolve_model_source(str(tmp_path), storage_path=tmp_path, tracking_uri="sqlite:///unused.db").weights
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        copies = _snapshot(engine.module)  # what the module trains with: bf16, widened
    assert [name for name in masters if not torch.equal(copies[name], masters[name])]  # the rounding shows
    save_final_weights(engine, tmp_path, rank=0)
    final = resolve_model_source(str(tmp_path), storage_path=tmp_path, tracking_uri="sqlite:///unused.db")
    assert final.provenance.location == str(tmp_path / WEIGHTS_FILE)
    assert_same_weights(final.weights, masters)


@pytest.mark.parametrize("told_to_unpickle", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_a_checkpoint_whose_deepspeed_state_needs_code_is_refused_unloaded(trained, tmp_path, monkeypatch,
                                                                           told_to_unpickle):
    if told_to_unpickle:  # torch's switch for loads that do not say weights_only: ours say it
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    checkpoint = tmp_path / "checkpoint_epoch1"
    shutil.copytree(trained.first, checkpoint)
    for manifest in checkpoint.glob("vitsweep_manifest_rank*.json"):
        manifest.unlink()  # a checkpoint of before manifests: a rewritten archive passes its CRC check
    torch.save({"module": trained.weights["first"], "ema": trained.weights["first_ema"], "epoch": 0,
                "loader": shutil.rmtree}, checkpoint / "state" / "mp_rank_00_model_states.pt")
    for ema in (False, True):
        with pytest.raises(InvalidInputError, match=re.escape(
                f"checkpoint {str(checkpoint)!r}: its DeepSpeed state under 'state' cannot be read as weights "
                "(UnpicklingError: ")):
            resolve(trained, str(checkpoint), ema=ema)


def test_a_checkpoints_safetensors_file_gives_every_name_of_a_shared_tensor_and_the_checkpoints_card(trained):
    source = resolve(trained, str(trained.final / WEIGHTS_FILE))
    assert (source.provenance.kind, source.card) == ("safetensors", trained.card)  # the card beside it
    assert_same_weights(source.weights, trained.weights["final"])
    assert SHARED_CODE in source.weights


def test_a_safetensors_file_vitsweep_saved_says_its_card(teacher_source):
    # save_source's metadata: the card beside the weights (a run's saved init_from or teacher is a source too)
    source = resolve_model_source(str(teacher_source), storage_path="unused", tracking_uri="unused:")
    assert source.provenance.kind == "safetensors"
    assert (source.card.model.name, source.card.model.args, source.card.num_classes) == ("xcit_nano_12_p8",
                                                                                         {"depth": 1}, 10)
    assert source.card.preprocessing.mean == (0.5, 0.5, 0.5)
    assert source.build(16)(torch.zeros(1, 3, 16, 16)).shape == (1, 10)


def test_a_torch_state_dict_gives_its_weights_or_its_ema(trained, tmp_path):
    path = tmp_path / "timm_checkpoint.pth"
    torch.save({"epoch": 2, "state_dict": trained.weights["final"], "state_dict_ema": trained.weights["final_ema"]},
               path)
    source = resolve(trained, str(path))
    assert (source.provenance.kind, source.card) == ("state_dict", None)
    assert_same_weights(source.weights, trained.weights["final"])
    assert_same_weights(resolve(trained, str(path), ema=True).weights, trained.weights["final_ema"])


# the run's own model: vitsweep's shorthand, and its name in MLflow (the run's)
@pytest.mark.parametrize("name", ["model", "tiny"])
def test_a_runs_uri_gives_the_logged_models_weights_card_and_lineage(trained, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    source = resolve(trained, f"runs:/{trained.run_id}/{name}")
    assert list(tmp_path.iterdir()) == []  # downloaded into a temporary directory, removed; no store created here
    assert_same_weights(source.weights, trained.weights["final"])
    assert source.card == trained.card
    provenance = source.provenance
    assert provenance.kind == "mlflow_run" and provenance.location.endswith(f"/extra_files/{WEIGHTS_FILE}")
    assert (provenance.tracking_uri, provenance.experiment_id, provenance.run_id, provenance.model_id) == (
        trained.uri, trained.experiment_id, trained.run_id, trained.model_id)


def test_a_logged_models_uri_gives_its_weights_card_and_lineage(trained):
    source = resolve(trained, f"models:/{trained.model_id}", ema=True)
    assert_same_weights(source.weights, trained.weights["final_ema"])
    assert source.card == trained.card
    provenance = source.provenance
    assert (provenance.kind, provenance.run_id, provenance.model_id, provenance.registered_name) == (
        "logged_model", trained.run_id, trained.model_id, None)


def test_a_registered_version_gives_its_logged_model(trained):
    source = resolve(trained, f"models:/{REGISTERED}/1")
    assert_same_weights(source.weights, trained.weights["final"])
    provenance = source.provenance
    assert (provenance.kind, provenance.registered_name, provenance.registered_version, provenance.registered_alias,
            provenance.model_id, provenance.run_id) == ("registered_model", REGISTERED, "1", None, trained.model_id,
                                                        trained.run_id)


def test_a_registered_alias_gives_its_versions_model_and_its_ema(trained):
    source = resolve(trained, f"models:/{REGISTERED}@champion", ema=True)
    assert_same_weights(source.weights, trained.weights["final_ema"])
    assert (source.provenance.registered_version, source.provenance.registered_alias) == ("1", "champion")
    assert source.card == trained.card


def test_an_alias_on_the_older_of_two_versions_gives_that_versions_weights_not_the_latest(trained, tmp_path):
    """Version 2 holds other weights (the run's plus one); the alias stays on version 1."""
    from safetensors.torch import save_model

    from pipeline.trained.serving import log_model

    model = resolve(trained, f"models:/{REGISTERED}/1").build()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    save_model(model, str(tmp_path / WEIGHTS_FILE))
    other = MlflowStore(trained.uri).create_run("vitsweep", "other-weights")
    other_model_id = log_model(other, model, [tmp_path / WEIGHTS_FILE], trained.card, step=1)
    other.end("FINISHED", "completed")
    with pytest.MonkeyPatch.context() as patch:  # MLflow's registry finds the logged model through the global URI
        patch.setenv("MLFLOW_TRACKING_URI", trained.uri)
        first = mlflow.register_model(f"models:/{trained.model_id}", "two-versions").version
        mlflow.register_model(f"models:/{other_model_id}", "two-versions")
    MlflowClient(trained.uri).set_registered_model_alias("two-versions", "older", first)
    source = resolve(trained, "models:/two-versions@older")
    assert (source.provenance.registered_version, source.provenance.run_id) == ("1", trained.run_id)
    assert_same_weights(source.weights, trained.weights["final"])
    assert not torch.equal(resolve(trained, "models:/two-versions/2").weights[SHARED_CODE],
                           trained.weights["final"][SHARED_CODE])  # the latest is another model


def test_a_downloaded_mlflow_model_directory_gives_its_weights_card_and_lineage(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained.uri)  # MLflow finds a models:/<model_id> through it
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{trained.model_id}", dst_path=str(tmp_path))
    source = resolve(trained, local, ema=True)
    assert_same_weights(source.weights, trained.weights["final_ema"])
    assert source.card == trained.card
    assert (source.provenance.kind, source.provenance.run_id, source.provenance.model_id) == (
        "mlflow_model_dir", trained.run_id, trained.model_id)
    # the store its run is in, where the config's store holds it: it registers, and evaluations link to it
    assert (source.provenance.tracking_uri, source.provenance.experiment_id) == (trained.uri, trained.experiment_id)
    elsewhere = resolve_model_source(local, storage_path=trained.storage, tracking_uri=f"sqlite:///{tmp_path}/other.db")
    assert (elsewhere.provenance.run_id, elsewhere.provenance.tracking_uri) == (trained.run_id, None)
    assert not (tmp_path / "other.db").exists()


def test_a_source_builds_its_model_as_the_logged_pytorch_model_predicts(trained, monkeypatch):
    images = torch.randn(2, 3, 16, 16)
    built = resolve(trained, f"models:/{REGISTERED}@champion").build()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained.uri)  # not mlflow.set_tracking_uri: it would leak
    logged = mlflow.pytorch.load_model(f"models:/{trained.model_id}")
    with torch.no_grad():
        torch.testing.assert_close(built(images), logged.eval()(images))


def test_a_bare_file_cannot_build_a_model(trained, tmp_path):
    shutil.copy(trained.final / WEIGHTS_FILE, tmp_path / "copied.safetensors")  # away from its checkpoint's card
    source = resolve(trained, str(tmp_path / "copied.safetensors"))
    assert source.card is None
    with pytest.raises(InvalidInputError, match="does not say which model"):
        source.build()


# -- what does not resolve ------------------------------------------------------------------------------


def test_a_missing_source_names_the_path_and_the_run_it_looked_for(trained):
    with pytest.raises(InvalidInputError) as err:
        resolve(trained, "no-such-run")
    assert "'no-such-run' does not exist" in str(err.value) and str(trained.storage) in str(err.value)


def test_a_directory_that_is_no_run_or_checkpoint_is_named(trained, tmp_path):
    with pytest.raises(InvalidInputError, match="is neither a vitsweep run .* nor a checkpoint"):
        resolve(trained, str(tmp_path))


def test_an_unfinished_run_points_at_its_newest_checkpoint(trained, tmp_path):
    unfinished = tmp_path / "unfinished"
    shutil.copytree(trained.first, unfinished / trained.first.name)
    with pytest.raises(InvalidInputError, match="has not finished: its newest checkpoint .*checkpoint_epoch1"):
        resolve(trained, str(unfinished))


def test_a_truncated_safetensors_file_is_named(trained, tmp_path):
    truncated = tmp_path / "model.safetensors"
    truncated.write_bytes((trained.final / WEIGHTS_FILE).read_bytes()[:-100])
    with pytest.raises(InvalidInputError, match=f"{truncated}.* is not a readable safetensors file"):
        resolve(trained, str(truncated))


def test_a_changed_checkpoint_file_is_named(trained, tmp_path):
    copy = tmp_path / "checkpoint"
    shutil.copytree(trained.final, copy)
    with open(copy / WEIGHTS_FILE, "r+b") as weights:
        weights.seek(-8, os.SEEK_END)
        weights.write(b"\x00" * 8)
    with pytest.raises(CorruptCheckpointError, match=f"{WEIGHTS_FILE}.* does not hash to the SHA-256"):
        resolve(trained, str(copy))


def test_a_pickle_that_needs_code_is_refused_unloaded(trained, tmp_path):
    pickled = tmp_path / "model.pth"
    torch.save({"state_dict": trained.weights["final"], "loader": shutil.rmtree}, pickled)
    with pytest.raises(InvalidInputError, match="is not loadable weights-only, and vitsweep never unpickles code"):
        resolve(trained, str(pickled))


def test_a_state_dict_without_ema_weights_refuses_ema(trained, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(trained.weights["final"], path)
    with pytest.raises(InvalidInputError, match="holds no EMA weights"):
        resolve(trained, str(path), ema=True)


@pytest.mark.parametrize("given, reason", [
    ("runs:/0123456789abcdef/model", "Run with id=0123456789abcdef not found"),
    ("models:/m-0123456789abcdef", "Logged model with ID 'm-0123456789abcdef' not found"),
    ("models:/digits-classifier", "(a registered model is models:/NAME/VERSION or models:/NAME@ALIAS)"),
    ("models:/no-such-model/1", "name=no-such-model, version=1"),
    (f"models:/{REGISTERED}/7", f"name={REGISTERED}, version=7"),
    (f"models:/{REGISTERED}@no-such-alias", "alias no-such-alias not found"),
])
def test_an_mlflow_uri_that_does_not_resolve_is_named_with_the_store(trained, given, reason):
    with pytest.raises(InvalidInputError) as err:
        resolve(trained, given)
    assert f"{given!r} does not resolve in MLflow store {trained.uri}" in str(err.value) and reason in str(err.value)


def test_a_runs_uri_naming_no_model_of_the_run_lists_the_runs_models(trained):
    with pytest.raises(InvalidInputError, match=re.escape(f"run {trained.run_id} logged no model named 'e2e' "
                                                          "(its models: tiny)")):
        resolve(trained, f"runs:/{trained.run_id}/e2e")


def test_a_local_mlflow_store_that_does_not_exist_is_refused_not_created(tmp_path):
    with pytest.raises(InvalidInputError, match="there is no MLflow store at"):
        resolve_model_source("runs:/0123/model", storage_path=tmp_path, tracking_uri=f"sqlite:///{tmp_path}/none.db")
    assert list(tmp_path.iterdir()) == []


def test_an_mlflow_model_logged_without_vitsweeps_weights_files_is_named(trained, monkeypatch):
    run_id = MlflowStore(trained.uri).create_run("vitsweep", "not-vitsweeps").run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", trained.uri)
    with mlflow.start_run(run_id=run_id):
        mlflow.pytorch.log_model(torch.nn.Linear(2, 2), name="model", serialization_format="pickle",
                                 pip_requirements=["torch"])
    with pytest.raises(InvalidInputError, match="MLflow model m-.* was not logged by vitsweep with its weights"):
        resolve(trained, f"runs:/{run_id}/model")


# -- every form starts a run (model.init_from) ------------------------------------------------------------


SOURCE_FORMS = {  # the form as given (built from the trained run), and the weights it must give
    "run_name": (lambda t: "tiny", "final"),
    "run_dir": (lambda t: str(t.run_dir), "final"),
    "checkpoint_dir": (lambda t: str(t.first), "first"),
    "safetensors": (lambda t: str(t.final / WEIGHTS_FILE), "final"),
    "state_dict": (lambda t: str(t.final / "timm_style.pth"), "final"),
    "mlflow_run": (lambda t: f"runs:/{t.run_id}/model", "final"),
    "logged_model": (lambda t: f"models:/{t.model_id}", "final"),
    "registered_version": (lambda t: f"models:/{REGISTERED}/1", "final"),
    "registered_alias": (lambda t: f"models:/{REGISTERED}@champion", "final"),
}


@pytest.mark.parametrize("form", SOURCE_FORMS)
def test_every_source_form_starts_a_model_with_a_new_head_from_its_weights(trained, form):
    from pipeline.trained.transfer import load_initial_weights, resolve_initial_weights

    given, expected = SOURCE_FORMS[form]
    if form == "state_dict":
        torch.save({"state_dict": trained.weights["final"]}, trained.final / "timm_style.pth")
    model = trained.card.model.model_copy(update={"init_from": given(trained)})
    init = resolve_initial_weights(model, 4, str(trained.storage / "finetune"), str(trained.storage), trained.uri)
    assert init.plan.reset.keys() == {"head.weight", "head.bias"} and not init.plan.resampled
    target = build_model(model, 4)
    load_initial_weights(target, init.source.weights, init.plan)
    weights = trained.weights[expected]
    assert all(torch.equal(target.state_dict()[name], weights[name]) for name in init.plan.loaded)
    assert SHARED_CODE in init.plan.loaded and target.head.weight.shape == (4, 128)
    assert init.plan.provenance.given == given(trained) and not (trained.storage / "finetune").exists()


def test_a_run_records_where_its_weights_came_from_with_the_source_model_as_its_input(trained):
    from pipeline.training.runs import record_initial_weights
    from pipeline.trained.transfer import PLAN_ARTIFACT, resolve_initial_weights

    model = trained.card.model.model_copy(update={"init_from": f"models:/{REGISTERED}@champion"})
    init = resolve_initial_weights(model, 4, str(trained.storage / "finetune"), str(trained.storage), trained.uri)
    tracking = MlflowStore(trained.uri).create_run("vitsweep", "finetune")
    record_initial_weights(tracking, init)
    record_initial_weights(tracking, init)  # a restart records nothing twice
    run = tracking.get()
    tags = run.data.tags
    assert (tags["init.source"], tags["init.kind"], tags["init.run_id"], tags["init.model_id"]) == (
        f"models:/{REGISTERED}@champion", "registered_model", trained.run_id, trained.model_id)
    assert tags["init.registered_model"] == f"{REGISTERED}/1@champion" and tags["init.reset"] == "head.bias, head.weight"
    assert tags["init.summary"].startswith(f"models:/{REGISTERED}@champion (run {trained.run_id}, model {REGISTERED} "
                                           "version 1): ")
    assert [model.model_id for model in run.inputs.model_inputs] == [trained.model_id]
    recorded = json.loads(tracking.read_artifact(PLAN_ARTIFACT))
    assert recorded["reset"] == {"head.bias": "classifier, 10 -> 4 classes", "head.weight": "classifier, 10 -> 4 classes"}
    assert set(recorded["loaded"]) == set(init.plan.loaded) and recorded["source"]["model_id"] == trained.model_id


# -- bad input to every command that takes a source: one line, exit 2, nothing written ----------------

JUNK_MLMODELS = {"not YAML": "flavors: [\n", "YAML, not a mapping": "just a string\n",
                 "a mapping without MLflow's keys": "weights: 3\n"}


@pytest.fixture(params=list(JUNK_MLMODELS), ids=list(JUNK_MLMODELS))
def junk_model_directory(request, tmp_path) -> Path:
    """A directory holding an ``MLmodel`` file that MLflow cannot read as a model's description."""
    directory = tmp_path / "junk-model"
    directory.mkdir()
    (directory / "MLmodel").write_text(JUNK_MLMODELS[request.param])
    return directory


@pytest.mark.parametrize("command", [
    ["register", "{source}", "junk"], ["predict", "{source}", "{image}"],
    ["train", "--config", "smoke", "--set", "model.init_from={source}", "--set", "data.prepare=null",
     "--set", "data.train={train}", "--set", "data.val={val}"],
    ["config", "validate", "--config", "smoke", "--set", "model.init_from={source}"]],
    ids=["register", "predict", "train init_from", "config validate"])
def test_a_directory_with_a_junk_mlmodel_is_refused_in_one_line_naming_it(junk_model_directory, tmp_path, command,
                                                                          digits16, capsys):
    from PIL import Image

    storage, image = tmp_path / "runs", tmp_path / "image.png"
    Image.new("RGB", (16, 16)).save(image)
    args = [word.format(source=junk_model_directory, image=image, train=digits16["train"], val=digits16["val"])
            for word in command]
    err = refused_in_process([*args, "--set", f"run.storage_path={storage}"], capsys)
    # vitsweep's own line; a library's "Exception ignored" note from this shared process's GC may sit beside it
    line, = [text for text in err.strip().splitlines() if text.startswith("vitsweep ")]
    assert "Traceback" not in err
    assert str(junk_model_directory) in line and ("is not an MLflow model description" in line
                                                  or "was not logged by vitsweep" in line), line
    assert not storage.exists()  # no store, no run directory


def test_config_validate_resolves_init_from_as_train_does(trained, capsys):
    settings = ["--set", f"run.storage_path={trained.storage}", "--set", f"tracking.mlflow_uri={trained.uri}",
                "--set", "model.args.qkv=fsne", "--set", "model.args.code_size=8"]  # the trained run's model
    assert main(["config", "validate", "--config", "smoke", "--set", "model.init_from=no-such-run", *settings]) == 2
    assert "'no-such-run' does not exist" in capsys.readouterr().err
    assert main(["config", "validate", "--config", "smoke", "--set", f"model.init_from={trained.run_dir}",
                 *settings]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config ok: ") and f"; starts from {trained.run_dir}" in out and "weights loaded" in out


def _special_path(kind: str, directory: Path) -> Path:
    path = directory / kind.replace(" ", "-")
    if kind == "a named pipe (FIFO)":
        os.mkfifo(path)
    elif kind == "a symbolic link that loops":
        path.symlink_to(path.name)
    elif kind == "a symbolic link to nothing":
        path.symlink_to(directory / "missing")
    else:
        return Path("/dev/null")
    return path


@pytest.mark.parametrize("kind", ["a named pipe (FIFO)", "a symbolic link that loops", "a symbolic link to nothing",
                                  "a character device"])
def test_a_path_that_exists_but_is_no_file_or_directory_is_named_as_what_it_is(trained, tmp_path, kind):
    path = _special_path(kind, tmp_path)
    with pytest.raises(InvalidInputError, match=re.escape(f"{str(path)!r} is {kind}, not a file or directory")):
        resolve(trained, str(path))


@pytest.mark.parametrize("name, head, kind", [("photo.png", b"\x89PNG\r\n\x1a\n", "a PNG image"),
                                              ("photo.pt", b"\xff\xd8\xff\xe0", "a JPEG image"),
                                              ("notes.pth", b"weights: none\n", "not a torch file")])
def test_a_file_that_is_no_torch_file_is_named_as_such_not_as_a_pickle(trained, tmp_path, name, head, kind):
    path = tmp_path / name
    path.write_bytes(head + bytes(64))
    with pytest.raises(InvalidInputError, match=re.escape(f"is neither safetensors (by its name) nor a torch file "
                                                          f"({kind})")) as refused:
        resolve(trained, str(path))
    assert "unpickle" not in str(refused.value)


def test_a_runs_initial_weights_from_a_sources_ema_are_the_emas(trained, tmp_path):
    from pipeline.trained.transfer import resolve_initial_weights

    model = trained.card.model.model_copy(update={"init_from": "tiny", "init_ema": True})
    init = resolve_initial_weights(model, len(CLASSES), str(tmp_path / "finetune"), str(trained.storage), trained.uri)
    assert init.source.provenance.ema
    assert_same_weights(init.source.weights, trained.weights["final_ema"])
