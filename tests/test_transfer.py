"""Starting from trained weights: for every family, the classifier starts fresh on a new class count and
a learned position embedding is resampled to a new token grid as timm does; anything else that does not
fit is refused naming it; layer-wise lr decay follows depth; a frozen backbone stays as loaded; the
weights load the same under every ZeRO stage and precision.

Sources here are models built and saved in the test (a ``ModelSource`` as the resolver returns it); every
source form the resolver reads is started from in ``test_model_source.py``.
"""
import dataclasses
import hashlib
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

from pipeline.config.schema import ModelConfig, OptimConfig
from pipeline.config.loading import load_config
from pipeline.errors import ConfigError, InvalidInputError
from pipeline.components.model_card import ModelCard
from pipeline.trained.model_source import ModelSource, Provenance
from pipeline.components.modeling import build_model
from pipeline.components.optim import build_optimizer, build_scheduler
from pipeline.trained.transfer import (InitialWeights, TransferPlan, fill_template, freeze_backbone,
    load_initial_weights, plan_transfer, read_saved_source, read_saved_weights, resolve_initial_weights, save_source,
    saved_initial_weights, saved_source_header, shapes_of, sweep_source_location, train_head_only)

# One small member of each family: (model name, args, its img_size, the weights its classifier has).
FAMILIES = {
    "xcit": ("xcit_nano_12_p8", {"depth": 2}, 16, {"head.weight", "head.bias"}),
    "vit": ("vit_mini_p4", {"depth": 2, "embed_dim": 40, "num_heads": 4}, 16, {"head.weight", "head.bias"}),
    "armour": ("armour_tiny", {"depth": 2}, 32, {"head.weight", "head.bias"}),
    "eit": ("eit3_1_4_mini", {"depth": 2, "embed_dim": 40, "num_heads": 4}, 16, {"head.weight", "head.bias"}),
    "sot": ("sot_7layer", {"depth": 2}, 32,
            {"head.cls_fc.weight", "head.cls_fc.bias", "head.word_fc.weight", "head.word_fc.bias"}),
    "xcit-sot-late": ("xcit_nano_12_p8", {"depth": 2, "head": "sot", "fusion": "late", "mgcrp_m": 4}, 16,
                      {"head.cls_fc.weight", "head.cls_fc.bias", "head.word_fc.weight", "head.word_fc.bias"}),
    "vit-sot-concat": ("vit_mini_p4", {"depth": 2, "embed_dim": 40, "num_heads": 4, "head": "sot",
                                       "fusion": "concat", "mgcrp_m": 4}, 16, {"head.fc.weight", "head.fc.bias"}),
}
# Families with a learned absolute position embedding (SoT's default is a fixed sinusoid table).
LEARNED_POSITIONS = {"vit": {}, "armour": {}, "eit": {}, "sot": {"pos_embed": "learn"}}


def model_config(family: str, img_size: int | None = None, **fields) -> ModelConfig:
    name, args, size, _ = FAMILIES[family]
    return ModelConfig(name=name, args={**args, **fields.pop("args", {})}, img_size=img_size or size, **fields)


def trained_source(model: ModelConfig, num_classes: int = 10, card: bool = True, seed: int = 0) -> ModelSource:
    """A model's weights as a resolved source: random, but not the target's initialisation; a tensor shared
    between blocks (F-SNE's codes) under each of its names, as the resolver gives it."""
    torch.manual_seed(seed)
    weights = {name: tensor.detach() for name, tensor in build_model(model, num_classes).state_dict().items()}
    return ModelSource(weights, ModelCard(model=model, num_classes=num_classes) if card else None,
                       Provenance("pretrained", "run_name", "/runs/pretrained/model.safetensors", run_id="r1",
                                  model_id="m-1"))


def start(source: ModelSource, model: ModelConfig, num_classes: int, seed: int = 1):
    """The target model, freshly initialised and then started from ``source``: (model, its fresh init, plan)."""
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, num_classes)
    torch.manual_seed(seed)
    target = build_model(model, num_classes)
    fresh = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    load_initial_weights(target, source.weights, plan)
    return target, fresh, plan


def with_source(model: ModelConfig) -> ModelConfig:
    """``model`` as a config starting from the source named ``pretrained``."""
    return model.model_copy(update={"init_from": "pretrained"})


# -- what carries over -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_class_count_starts_exactly_the_classifier_afresh_and_loads_the_rest(family):
    model = with_source(model_config(family))
    source = trained_source(model, num_classes=10)
    target, fresh, plan = start(source, model, num_classes=5)
    classifier = FAMILIES[family][3]
    assert set(plan.reset) == set(plan.fresh) == classifier
    assert all(reason == "classifier, 10 -> 5 classes" for reason in plan.reset.values())
    state = target.state_dict()
    for name in classifier:
        torch.testing.assert_close(state[name], fresh[name], rtol=0, atol=0, msg=name)  # the model's own init
        assert state[name].shape[0] == 5
    assert set(plan.loaded) == state.keys() - classifier
    for name in plan.loaded:
        torch.testing.assert_close(state[name], source.weights[name], rtol=0, atol=0, msg=name)
    assert target.eval()(torch.randn(2, 3, model.img_size, model.img_size)).shape == (2, 5)


