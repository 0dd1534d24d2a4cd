"""EIT (paper 001): the architecture the paper specifies, checked against its tables and equations."""
from __future__ import annotations

import random

import pytest
import timm
import torch

import models
from models.eit import EIT, ParallelConvAttention
from models.measure import build_on_meta, count_gmacs, count_params
from models.layers.qkv import (
    ArmourAttention,
    ArmourQKV,
    FullySharedNonLinearQKV,
    PartiallySharedNonLinearQKV,
    SeparateNonLinearQKV,
)

VARIANT_NAMES = ["eit16_4_3_mini", "eit16_4_3_tiny", "eit16_4_3_base", "eit16_4_3_large", "eit3_1_4_mini"]


def _conv_dims(model: EIT) -> list[int]:
    return [block.mixer.conv_dim for block in model.blocks]


def _mha_dims(model: EIT) -> list[int]:
    return [block.mixer.mha_dim for block in model.blocks]


def _meta_eit(**kwargs) -> EIT:
    with torch.device("meta"):
        return EIT(**kwargs)


# --------------------------------------------------------------------------------------------------
# The paper's tables
# --------------------------------------------------------------------------------------------------

# Table 5 lists multiply-adds of every op (its DeiT-T row says 1.3G, DeiT's MAC count), as count_gmacs
# counts them.  Table 6 lists FLOPs at 2 per multiply-add (its plain patch-4 ViT, C=250, 5 layers, 65
# tokens = 0.255 GMACs, is listed as 0.515G), so twice count_gmacs is compared with it.  Table 6 rows are
# CIFAR-10 models (10 classes, 32 px) and their counts include a trainable position embedding (Table 10's
# "Trainable" row is the Table 7/8 EIT_T model).
PAPER_ROWS = [
    # (row label, variant, overrides, image side, reported params, reported FLOPs, FLOPs per multiply-add)
    ("EIT16/4/3-Mini", "eit16_4_3_mini", {}, 224, 3.5e6, 1.73e9, 1),
    ("EIT16/4/3-Tiny", "eit16_4_3_tiny", {}, 224, 8.9e6, 3.84e9, 1),
    ("EIT16/4/3-Base", "eit16_4_3_base", {}, 224, 16.0e6, 6.52e9, 1),
    ("EIT16/4/3-Large", "eit16_4_3_large", {}, 224, 25.3e6, 10.0e9, 1),
    ("1.9 EIT3/1/4-Mini EITP+EITT", "eit3_1_4_mini", {}, 32, 3.095e6, 0.428e9, 2),
    # EIT_P alone: every layer is plain MHA (C_T = 0), as Table 8's "None" row.
    ("1.7 EIT3/1/4-Mini EITP only", "eit3_1_4_mini", {"conv_channels": [0] * 5}, 32, 3.793e6, 0.527e9, 2),
]
ROW_IDS = [row[0] for row in PAPER_ROWS]


@pytest.mark.parametrize("label,name,overrides,side,params,flops,flops_per_mac", PAPER_ROWS, ids=ROW_IDS)
def test_parameter_count_matches_paper_row(label, name, overrides, side, params, flops, flops_per_mac):
    assert count_params(build_on_meta(name, **overrides)) == pytest.approx(params, rel=0.02)


@pytest.mark.parametrize("label,name,overrides,side,params,flops,flops_per_mac", PAPER_ROWS, ids=ROW_IDS)
def test_flops_match_paper_row(label, name, overrides, side, params, flops, flops_per_mac):
    measured = count_gmacs(build_on_meta(name, img_size=side, **overrides), side) * 1e9 * flops_per_mac
    assert measured == pytest.approx(flops, rel=0.05)


def test_variants_are_registered_with_their_paper_facts():
    for name in VARIANT_NAMES:
        assert name in timm.list_models("eit*")
        facts = models.VARIANTS[name]
        assert (facts.paper, facts.family) == ("001", "eit")
    assert models.VARIANTS["eit16_4_3_base"].row == "EIT16/4/3-Base"
    assert models.VARIANTS["eit3_1_4_mini"].img_size == 32


# --------------------------------------------------------------------------------------------------
# EIT_T channel split, Eq. 13: C_T_i = C - floor((C // h) * r_i) * h
# --------------------------------------------------------------------------------------------------

