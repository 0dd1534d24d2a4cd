"""DeiT and Armour (paper 002) on timm's VisionTransformer, with vitsweep's QKV and head overrides."""
import pytest
import timm
import torch

import models  # noqa: F401  (registers the variants)
from models.layers.qkv import ArmourAttention, ArmourQKV
from models.measure import build_on_meta, count_gmacs, count_params

# Paper 002 Table 3: reported params (M, one decimal) per row.
PAPER_002_TABLE_3 = {
    "DeiT-Ti": ("deit_tiny_p16", 5.7),
    "Armour-Ti": ("armour_tiny", 5.3),
    "DeiT-S": ("deit_small_p16", 22.1),
    "Armour-S": ("armour_small", 20.3),
    "DeiT-B": ("deit_base_p16", 86.6),
    "Armour-B": ("armour_base", 79.5),
}


@pytest.mark.parametrize(("name", "paper_params_m"), PAPER_002_TABLE_3.values(), ids=PAPER_002_TABLE_3.keys())
def test_params_match_paper_002_table_3_to_its_precision(name, paper_params_m):
    assert round(count_params(build_on_meta(name)) / 1e6, 1) == paper_params_m


# Paper 002 Table 1's distilled rows: the models with DeiT's distillation token and head.
PAPER_002_TABLE_1_DISTILLED = {"DeiT-Ti dist": ("deit_tiny_distilled_p16", 5.9),
                               "Armour-Ti dist": ("armour_tiny_distilled", 5.5)}


@pytest.mark.parametrize(("name", "paper_params_m"), PAPER_002_TABLE_1_DISTILLED.values(),
                         ids=PAPER_002_TABLE_1_DISTILLED.keys())
def test_distilled_params_match_paper_002_table_1_to_its_precision(name, paper_params_m):
    assert round(count_params(build_on_meta(name)) / 1e6, 1) == paper_params_m


def test_the_distillation_token_adds_timms_distilled_deits_parameters():
    # timm's own DeiT-Ti with the token, counted: 5,910,800, the token and its position row (192 each) and a
    # second head of 192 x 1000 + 1000 over DeiT-Ti's
    timm_count = count_params(timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False))
    assert count_params(build_on_meta("deit_tiny_distilled_p16")) == timm_count == 5_910_800
    extra = 192 + 192 + 192 * 1000 + 1000
    assert count_params(build_on_meta("deit_tiny_distilled_p16")) - count_params(build_on_meta("deit_tiny_p16")) == extra
    assert count_params(build_on_meta("armour_tiny_distilled")) - count_params(build_on_meta("armour_tiny")) == extra


def test_the_distilled_deit_is_timms_weight_for_weight_and_averages_both_heads_at_inference():
    from models.layers.heads import DistilledLogits

    small = dict(img_size=16, patch_size=4, depth=2, num_classes=10)
    torch.manual_seed(0)
    ours = timm.create_model("deit_tiny_distilled_p16", **small)
    reference = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **small)
    reference.load_state_dict(ours.state_dict())
    reference.set_distilled_training(True)
    images = torch.randn(3, 3, 16, 16)
    trained = ours.train()(images)
    assert isinstance(trained, DistilledLogits)
    torch.testing.assert_close(tuple(trained), reference.train()(images))
    ours.eval()
    with torch.no_grad():
        tokens = ours.forward_features(images)  # [B, 2 + 16, 192]: the class token, then the distillation token
        by_hand = (ours.head(tokens[:, 0]) + ours.head_dist(tokens[:, 1])) / 2
        torch.testing.assert_close(ours(images), by_hand)
        torch.testing.assert_close(ours(images), reference.eval()(images))


def test_table_6_vit_matches_paper_001_row_1_1():
    # 3.798M at 10 classes; 0.515G printed at 2 FLOPs per multiply-add (the convention of that table).
    model = build_on_meta("vit_mini_p4")
    assert count_params(model) == pytest.approx(3.798e6, rel=0.02)
    assert 2 * count_gmacs(model, 32) == pytest.approx(0.515, rel=0.05)


# Paper 002 Table 3 "# params Δ" of Armour against its DeiT.
PAPER_002_REDUCTION = {
    "Armour-Ti": ("deit_tiny_p16", "armour_tiny", -7.8),
    "Armour-S": ("deit_small_p16", "armour_small", -8.1),
    "Armour-B": ("deit_base_p16", "armour_base", -8.2),
}


@pytest.mark.parametrize(("deit", "armour", "paper_delta_pct"), PAPER_002_REDUCTION.values(),
                         ids=PAPER_002_REDUCTION.keys())
def test_armour_param_reduction_matches_paper_002_table_3(deit, armour, paper_delta_pct):
    # The paper's Δ is computed from its rounded counts (e.g. 20.3/22.1 for S), hence 0.1 points of slack.
    baseline = count_params(build_on_meta(deit))
    delta_pct = 100 * (count_params(build_on_meta(armour)) - baseline) / baseline
    assert delta_pct == pytest.approx(paper_delta_pct, abs=0.1)


def test_armour_attention_is_softmax_of_qk_times_q():
    # Paper 002 Eq. 2: Attention(Q, K) = softmax(QKᵀ/√d)·Q, per head, then timm's output projection.
    torch.manual_seed(0)
    attn = timm.create_model("armour_tiny", img_size=32).blocks[0].attn.eval()
    tokens = torch.randn(2, 5, 192)
    q, k = attn.qkv.qk(tokens).chunk(2, dim=-1)
    q, k = (t.unflatten(-1, (3, 64)).transpose(1, 2) for t in (q, k))  # [B, heads, N, 64]
    weights = (q @ k.transpose(-2, -1) / 64 ** 0.5).softmax(dim=-1)
    expected = attn.proj((weights @ q).transpose(1, 2).flatten(2))
    with torch.no_grad():
        torch.testing.assert_close(attn(tokens), expected)


def test_armour_blocks_use_query_as_value():
    model = build_on_meta("armour_tiny")
    assert all(isinstance(b.attn.qkv, ArmourQKV) and b.attn.qkv.value_is_query for b in model.blocks)
    assert all(isinstance(b.attn, ArmourAttention) for b in model.blocks)


def test_armour_equals_deit_with_armour_qkv():
    assert count_params(build_on_meta("armour_small")) == count_params(build_on_meta("deit_small_p16", qkv="armour"))


def test_armour_with_another_qkv_is_rejected():
    with pytest.raises(ValueError, match="armour_tiny is DeiT with qkv='armour', got qkv='sne'"):
        build_on_meta("armour_tiny", qkv="sne")


def test_armour_has_no_pretrained_weights():
    with pytest.raises(ValueError, match="no pretrained weights for armour_tiny"):
        timm.create_model("armour_tiny", pretrained=True)