@pytest.mark.parametrize("family", LEARNED_POSITIONS)
def test_a_new_resolution_resamples_the_learned_position_embedding_as_timm_does(family):
    args = LEARNED_POSITIONS[family]
    size = FAMILIES[family][2]
    source = trained_source(model_config(family, args=args))
    model = with_source(model_config(family, img_size=2 * size, args=args))
    target, _, plan = start(source, model, num_classes=10)
    (name, (old, new, prefix)), = plan.resampled.items()
    assert name == "pos_embed" and prefix == 1 and new == (2 * old[0], 2 * old[1])
    assert not plan.reset and set(plan.loaded) == target.state_dict().keys() - {"pos_embed"}
    table = target.pos_embed.detach()
    assert table.shape[1] == 1 + new[0] * new[1]
    torch.testing.assert_close(table, resample_abs_pos_embed(source.weights["pos_embed"], list(new), list(old), 1))
    torch.testing.assert_close(table[:, 0], source.weights["pos_embed"][:, 0])  # the class token's, as it was
    assert f"pos_embed: {old[0]}x{old[1]} -> {new[0]}x{new[1]} tokens" in plan.summary()


def test_a_distillation_tokens_position_row_is_kept_beside_the_class_tokens_at_a_new_resolution():
    # DeiT with the distillation token: 2 prefix rows (class, distillation) before the 4 x 4 grid
    small = ModelConfig(name="deit_tiny_distilled_p16", args={"patch_size": 4, "depth": 1}, img_size=16)
    source = trained_source(small)
    target, _, plan = start(source, with_source(small.model_copy(update={"img_size": 32})), num_classes=10)
    assert plan.resampled == {"pos_embed": ((4, 4), (8, 8), 2)}
    table = target.pos_embed.detach()
    torch.testing.assert_close(table, resample_abs_pos_embed(source.weights["pos_embed"], [8, 8], [4, 4], 2))
    torch.testing.assert_close(table[:, :2], source.weights["pos_embed"][:, :2])  # both tokens' rows, as they were
    assert {"dist_token", "head_dist.weight"} <= set(plan.loaded)


def test_xcit_takes_every_weight_at_a_new_resolution_its_fourier_encoding_and_conv_stem_included():
    source = trained_source(model_config("xcit"))
    target, _, plan = start(source, with_source(model_config("xcit", img_size=48)), num_classes=10)
    assert not plan.reset and not plan.resampled and set(plan.loaded) == target.state_dict().keys()
    assert {"pos_embed.token_projection.weight", "patch_embed.proj.0.0.weight"} <= set(plan.loaded)


def test_sots_fixed_sinusoid_table_is_rebuilt_for_a_new_grid_not_interpolated():
    from models.sot import sinusoid_position_table

    source = trained_source(model_config("sot"))
    target, _, plan = start(source, with_source(model_config("sot", img_size=64)), num_classes=10)
    assert plan.reset == {"pos_embed": "fixed position table, rebuilt for 4x4 -> 8x8 tokens"}
    torch.testing.assert_close(target.pos_embed.detach(), sinusoid_position_table(65, target.embed_dim))


def test_a_bare_weights_file_resamples_from_the_square_grid_its_table_holds():
    source = trained_source(model_config("vit"), card=False)
    _, _, plan = start(source, with_source(model_config("vit", img_size=24)), num_classes=3)
    assert plan.resampled == {"pos_embed": ((4, 4), (6, 6), 1)}
    assert plan.reset == {"head.weight": "classifier, 10 -> 3 classes", "head.bias": "classifier, 10 -> 3 classes"}


# -- what does not -------------------------------------------------------------------------------------------


def test_weights_that_do_not_fit_are_refused_naming_each_with_both_shapes():
    source = trained_source(model_config("vit"))
    model = with_source(model_config("vit", args={"mlp_ratio": 2.0, "depth": 3}))  # 6 shapes differ, 12 new
    with pytest.raises(InvalidInputError) as refused:
        plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)
    message = str(refused.value)
    assert "model.init_from='pretrained' (trained as vit_mini_p4) does not fit model.name='vit_mini_p4'" in message
    assert "blocks.0.mlp.fc1.weight: source [160, 40] vs model [80, 40]" in message
    assert "blocks.2.attn.proj.bias [40]: the source has no such weight" in message
    assert "18 weight(s) cannot be taken" in message and "... and 6 more" in message and "model.init_exclude" in message


