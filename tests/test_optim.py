"""AdamW groups skip decay where the recipe says so; the lr follows warmup then cosine, per step."""
import pytest
import timm
import torch

import models  # noqa: F401
from pipeline.config.schema import OptimConfig, ScheduleConfig
from pipeline.components.lr_scaling import effective_lr
from pipeline.components.optim import build_optimizer, build_scheduler, lr_at


def _decayed_names(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}


def test_norms_biases_temperatures_and_position_embeddings_are_not_decayed():
    model = timm.create_model("xcit_nano_12_p16", img_size=32, num_classes=10)
    decayed = _decayed_names(model, build_optimizer(model, OptimConfig(weight_decay=0.05), lr=5e-4))
    assert decayed, "the weight matrices must decay"
    for name in decayed:
        assert not any(part in name for part in ("norm", "bias", "temperature", "pos_embed", "cls_token")), name


# XCiT-N12's decayed parameters, name by name: every matrix and convolution kernel of every block,
# class-attention block, the conv stem and the head; nothing else.
XCIT_BLOCK_WEIGHTS = ("attn.qkv", "attn.proj", "local_mp.conv1", "local_mp.conv2", "mlp.fc1", "mlp.fc2")
CLASS_ATTENTION_WEIGHTS = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc1", "mlp.fc2")


def test_every_block_weight_decays_by_the_configured_amount_and_nothing_else_does():
    model = timm.create_model("xcit_nano_12_p16", img_size=32, num_classes=10)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.05), lr=5e-4)
    expected = ({f"blocks.{i}.{w}.weight" for i in range(12) for w in XCIT_BLOCK_WEIGHTS}
                | {f"cls_attn_blocks.{i}.{w}.weight" for i in range(2) for w in CLASS_ATTENTION_WEIGHTS}
                | {f"patch_embed.proj.{i}.0.weight" for i in (0, 2, 4, 6)} | {"head.weight"})
    assert _decayed_names(model, optimizer) == expected
    assert sorted({g["weight_decay"] for g in optimizer.param_groups}) == [0.0, 0.05]


def test_adamw_takes_the_configured_lr_betas_and_eps():
    cfg = OptimConfig(lr=3e-4, betas=(0.8, 0.95), eps=1e-6)
    optimizer = build_optimizer(torch.nn.Linear(4, 2), cfg, effective_lr(cfg, world_size=1))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all((g["lr"], g["betas"], g["eps"]) == (3e-4, (0.8, 0.95), 1e-6) for g in optimizer.param_groups)


class _DeclaresNoDecay(torch.nn.Module):
    """A model whose no_weight_decay() names a matrix the built-in patterns do not cover."""

    def __init__(self):
        super().__init__()
        self.mixing = torch.nn.Parameter(torch.ones(3, 3))
        self.proj = torch.nn.Linear(3, 3)

    def no_weight_decay(self):
        return {"mixing"}


def test_what_a_model_declares_in_no_weight_decay_is_not_decayed():
    model = _DeclaresNoDecay()
    assert _decayed_names(model, build_optimizer(model, OptimConfig(weight_decay=0.05), lr=5e-4)) == {"proj.weight"}


def test_fsne_codes_are_not_decayed():
    model = timm.create_model("xcit_nano_12_p16", img_size=32, num_classes=10, qkv="fsne", code_size=8)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.05), lr=5e-4)
    code_params = [n for n, p in model.named_parameters() if "code" in n]
    assert code_params
    assert not set(code_params) & _decayed_names(model, optimizer)