def test_decreasing_schedule_follows_eq13_for_five_layers_ten_heads_250_channels():
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10)
    # C // h = 25, r_i = i / 5: floor(25 * i / 5) * 10 = 50, 100, 150, 200, 250 MHA channels.
    assert _conv_dims(model) == [250 - 50, 250 - 100, 250 - 150, 250 - 200, 250 - 250]
    assert _mha_dims(model) == [50, 100, 150, 200, 250]


def test_eq13_rounds_mha_width_down_to_a_multiple_of_heads():
    model = _meta_eit(embed_dim=330, depth=8, num_heads=10)
    # C // h = 33, r_i = i / 8: floor(33 i / 8) = floor(4.125), floor(8.25), floor(12.375), floor(16.5),
    # floor(20.625), floor(24.75), floor(28.875), 33 -> 4, 8, 12, 16, 20, 24, 28, 33 heads' worth.
    assert _mha_dims(model) == [40, 80, 120, 160, 200, 240, 280, 330]
    assert _conv_dims(model) == [290, 250, 210, 170, 130, 90, 50, 0]


def test_eq13_gives_the_conv_the_remainder_when_channels_are_not_a_multiple_of_heads():
    model = _meta_eit(embed_dim=250, depth=2, num_heads=16)
    # C // h = 15: r = 1/2 -> floor(7.5) = 7 -> 112 MHA; r = 1 -> 15 -> 240 MHA, C mod h = 10 left to conv.
    assert _mha_dims(model) == [112, 240]
    assert _conv_dims(model) == [138, 10]


def test_eq13_is_computed_without_float_rounding():
    # In floats 55 * (3 / 11) = 14.999... and 100 * 0.29 = 28.999..., which would floor one head short.
    by_fraction = _meta_eit(embed_dim=550, depth=11, num_heads=10, mlp_ratio=1.0)
    assert _mha_dims(by_fraction) == [50 * i for i in range(1, 12)]  # floor(55 i / 11) * 10 = 5 i * 10
    by_decimal = _meta_eit(embed_dim=1000, depth=1, num_heads=10, mlp_ratio=1.0, channel_schedule=[0.29])
    assert _mha_dims(by_decimal) == [290]  # floor(100 * 0.29) * 10


def test_increasing_schedule_mirrors_decreasing():
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, channel_schedule="increasing")
    # r_i = (6 - i) / 5: floor(25 * 5/5, 4/5, 3/5, 2/5, 1/5) * 10 = 250, 200, 150, 100, 50 MHA channels.
    assert _conv_dims(model) == [0, 50, 100, 150, 200]


def test_invariant_schedule_splits_every_layer_at_one_half():
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, channel_schedule="invariant")
    # r = 1/2: floor(25 / 2) * 10 = 120 MHA channels, 130 conv channels, in every layer.
    assert _conv_dims(model) == [130] * 5


def test_linear_schedule_interpolates_the_mha_ratio_between_first_and_last_layer():
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, channel_schedule="linear",
                      mha_ratio_range=(0.4, 0.8))
    # r = 0.4, 0.5, 0.6, 0.7, 0.8: floor(10, 12.5, 15, 17.5, 20) * 10 = 100, 120, 150, 170, 200 MHA.
    assert _conv_dims(model) == [150, 130, 100, 80, 50]


def test_explicit_mha_ratios_are_honoured():
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, channel_schedule=[0.0, 1.0, 0.3, 0.55, 0.9])
    # floor(25 * r) = 0, 25, 7, 13, 22 heads' worth of 10 MHA channels.
    assert _conv_dims(model) == [250, 0, 180, 120, 30]


def test_explicit_conv_channels_are_honoured():
    conv_channels = [130, 70, 250, 0, 10]
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, conv_channels=conv_channels)
    assert _conv_dims(model) == conv_channels


def test_eit_t_conv_is_depthwise_with_k_squared_parameters_per_channel():
    # App. C: "k^2 C parameters" -- one k x k filter per channel, no bias.
    model = _meta_eit(embed_dim=250, depth=5, num_heads=10, conv_kernel=5)
    conv_params = [sum(p.numel() for p in b.mixer.conv.parameters()) if b.mixer.conv is not None else 0
                   for b in model.blocks]
    assert conv_params == [25 * c for c in [200, 150, 100, 50, 0]]