def test_a_weight_only_the_source_has_is_refused():
    source = trained_source(model_config("vit", args={"depth": 3}))
    with pytest.raises(InvalidInputError, match=r"blocks\.2\.attn\.qkv\.weight \[120, 40\]: the model has no such"):
        plan_transfer(shapes_of(source.weights), source.card, source.provenance, with_source(model_config("vit")), 10)


def test_init_exclude_starts_the_matching_weights_afresh_on_purpose():
    source = trained_source(model_config("vit"))
    model = with_source(model_config("vit")).model_copy(update={"init_exclude": ("head.*", "blocks.1.*")})
    target, fresh, plan = start(source, model, num_classes=10)  # the same class count: the head would load
    assert not plan.reset and all(name.startswith(("head.", "blocks.1.")) for name in plan.excluded)
    assert set(plan.fresh) == set(plan.excluded) and "head.weight" in plan.fresh
    for name in plan.fresh:
        torch.testing.assert_close(target.state_dict()[name], fresh[name], rtol=0, atol=0)


def test_an_exclude_glob_that_matches_no_weight_is_refused_as_a_likely_typo():
    source = trained_source(model_config("vit"))
    model = with_source(model_config("vit")).model_copy(update={"init_exclude": ("haed.*",)})
    with pytest.raises(InvalidInputError, match="model.init_exclude 'haed.\\*' matches no weight"):
        plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)


def test_init_options_without_a_source_are_refused():
    with pytest.raises(ConfigError, match="model.init_from, which is not set"):
        load_config("smoke", ["model.init_exclude=[head.*]"])


# -- layer-wise learning-rate decay ---------------------------------------------------------------------------


def _lr_scales(model, layer_decay: float) -> dict[str, float]:
    optimizer = build_optimizer(model, OptimConfig(layer_decay=layer_decay), lr=1e-3)
    return {name: group["lr"] / 1e-3 for group in optimizer.param_groups for name, p in model.named_parameters()
            if any(p is q for q in group["params"])}


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_decay_learning_rates_grow_with_depth_to_the_full_rate_at_the_head(family):
    model = build_model(model_config(family, args={"depth": 3}), 10)
    scales = _lr_scales(model, layer_decay=0.5)
    block_scale = {}
    for name, scale in scales.items():
        if name.startswith("blocks."):
            block_scale.setdefault(int(name.split(".")[1]), set()).add(scale)
    assert all(len(found) == 1 for found in block_scale.values()), block_scale  # one rate per block
    depth_order = [min(scales[n] for n in scales if n.startswith(("patch_embed", "cls_token")))]
    depth_order += [block_scale[index].pop() for index in sorted(block_scale)]
    depth_order += [max(scale for name, scale in scales.items() if name.startswith("head."))]
    assert depth_order == sorted(depth_order) and len(set(depth_order)) == len(depth_order), depth_order
    assert depth_order[-1] == 1.0 and all(math.isclose(b / a, 2.0) for a, b in zip(depth_order[1:3], depth_order[2:4]))


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_decay_keeps_the_same_weights_exempt_from_weight_decay_and_decays_the_rest_at_the_configs_rate(family):
    model = build_model(model_config(family), 10)
    decays = {g["weight_decay"] for g in build_optimizer(model, OptimConfig(layer_decay=0.75, weight_decay=0.123),
                                                         lr=1e-3).param_groups}
    assert decays == {0.0, 0.123}

    def exempt(cfg: OptimConfig) -> set[str]:
        groups = build_optimizer(model, cfg, lr=1e-3).param_groups
        return {name for name, p in model.named_parameters() for g in groups
                if g["weight_decay"] == 0 and any(p is q for q in g["params"])}

    assert exempt(OptimConfig(layer_decay=0.75)) == exempt(OptimConfig()) != set()


def test_the_schedule_scales_every_layers_rate_alike():
    model = build_model(model_config("vit"), 10)
    cfg = OptimConfig(lr=1e-3, layer_decay=0.5, epochs=2, schedule={"warmup_epochs": 1})
    optimizer = build_optimizer(model, cfg, lr=1e-3)
    before = [group["lr"] for group in optimizer.param_groups]
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=10)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    after = [group["lr"] for group in optimizer.param_groups]
    ratios = [a / b for a, b in zip(after, before)]
    assert len(set(before)) > 2 and max(ratios) - min(ratios) < 1e-12 and ratios[0] != 1.0


# -- a frozen backbone; every ZeRO stage and precision -------------------------------------------------------


def _engine(model, cfg_overrides: list[str]):
    import deepspeed

    from pipeline.components.engine import deepspeed_config

    cfg = load_config("smoke", ["scaling.num_workers=1", *cfg_overrides])
    optimizer = build_optimizer(model, cfg.optim, lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, 1),
                                           dist_init_required=False)
    return engine


