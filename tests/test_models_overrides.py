"""The qkv= and head= overrides (QKVOverrideMixin, TokenHeadMixin) behave alike in DeiT, XCiT and EIT."""
import pytest
import timm
import torch

import models  # noqa: F401  (registers the variants)
from models.measure import build_on_meta
from models.layers.heads import SoTHead

# The smallest variant of every family that takes both overrides.
OVERRIDABLE = ["deit_tiny_p16", "xcit_nano_12_p16", "eit16_4_3_mini"]
QKV_OVERRIDES = [("sne", {}), ("psne", {}), ("fsne", {"code_size": 8}), ("armour", {})]


@pytest.mark.parametrize(("name", "timm_name"), [("deit_tiny_p16", "deit_tiny_patch16_224"),
                                                 ("xcit_nano_12_p16", "xcit_nano_12_p16_224")])
def test_default_overrides_compute_exactly_what_timm_computes(name, timm_name):
    torch.manual_seed(0)
    reference = timm.create_model(timm_name, img_size=32).eval()
    ours = timm.create_model(name, img_size=32).eval()
    ours.load_state_dict(reference.state_dict())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ours(images), reference(images))


@pytest.mark.parametrize("name", OVERRIDABLE)
@pytest.mark.parametrize(("qkv", "options"), QKV_OVERRIDES, ids=[kind for kind, _ in QKV_OVERRIDES])
def test_every_qkv_kind_trains_in_every_family(name, qkv, options):
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10, qkv=qkv, **options)
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10) and model.qkv_kind == qkv
    logits.logsumexp(dim=1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_unknown_qkv_is_rejected_naming_the_valid_kinds(name):
    with pytest.raises(ValueError, match="qkv='nonlinear' is not a known QKV embedding; valid: .*psne"):
        build_on_meta(name, qkv="nonlinear")


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_fsne_without_a_code_size_is_rejected_at_construction(name):
    with pytest.raises(ValueError, match="code_size=None is invalid for qkv='fsne'"):
        build_on_meta(name, qkv="fsne")


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_armour_with_a_code_size_is_rejected_at_construction(name):
    with pytest.raises(ValueError, match="code_size=8 applies only to qkv='fsne', not qkv='armour'"):
        build_on_meta(name, qkv="armour", code_size=8)


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_sot_head_reads_all_tokens_after_the_final_norm(name):
    # XCiT's final tokens are those that leave its class-attention blocks and the norm after them.
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10, head="sot").eval()
    seen = {}
    model.head.register_forward_pre_hook(lambda module, args: seen.update(tokens=args[0]))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = model(images)
        features = model.forward_features(images)
    assert isinstance(model.head, SoTHead) and logits.shape == (2, 10)
    assert seen["tokens"].shape == (2, 1 + 4, model.embed_dim)  # class token + 2x2 patches
    assert torch.equal(seen["tokens"], features)


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_sot_head_kwargs_are_routed_to_the_sot_head(name):
    model = build_on_meta(name, num_classes=10, head="sot", fusion="concat", mgcrp_heads=2, mgcrp_m=4)
    assert model.head.fusion == "concat" and model.head.repr_size == 2 * 4 * 4


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_reset_classifier_keeps_the_sot_head(name):
    model = build_on_meta(name, head="sot", fusion="concat")
    model.reset_classifier(7)
    assert isinstance(model.head, SoTHead) and model.head.fusion == "concat" and model.num_classes == 7


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_sot_head_kwargs_with_the_linear_head_are_rejected(name):
    with pytest.raises(ValueError, match=r"\['fusion'\] apply only to head='sot', not head='linear'"):
        build_on_meta(name, fusion="concat")


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_unknown_head_is_rejected_naming_the_valid_heads(name):
    with pytest.raises(ValueError, match=r"head='mlp' is not a classifier head; valid: \('linear', 'sot'\)"):
        build_on_meta(name, head="mlp")


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_sot_head_with_token_pooling_is_rejected(name):
    with pytest.raises(ValueError, match="global_pool='token' is invalid with head='sot'"):
        build_on_meta(name, head="sot", global_pool="token")