def test_mha_width_is_a_multiple_of_heads_for_every_schedule():
    rng = random.Random(0)
    for _ in range(100):
        num_heads = rng.choice([1, 2, 3, 4, 6, 10, 12, 16])
        embed_dim = rng.randrange(num_heads, 520)
        depth = rng.randrange(1, 9)
        schedule, ratio_range = rng.choice([
            ("decreasing", None), ("increasing", None), ("invariant", None),
            ("linear", (rng.random(), rng.random())),
            ([rng.random() for _ in range(depth)], None),
        ])
        model = _meta_eit(embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=1.0,
                          channel_schedule=schedule, mha_ratio_range=ratio_range)
        for block in model.blocks:
            mixer = block.mixer
            assert mixer.mha_dim % num_heads == 0, (embed_dim, num_heads, depth, schedule)
            assert mixer.mha_dim + mixer.conv_dim == embed_dim
            if mixer.attn is not None:
                assert mixer.attn.num_heads * mixer.attn.head_dim == mixer.mha_dim


BAD_SCHEDULES = [
    ("unknown-name", dict(channel_schedule="shrinking"), "shrinking"),
    ("ratio-list-wrong-length", dict(channel_schedule=[0.2, 0.4]), r"\[0.2, 0.4\]"),
    ("ratio-above-one", dict(channel_schedule=[0.2, 0.4, 0.6, 0.8, 1.5]), "1.5"),
    ("linear-without-range", dict(channel_schedule="linear"), "mha_ratio_range"),
    ("range-without-linear", dict(channel_schedule="increasing", mha_ratio_range=(0.1, 1.0)), "mha_ratio_range"),
    ("conv-channels-break-heads", dict(conv_channels=[200, 150, 105, 50, 0]), "105"),
    ("conv-channels-wrong-length", dict(conv_channels=[200, 150]), r"\[200, 150\]"),
    ("conv-channels-above-dim", dict(conv_channels=[200, 150, 100, 50, 260]), "260"),
    ("conv-channels-and-schedule", dict(conv_channels=[0] * 5, channel_schedule="invariant"), "conv_channels"),
]


@pytest.mark.parametrize("kwargs,match", [row[1:] for row in BAD_SCHEDULES], ids=[row[0] for row in BAD_SCHEDULES])
def test_bad_schedule_raises_value_error_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _meta_eit(embed_dim=250, depth=5, num_heads=10, **kwargs)


# --------------------------------------------------------------------------------------------------
# EIT_T mixer behaviour (Eqs. 4-6, 11-12)
# --------------------------------------------------------------------------------------------------

def _mixer_and_tokens(conv_dim=12, dim=20, num_heads=2, grid=(4, 4)):
    torch.manual_seed(0)
    mixer = ParallelConvAttention(dim, conv_dim, num_heads).eval()
    tokens = torch.randn(2, 1 + grid[0] * grid[1], dim)
    return mixer, tokens, grid


def test_class_token_passes_the_conv_channels_unchanged():
    mixer, tokens, grid = _mixer_and_tokens()
    out = mixer(tokens, grid)
    torch.testing.assert_close(out[:, 0, :12], tokens[:, 0, :12])


def test_patch_conv_does_not_see_the_class_token():
    mixer, tokens, grid = _mixer_and_tokens()
    shifted = tokens.clone()
    shifted[:, 0, :12] += 5.0
    torch.testing.assert_close(mixer(shifted, grid)[:, 1:, :12], mixer(tokens, grid)[:, 1:, :12])


def test_conv_channels_mix_only_3x3_grid_neighbours():
    mixer, tokens, grid = _mixer_and_tokens()
    shifted = tokens.clone()
    shifted[:, 1 + 1 * 4 + 1, :12] += 1.0  # patch at row 1, column 1 of the 4x4 grid
    changed = (mixer(shifted, grid) - mixer(tokens, grid))[:, 1:, :12].abs().amax(dim=(0, 2)).reshape(4, 4)
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[0:3, 0:3] = True
    assert torch.equal(changed > 0, expected)


def test_mha_channels_are_plain_attention_over_all_tokens():
    mixer, tokens, grid = _mixer_and_tokens()
    torch.testing.assert_close(mixer(tokens, grid)[..., 12:], mixer.attn(tokens[..., 12:]))