def test_a_frozen_backbone_receives_no_update_and_keeps_its_batchnorm_statistics(single_process_group):
    model = with_source(model_config("xcit"))  # XCiT: BatchNorm in its conv stem and every LPI
    target, _, _ = start(trained_source(model), model, num_classes=4)
    freeze_backbone(target)
    backbone = {name: tensor.clone() for name, tensor in target.state_dict().items() if not name.startswith("head.")}
    head = target.head.weight.detach().clone()
    groups = build_optimizer(target, OptimConfig(), lr=1e-3).param_groups
    trained = {id(p) for group in groups for p in group["params"]}
    assert trained == {id(p) for p in target.head.parameters()}
    engine = _engine(target, ["deepspeed.zero_stage=1"])
    for _ in range(2):
        engine.train()
        train_head_only(engine.module)
        engine.backward(F.cross_entropy(engine(torch.randn(4, 3, 16, 16)), torch.arange(4)))
        engine.step()
    state = engine.module.state_dict()
    for name, tensor in backbone.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(engine.module.head.weight.detach(), head)


@pytest.mark.parametrize("name, args", [("deit_tiny_distilled_p16", {"patch_size": 4}),
                                        ("xcit_nano_12_distilled_p16", {"patch_size": 8})], ids=["deit", "xcit"])