def test_every_trainable_parameter_is_optimized_once():
    model = timm.create_model("xcit_nano_12_p16", img_size=32, num_classes=10, qkv="fsne", code_size=8)
    optimizer = build_optimizer(model, OptimConfig(), lr=5e-4)
    optimized = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(optimized) == sorted(id(p) for p in model.parameters() if p.requires_grad)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = OptimConfig(epochs=10, schedule=ScheduleConfig(warmup_epochs=2, warmup_lr=0.0, min_lr=1e-5))
    steps_per_epoch, total, peak = 5, 50, 1e-3
    assert lr_at(0, total, steps_per_epoch, cfg, peak) == 0.0
    assert lr_at(5, total, steps_per_epoch, cfg, peak) == pytest.approx(5e-4)
    assert lr_at(10, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-3)
    assert lr_at(30, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert lr_at(50, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-5)


def test_cooldown_holds_min_lr_after_a_cosine_that_ends_early():
    # SoT's 310 epochs: timm's scheduler runs its cosine over --epochs (300) and holds lr_min for
    # --cooldown-epochs (10) more. Here 10 epochs of 5 steps: warmup 2, cosine over steps 10..40, held 40..50.
    cfg = OptimConfig(epochs=10, schedule=ScheduleConfig(warmup_epochs=2, warmup_lr=0.0, min_lr=1e-5, cooldown_epochs=2))
    steps_per_epoch, total, peak = 5, 50, 1e-3
    assert lr_at(10, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-3)
    assert lr_at(25, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert lr_at(40, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-5)
    assert lr_at(47, total, steps_per_epoch, cfg, peak) == pytest.approx(1e-5)


def test_a_cooldown_needs_a_cosine_and_room_for_it():
    with pytest.raises(ValueError, match="name='constant' has none"):
        ScheduleConfig(name="constant", cooldown_epochs=10)
    with pytest.raises(ValueError, match="leave no epoch of the 10 for the cosine"):
        OptimConfig(epochs=10, schedule=ScheduleConfig(warmup_epochs=5, cooldown_epochs=5))


def test_warmup_starts_from_warmup_lr():
    cfg = OptimConfig(lr=1e-3, epochs=4, schedule=ScheduleConfig(warmup_epochs=1, warmup_lr=1e-4, min_lr=0.0))
    assert lr_at(0, 40, 10, cfg, peak_lr=1e-3) == pytest.approx(1e-4)
    assert lr_at(5, 40, 10, cfg, peak_lr=1e-3) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))


def test_without_warmup_the_first_step_takes_the_full_lr():
    cfg = OptimConfig(lr=1e-3, epochs=2, schedule=ScheduleConfig(warmup_epochs=0, min_lr=0.0))
    assert lr_at(0, 20, 10, cfg, peak_lr=1e-3) == pytest.approx(1e-3)


def test_a_single_step_after_warmup_reaches_min_lr():
    cfg = OptimConfig(lr=1e-3, epochs=3, schedule=ScheduleConfig(warmup_epochs=2, warmup_lr=0.0, min_lr=1e-5))
    assert lr_at(3, 3, 1, cfg, peak_lr=1e-3) == pytest.approx(1e-5)


def test_lr_stays_at_min_lr_past_the_last_step():
    cfg = OptimConfig(lr=1e-3, epochs=2, schedule=ScheduleConfig(warmup_epochs=0, min_lr=1e-5))
    assert lr_at(30, 20, 10, cfg, peak_lr=1e-3) == pytest.approx(1e-5)


def test_constant_schedule_holds_lr_after_warmup():
    cfg = OptimConfig(epochs=4, schedule=ScheduleConfig(name="constant", warmup_epochs=1))
    assert lr_at(40, 40, 10, cfg, peak_lr=1e-3) == pytest.approx(1e-3)


def test_scheduler_sets_the_optimizer_lr_each_step():
    model = torch.nn.Linear(4, 2)
    cfg = OptimConfig(epochs=2, schedule=ScheduleConfig(warmup_epochs=1, warmup_lr=0.0))
    optimizer = build_optimizer(model, cfg, lr=1e-3)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=4)
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert seen[5] < 1e-3 and seen[7] < seen[5]


def test_ema_keeps_an_fp32_shadow_that_moves_toward_the_model():
    from pipeline.components.optim import build_ema

    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    ema = build_ema(model, OptimConfig(ema_decay=0.5))
    assert all(p.dtype == torch.float32 for p in ema.module.parameters())
    before = ema.module.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, step=10)  # timm copies the weights at step <= 1, then averages
    expected = 0.5 * before + 0.5 * model.weight.float()
    assert torch.allclose(ema.module.weight, expected, atol=1e-2)