# --------------------------------------------------------------------------------------------------
# EIT_P and position embedding
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,side,grid", [
    ("eit16_4_3_mini", 224, (18, 18)),  # conv: (224 + 12 - 16) / 4 + 1 = 56; pool 3: 18
    ("eit3_1_4_mini", 32, (8, 8)),  # conv: (32 + 2 - 3) / 1 + 1 = 32; pool 4: 8
    ("eit16_4_3_mini", 32, (2, 2)),  # conv: (32 + 12 - 16) / 4 + 1 = 8; pool 3: 2
])
def test_patch_embedding_grid_is_conv_then_maxpool(name, side, grid):
    with torch.device("meta"):
        model = timm.create_model(name, img_size=side)
        tokens = model.forward_features(torch.empty(1, 3, side, side))
    assert model.patch_embed.grid_size == grid
    assert tokens.shape == (1, 1 + grid[0] * grid[1], model.embed_dim)


def test_image_too_small_for_a_token_raises_value_error_naming_img_size():
    with pytest.raises(ValueError, match="img_size=8"):
        timm.create_model("eit16_4_3_mini", img_size=8)


@pytest.mark.parametrize("name", [name for name in VARIANT_NAMES if name.startswith("eit16_4_3")])
def test_table_5_variants_have_no_position_embedding(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    assert model.pos_embed is None
    assert not any("pos_embed" in n for n, _ in model.named_parameters())


def test_table_6_variant_has_a_learned_position_embedding_with_one_vector_per_token():
    with torch.device("meta"):
        model = timm.create_model("eit3_1_4_mini")
    assert model.pos_embed.shape == (1, 1 + 8 * 8, 250) and model.pos_embed.requires_grad


def test_learned_position_embedding_rejects_other_input_sizes():
    model = timm.create_model("eit3_1_4_mini")
    with pytest.raises(ValueError, match="8x8"):
        model(torch.randn(1, 3, 64, 64))


def test_without_position_embedding_any_input_size_runs():
    model = timm.create_model("eit3_1_4_mini", num_classes=3, pos_embed="none")
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 3)


def test_unknown_position_embedding_raises_value_error():
    with pytest.raises(ValueError, match="'sinusoidal'"):
        timm.create_model("eit3_1_4_mini", pos_embed="sinusoidal")


def test_pretrained_weights_are_refused():
    with pytest.raises(ValueError, match="pretrained"):
        timm.create_model("eit3_1_4_mini", pretrained=True)


# --------------------------------------------------------------------------------------------------
# Overrides: what is EIT's own (MHA of per-layer width, layers without MHA, its linear head); the
# behaviour every family shares is in test_models_overrides.py
# --------------------------------------------------------------------------------------------------

QKV_OVERRIDES = [
    ("sne", {}, SeparateNonLinearQKV),
    ("psne", {}, PartiallySharedNonLinearQKV),
    ("fsne", {"code_size": 8}, FullySharedNonLinearQKV),
    ("armour", {}, ArmourQKV),
]


@pytest.mark.parametrize("kind,options,embedding_cls", QKV_OVERRIDES, ids=[row[0] for row in QKV_OVERRIDES])
def test_qkv_override_replaces_the_projection_of_every_mha_at_its_width(kind, options, embedding_cls):
    model = timm.create_model("eit16_4_3_mini", img_size=32, num_classes=10, qkv=kind, **options)
    tokens = torch.randn(2, 5, 250)
    for block in model.blocks:
        attn = block.mixer.attn
        assert isinstance(attn.qkv, embedding_cls)
        assert isinstance(attn, ArmourAttention) == (kind == "armour")  # Q used as V without a copy
        assert attn.qkv(tokens[..., :block.mixer.mha_dim]).shape == (2, 5, 3 * block.mixer.mha_dim)


def test_fsne_codes_are_shared_by_layers_of_different_mha_width():
    with torch.device("meta"):
        model = timm.create_model("eit16_4_3_mini", qkv="fsne", code_size=8)
    codes = {id(block.mixer.attn.qkv.codes) for block in model.blocks}
    assert len(codes) == 1
    assert sorted({block.mixer.attn.qkv.dim for block in model.blocks}) == [50, 100, 150, 200, 250]


def test_qkv_override_on_a_model_without_mha_raises_value_error():
    with pytest.raises(ValueError, match="qkv='sne'"):
        timm.create_model("eit3_1_4_mini", qkv="sne", conv_channels=[250] * 5)


def test_default_head_is_linear_on_the_class_token():
    model = timm.create_model("eit3_1_4_mini").eval()
    images = torch.randn(2, 3, 32, 32)
    assert isinstance(model.head, torch.nn.Linear)
    torch.testing.assert_close(model(images), model.head(model.forward_features(images)[:, 0]))