def test_a_linear_probe_of_a_model_with_the_distillation_token_trains_both_heads_and_nothing_else(name, args):
    model = timm.create_model(name, img_size=16, depth=1, num_classes=4, **args)
    freeze_backbone(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    train_head_only(model)
    assert model.head.training and model.head_dist.training and not model.blocks.training
    # the heads train as they do in a whole model's training: the distillation head's logits apart, for the teacher
    from models.layers.heads import DistilledLogits

    assert isinstance(model(torch.randn(2, 3, 16, 16)), DistilledLogits)


@pytest.mark.parametrize("stage, precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_initial_weights_load_the_same_under_every_zero_stage_and_precision(single_process_group, stage, precision):
    import deepspeed

    source = trained_source(model_config("vit"))
    model = with_source(model_config("vit", img_size=24))
    target, _, plan = start(source, model, num_classes=3)
    expected = {name: tensor.clone() for name, tensor in target.named_parameters()}
    engine = _engine(target, [f"deepspeed.zero_stage={stage}", f"deepspeed.precision={precision}"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    parameters = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(parameters.values()), enabled=stage == 3):
        for name, tensor in expected.items():
            torch.testing.assert_close(parameters[name].detach(), tensor.to(dtype), rtol=0, atol=0, msg=name)
    assert plan.resampled and plan.reset  # a resampled embedding and a new head went through DeepSpeed too


# -- saved sources, templates, restarts ----------------------------------------------------------------------


def test_a_saved_source_keeps_its_weights_card_and_provenance_locally_and_at_a_uri(tmp_path):
    model = ModelConfig(name="xcit_nano_12_p8", args={"depth": 2, "qkv": "fsne", "code_size": 8}, img_size=16)
    source = trained_source(model)
    shared = ("blocks.0.attn.qkv.codes.q", "blocks.1.attn.qkv.codes.q")
    assert source.weights[shared[0]].data_ptr() == source.weights[shared[1]].data_ptr()
    for location in (str(tmp_path / "local" / "init.safetensors"), f"file://{tmp_path}/uri/init.safetensors"):
        save_source(source, location)
        back = read_saved_source(location)
        assert back.card == source.card and back.provenance == source.provenance
        assert back.weights.keys() == source.weights.keys()
        assert all(torch.equal(back.weights[name], tensor) for name, tensor in source.weights.items())
        shapes, card, provenance = saved_source_header(location)
        assert shapes == shapes_of(source.weights) and card == source.card and provenance == source.provenance


def test_a_knob_names_the_trials_source_through_a_template():
    tree = {"model": {"args": {"qkv": "fsne", "code_size": 16}}}
    assert fill_template("models:/xcit_{model.args.qkv}_{model.args.code_size}@pretrained", tree) == \
        "models:/xcit_fsne_16@pretrained"
    assert fill_template("plain-run", tree) == "plain-run" and fill_template(None, tree) is None
    with pytest.raises(ConfigError, match=r"\{model.args.depth\} names no value"):
        fill_template("xcit_{model.args.depth}", tree)


def test_a_restarted_run_starts_from_the_source_it_saved_even_when_the_original_is_gone(tmp_path):
    model = with_source(model_config("vit"))
    original = trained_source(model)
    run_dir = tmp_path / "runs" / "finetune"
    first = InitialWeights(plan_transfer(shapes_of(original.weights), original.card, original.provenance, model, 5),
                           str(run_dir / "init_source.safetensors"), original)
    first.save()
    again = resolve_initial_weights(model.model_copy(update={"init_from": "gone-by-now"}), 5, str(run_dir),
                                    str(tmp_path / "runs"), "sqlite:///unused.db")
    assert again.plan == first.plan and again.source.provenance == original.provenance
    assert json.loads(json.dumps(again.for_workers()))["plan"]["reset"] == {"head.bias": "classifier, 10 -> 5 classes",
                                                                           "head.weight": "classifier, 10 -> 5 classes"}


# -- runs and sweeps: every source checked before anything starts ------------------------------------------


def _smoke_weights(path, depth: int) -> str:
    """A bare safetensors file of the smoke model at ``depth`` (the resolver's ``safetensors`` form)."""
    from safetensors.torch import save_file

    model = build_model(load_config("smoke", [f"model.args.depth={depth}"]).model, 10)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(path))
    return str(path)


def _data(tmp_path, digits16) -> list[str]:
    return [f"run.storage_path={tmp_path / 'runs'}", f"data.train={digits16['train']}", f"data.val={digits16['val']}",
            "data.prepare=null"]


def test_a_run_whose_source_does_not_fit_is_refused_before_any_worker_naming_the_weights(tmp_path, digits16):
    from pipeline.training.runs import check_run

    source = _smoke_weights(tmp_path / "deeper.safetensors", depth=3)
    with pytest.raises(InvalidInputError) as refused:  # the CLI's exit 2
        check_run(load_config("smoke", [*_data(tmp_path, digits16), f"model.init_from={source}"]))
    assert "blocks.2.attn.qkv.weight [384, 128]: the model has no such weight" in str(refused.value)
    assert not (tmp_path / "runs").exists()


def test_a_checked_run_starts_from_its_source_and_writes_it_only_at_launch(tmp_path, digits16):
    from pipeline.training.runs import check_run

    source = _smoke_weights(tmp_path / "same.safetensors", depth=2)
    run = check_run(load_config("smoke", [*_data(tmp_path, digits16), f"model.init_from={source}", "run.name=ft"]))
    assert run.init.plan.provenance.kind == "safetensors" and not run.init.plan.reset
    assert not (tmp_path / "runs" / "ft").exists()
    run.init.save()
    assert saved_source_header(run.init.location)[0] == shapes_of(run.init.source.weights)
    assert run.init.location == str(tmp_path / "runs" / "ft" / "init_source.safetensors")


def _sweep(tmp_path, digits16, space: str, *overrides: str):
    from pipeline.sweeps.runner import prepare_sweep

    (tmp_path / "space.yaml").write_text(space)
    return prepare_sweep("smoke", [*_data(tmp_path, digits16), "tune.scheduler=fifo", *overrides],
                         [str(tmp_path / "space.yaml")])


def test_a_sweep_resolves_every_trials_source_before_it_starts(tmp_path, digits16):
    from pipeline.sweeps.spaces import SpaceError

    good = _smoke_weights(tmp_path / "good.safetensors", depth=2)
    space = f"params:\n  model.init_from: {{values: [{good}, {tmp_path / 'missing.safetensors'}, null]}}\n"
    with pytest.raises(SpaceError) as refused:
        _sweep(tmp_path, digits16, space)
    assert f"trials with model.init_from='{tmp_path / 'missing.safetensors'}'" in str(refused.value)
    assert "does not exist" in str(refused.value) and not (tmp_path / "runs").exists()


def test_a_knob_chooses_each_trials_source_and_each_is_fitted_to_its_trials_model(tmp_path, digits16):
    from pipeline.sweeps.spaces import SpaceError

    for depth in (1, 2):
        _smoke_weights(tmp_path / f"depth{depth}.safetensors", depth=depth)
    space = (f"fixed:\n  model.init_from: '{tmp_path}/depth{{model.args.depth}}.safetensors'\n"
             "params:\n  model.args.depth: {values: [1, 2]}\n")
    sweep = _sweep(tmp_path, digits16, space)
    assert sorted(sweep.sources) == [(f"{tmp_path}/depth{depth}.safetensors", False) for depth in (1, 2)]
    (tmp_path / "depth2.safetensors").write_bytes((tmp_path / "depth1.safetensors").read_bytes())
    with pytest.raises(SpaceError, match=r"(?s)trials with model.args.depth=2: .*blocks\.1\..*the source has no such"):
        _sweep(tmp_path, digits16, space)


def test_the_finetune_presets_hold_the_papers_printed_settings():
    paper_000 = load_config("finetune")  # §5.3: lr 5e-5, 1,000 epochs, XCiT-N12 at 224 px, XCiT's recipe
    assert (paper_000.model.name, paper_000.model.img_size, paper_000.optim.lr, paper_000.optim.epochs) == (
        "xcit_nano_12_p16", 224, 5e-5, 1000)
    assert paper_000.data.val_crop_ratio == 1.0 and paper_000.optim.weight_decay == 0.05 and paper_000.model.init_from
    paper_003 = load_config("finetune_384")  # @384/8, "fine-tuned and tested at resolution 384x384"
    assert (paper_003.model.name, paper_003.model.img_size, paper_003.data.val_crop_ratio) == (
        "xcit_nano_12_p8", 384, 1.0)
    assert (paper_003.optim.lr, paper_003.optim.weight_decay, paper_003.optim.epochs,
            paper_003.optim.schedule.name) == (5e-6, 1e-8, 30, "constant")


def test_long_lists_of_weights_stay_within_mlflows_tag_limit_and_whole_in_the_artifact(tmp_path):
    from pipeline.training.runs import record_initial_weights
    from pipeline.tracking.store import MlflowStore

    model = with_source(model_config("vit", args={"depth": 40})).model_copy(update={"init_exclude": ("blocks.*",)})
    source = trained_source(model.model_copy(update={"init_exclude": ()}))
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)
    assert len(", ".join(plan.excluded)) > 8000  # MLflow's limit for a tag's value
    tracking = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db").create_run("vitsweep", "finetune")
    record_initial_weights(tracking, InitialWeights(plan, str(tmp_path / "init_source.safetensors")))
    assert tracking.tags["init.excluded"].endswith("... (see init_weights.json)")
    assert len(json.loads(tracking.read_artifact("init_weights.json"))["excluded"]) == len(plan.excluded) == 480


# -- the plan's record, as workers and sweeps read it -------------------------------------------------------


def test_a_plan_read_back_from_its_record_is_the_plan_every_fate_included():
    source = trained_source(model_config("vit"))
    model = with_source(model_config("vit", img_size=24)).model_copy(update={"init_exclude": ("blocks.1.*",)})
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 3)
    assert plan.reset and plan.resampled and plan.excluded and plan.fresh  # every kind of fate present
    record = json.loads(json.dumps(plan.as_dict()))  # as the workers get it
    assert TransferPlan.from_dict(record) == plan
    weights = InitialWeights(plan, "/runs/finetune/init_source.safetensors").for_workers()
    assert weights == {"location": "/runs/finetune/init_source.safetensors", "plan": plan.as_dict()}


def test_the_summary_groups_the_reset_weights_by_their_reason():
    source = trained_source(model_config("sot", args={"pos_embed": "learn"}))
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance,
                         with_source(model_config("sot", args={"pos_embed": "learn"})), 5)
    # every weight of the source but the 4 of the two classifiers loads
    assert plan.summary() == (f"pretrained (run r1): {len(source.weights) - 4} weights loaded, 4 reset "
                              "(head.cls_fc.bias, head.cls_fc.weight, head.word_fc.bias, head.word_fc.weight: "
                              "classifier, 10 -> 5 classes)")
    reasons = {"a.weight": "one", "b.weight": "two", "a.bias": "one"}
    from pipeline.trained.transfer import _grouped
    assert _grouped(reasons) == "a.weight, a.bias: one; b.weight: two"


@pytest.mark.parametrize("tokens, prefix, grid", [(17, 1, (4, 4)), (16, 0, (4, 4)), (18, 1, None), (1, 1, None),
                                                  (38, 2, (6, 6))])
def test_a_card_less_sources_grid_is_the_square_its_token_count_makes_past_the_prefix(tokens, prefix, grid):
    from pipeline.trained.transfer import _source_grid

    assert _source_grid((1, tokens, 8), None, prefix) == grid


def test_a_carded_sources_grid_is_its_own_models_whatever_its_token_count():
    from pipeline.trained.transfer import _source_grid

    card = ModelCard(model=model_config("vit", img_size=24), num_classes=10)  # 6 x 6 patches of 4 px
    assert _source_grid((1, 37, 40), card, 1) == (6, 6)
    xcit = ModelCard(model=model_config("xcit"), num_classes=10)  # no position table: the token count decides
    assert _source_grid((1, 17, 40), xcit, 1) == (4, 4)


def test_a_sweeps_trial_starts_from_the_file_its_sweep_saved_fitted_from_its_header_alone(tmp_path):
    model = with_source(model_config("vit"))
    source = trained_source(model)
    directory = str(tmp_path / "sweep" / "init_sources")
    location = sweep_source_location(directory, "pretrained", False)
    assert location.startswith(directory + "/") and location.endswith(".safetensors")
    assert len({location, sweep_source_location(directory, "pretrained", True),
                sweep_source_location(directory, "pretrained-2", False)}) == 3  # one file per source and EMA choice
    assert sweep_source_location(directory, "pretrained", False) == location
    # the name a resumed sweep looks for, whichever vitsweep saved it: 16 hex digits of SHA-256, by hand
    digest = hashlib.sha256("pretrained\nFalse".encode()).hexdigest()[:16]
    assert location == f"{directory}/{digest}.safetensors"
    save_source(source, location)
    trial = saved_initial_weights(location, model, 5)
    assert trial.location == location and trial.source is None  # the workers read the file itself
    assert trial.plan == plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 5)


def test_a_run_restarted_under_its_name_keeps_the_file_it_started_from(tmp_path):
    model = with_source(model_config("vit"))
    first, second = trained_source(model, seed=0), trained_source(model, seed=1)
    location = str(tmp_path / "run" / "init_source.safetensors")
    plan = plan_transfer(shapes_of(first.weights), first.card, first.provenance, model, 10)
    InitialWeights(plan, location, first).save()
    written = (tmp_path / "run" / "init_source.safetensors").read_bytes()
    InitialWeights(plan, location, second).save()  # the restart: its resolved source is not written over it
    InitialWeights(plan, str(tmp_path / "none.safetensors")).save()  # nothing to write: the file is the workers'
    assert (tmp_path / "run" / "init_source.safetensors").read_bytes() == written
    assert not (tmp_path / "none.safetensors").exists()


def test_saved_weights_that_are_missing_truncated_or_not_vitsweeps_are_refused_naming_the_file(tmp_path):
    from safetensors.torch import save_file

    missing = str(tmp_path / "missing.safetensors")
    with pytest.raises(InvalidInputError, match=f"^the saved initial weights {missing} are missing$"):
        read_saved_weights(missing)
    with pytest.raises(InvalidInputError, match=f"^the saved initial weights {missing} are missing or truncated$"):
        saved_source_header(missing)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(b"\x10\x00\x00")
    with pytest.raises(InvalidInputError, match="are missing or truncated"):
        saved_source_header(str(truncated))
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(InvalidInputError, match=f"^{foreign} was not written by vitsweep's save_source"):
        saved_source_header(str(foreign))


# -- what the plan says, every part of it ------------------------------------------------------------------

def test_the_plans_summary_reads_whole_every_part_named():
    provenance = Provenance("models:/digits@champion", "registered_model", "/x", ema=True, run_id="r7",
                            registered_name="digits", registered_version="3")
    plan = TransferPlan(dataclasses.asdict(provenance), "vit_mini_p4", ("a", "b"),
                        reset={"head.weight": "classifier, 10 -> 5 classes"},
                        resampled={"pos_embed": ((4, 4), (6, 6), 1), "dist_embed": ((2, 3), (3, 3), 0)},
                        excluded=("blocks.1.x",), fresh=("head.weight", "blocks.1.x"))
    assert plan.summary() == (
        "models:/digits@champion (run r7, model digits version 3, EMA): 2 weights loaded, 1 reset (head.weight: "
        "classifier, 10 -> 5 classes), 2 resampled (pos_embed: 4x4 -> 6x6 tokens, dist_embed: 2x3 -> 3x3 tokens), "
        "1 excluded by model.init_exclude")
    bare = TransferPlan(dataclasses.asdict(Provenance("best.safetensors", "safetensors", "/x")), None, ("a",))
    assert bare.summary() == "best.safetensors: 1 weights loaded"


class _Embedded(torch.nn.Module):
    """A module with a position table and (or) a patch embedding whose grid the test chooses."""

    def __init__(self, table: torch.Tensor | None, grid: tuple[int, int] | None, learned: bool = True):
        super().__init__()
        if table is not None:
            self.pos_embed = torch.nn.Parameter(table, requires_grad=learned) if learned is not None else table
        if grid is not None:
            self.patch_embed = torch.nn.Module()
            self.patch_embed.grid_size = grid


@pytest.mark.parametrize("module, found", [
    (_Embedded(torch.zeros(1, 7, 8), (2, 3)), ((2, 3), 1, True)),  # 6 patches of a 2 x 3 grid and a class token
    (_Embedded(torch.zeros(1, 6, 8), (2, 3), learned=False), ((2, 3), 0, False)),  # a fixed table
    (_Embedded(None, (2, 3)), None),  # no table (XCiT)
    (_Embedded(torch.zeros(1, 7, 8), None), None),  # no patch grid to say where it sits
    (_Embedded(torch.zeros(7, 8), (2, 3)), None),  # not a [1, tokens, width] table
])
def test_a_position_embedding_is_a_3d_parameter_over_the_patch_grid_with_its_prefix_tokens(module, found):
    from pipeline.trained.transfer import _PositionEmbedding, _position_embedding

    assert _position_embedding(module) == (None if found is None else _PositionEmbedding(*found))


def test_a_plain_tensor_attribute_is_no_position_embedding():
    from pipeline.trained.transfer import _position_embedding

    module = _Embedded(None, (2, 3))
    module.pos_embed = torch.zeros(1, 7, 8)  # a tensor, not a parameter: nothing loads into it
    assert _position_embedding(module) is None


def test_a_carded_sources_grid_is_its_models_even_where_the_token_count_would_say_another():
    from pipeline.trained.transfer import _source_grid

    card = ModelCard(model=model_config("vit", img_size=24), num_classes=10)  # 6 x 6 patches
    assert _source_grid((1, 17, 40), card, 1) == (6, 6)
    assert _source_grid((1, 17, 40), None, 1) == (4, 4)


def test_a_single_class_head_starts_afresh_like_any_other_count():
    source = trained_source(model_config("vit"))
    _, _, plan = start(source, with_source(model_config("vit")), num_classes=1)
    assert plan.reset == {"head.weight": "classifier, 10 -> 1 classes", "head.bias": "classifier, 10 -> 1 classes"}
    assert plan.source_model == "vit_mini_p4"


def test_weights_only_the_source_has_may_be_excluded_on_purpose():
    source = trained_source(model_config("vit", args={"depth": 3}))
    model = with_source(model_config("vit")).model_copy(update={"init_exclude": ("blocks.2.*",)})
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)
    assert plan.excluded and all(name.startswith("blocks.2.") for name in plan.excluded)
    assert not plan.fresh  # the model has none of them: nothing of its own stays fresh


def test_a_position_table_of_another_width_is_named_with_both_shapes_and_what_would_fit():
    source = trained_source(model_config("vit"))  # width 40
    model = with_source(model_config("vit", args={"embed_dim": 48})).model_copy(update={"init_exclude": (
        "blocks.*", "cls_token", "norm.*", "patch_embed.*", "head.*")})  # all but the position table set aside
    with pytest.raises(InvalidInputError) as refused:
        plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)
    assert str(refused.value) == (
        "model.init_from='pretrained' (trained as vit_mini_p4) does not fit model.name='vit_mini_p4' with "
        "model.args={'depth': 2, 'embed_dim': 48, 'num_heads': 4}: 1 weight(s) cannot be taken:\n"
        "  pos_embed: source [1, 17, 40] vs model [1, 17, 48] (not the same embedding width and 1 prefix token(s) "
        "over a patch grid)\n"
        "  Leave weights at their fresh initialisation on purpose with model.init_exclude (fnmatch globs, e.g. "
        "['head.*'])")


def test_exactly_as_many_misfits_as_are_shown_are_all_shown_and_a_bare_file_is_not_said_to_be_a_model():
    source = trained_source(model_config("vit", args={"depth": 4}), card=False)
    # a narrower MLP: each of the 4 blocks' fc1.weight, fc1.bias and fc2.weight differ, 12 weights, as many as shown
    model = with_source(model_config("vit", args={"depth": 4, "mlp_ratio": 2.0}))
    with pytest.raises(InvalidInputError) as refused:
        plan_transfer(shapes_of(source.weights), source.card, source.provenance, model, 10)
    message = str(refused.value)
    assert message.startswith("model.init_from='pretrained' does not fit model.name='vit_mini_p4'")
    assert "12 weight(s) cannot be taken" in message and "more" not in message
    assert message.count("\n  ") == 12 + 1
    lines = message.split("\n  ")
    assert all(line.startswith("blocks.") and ": source [" in line for line in lines[1:13]), lines  # one misfit a line
    assert lines[13].startswith("Leave weights at their fresh initialisation")


def test_weights_planned_for_another_model_are_refused_naming_what_is_missing(tmp_path):
    source = trained_source(model_config("vit"))
    plan = plan_transfer(shapes_of(source.weights), source.card, source.provenance, with_source(model_config("vit")), 10)
    deeper = build_model(model_config("vit", args={"depth": 3}), 10)
    with pytest.raises(RuntimeError) as refused:
        load_initial_weights(deeper, source.weights, plan)
    missing = sorted(name for name in deeper.state_dict() if name.startswith("blocks.2."))
    assert str(refused.value) == (f"the initial weights of 'pretrained' do not fit the model they were planned for: "
                                  f"missing {missing}, unexpected []")


def test_a_saved_sources_broken_card_is_named_with_its_file(tmp_path):
    from safetensors.torch import save

    location = tmp_path / "broken.safetensors"
    provenance = json.dumps(dataclasses.asdict(Provenance("pretrained", "run_name", "/x")))
    location.write_bytes(save({"w": torch.zeros(2)}, metadata={"vitsweep.provenance": provenance,
                                                                 "vitsweep.card": json.dumps({"model": 5})}))
    with pytest.raises(InvalidInputError, match=str(location)):
        saved_source_header(str(location))
