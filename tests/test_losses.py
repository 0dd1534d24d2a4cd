"""The training loss is one function of (model output, targets, images), whatever the recipe."""
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_model

import models  # noqa: F401
from pipeline.config.schema import DataConfig, DistillConfig
from pipeline.config.loading import load_config
from pipeline.data.augment import BatchAugment
from pipeline.components.distillation import DistillationLoss, build_teacher
from pipeline.components.losses import TrainingLoss, build_training_loss


def test_a_single_output_gets_the_task_loss():
    logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4,))
    loss = TrainingLoss(torch.nn.CrossEntropyLoss())(logits, labels, torch.zeros(4, 3, 8, 8))
    assert torch.allclose(loss, F.cross_entropy(logits, labels))


def test_each_branch_of_a_tuple_output_is_trained_on_the_targets_and_the_losses_add():
    cls_logits, word_logits = torch.randn(4, 10, requires_grad=True), torch.randn(4, 10, requires_grad=True)
    soft_targets = torch.softmax(torch.randn(4, 10), dim=-1)  # Mixup/CutMix targets
    task_loss = timm.loss.SoftTargetCrossEntropy()
    loss = TrainingLoss(task_loss)((cls_logits, word_logits), soft_targets, torch.zeros(4, 3, 8, 8))
    assert torch.allclose(loss, task_loss(cls_logits, soft_targets) + task_loss(word_logits, soft_targets))
    loss.backward()
    expected_grad = torch.autograd.grad(task_loss(cls_logits, soft_targets), cls_logits)[0]
    assert torch.allclose(cls_logits.grad, expected_grad)  # each branch gets its full gradient


def test_distillation_applies_to_every_branch_with_one_teacher_pass(tmp_path):
    teacher_model = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=1)
    save_model(teacher_model, str(tmp_path / "teacher.safetensors"))
    teacher = build_teacher(DistillConfig(teacher="xcit_nano_12_p8", teacher_args={"img_size": 16, "depth": 1},
                                          teacher_checkpoint=str(tmp_path / "teacher.safetensors")), num_classes=10)
    calls = []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    distillation = DistillationLoss(torch.nn.CrossEntropyLoss(), teacher, DistillConfig(), data=DataConfig())
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    branches = (torch.randn(4, 10), torch.randn(4, 10))
    loss = TrainingLoss(torch.nn.CrossEntropyLoss(), distillation)(branches, labels, images)
    assert len(calls) == 1
    assert torch.allclose(loss, distillation(branches[0], labels, images) + distillation(branches[1], labels, images))


# build_training_loss, as the worker builds it from the config, against the formulas written out.

def _config(*overrides: str):
    return load_config("smoke", ["data.augment.label_smoothing=0", *overrides])


def _training_loss(cfg):
    return build_training_loss(cfg, BatchAugment(cfg.data.augment, 10), 10, torch.device("cpu"))


def _cross_entropy_by_hand(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """mean over samples of -log softmax(logits)[label]."""
    log_probs = logits - logits.exp().sum(-1, keepdim=True).log()
    return -log_probs[torch.arange(len(labels)), labels].mean()


LOGITS = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 3, 3, 9, 5, 1])
IMAGES = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_the_configured_loss_without_smoothing_or_mixup_is_cross_entropy():
    loss = _training_loss(_config())(LOGITS, LABELS, IMAGES)
    torch.testing.assert_close(loss, _cross_entropy_by_hand(LOGITS, LABELS))


def test_the_configured_loss_with_label_smoothing_spreads_epsilon_over_every_class():
    loss = _training_loss(_config("data.augment.label_smoothing=0.2"))(LOGITS, LABELS, IMAGES)
    log_probs = LOGITS.log_softmax(-1)
    by_hand = (0.8 * -log_probs[torch.arange(6), LABELS] + 0.2 * -log_probs.mean(-1)).mean()
    torch.testing.assert_close(loss, by_hand)


def test_the_configured_loss_under_mixup_is_the_cross_entropy_to_the_soft_targets():
    soft = torch.softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(2)), -1)
    loss = _training_loss(_config("data.augment.mixup_alpha=0.8"))(LOGITS, soft, IMAGES)
    torch.testing.assert_close(loss, -(soft * LOGITS.log_softmax(-1)).sum(-1).mean())


def test_the_configured_loss_of_a_late_fusion_model_adds_each_branchs_loss():
    word_logits = LOGITS.flip(0)
    loss = _training_loss(_config())((LOGITS, word_logits), LABELS, IMAGES)
    torch.testing.assert_close(loss, _cross_entropy_by_hand(LOGITS, LABELS) + _cross_entropy_by_hand(word_logits, LABELS))


@pytest.fixture
def teacher(tmp_path):
    """A random but fixed teacher, saved as the config's checkpoint; returned as the plain timm model."""
    model = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=1).eval()
    save_model(model, str(tmp_path / "teacher.safetensors"))
    return model, tmp_path / "teacher.safetensors"


def test_the_configured_distillation_loss_mixes_in_the_teachers_argmax_by_alpha(teacher):
    model, checkpoint = teacher
    cfg = _config("distill.teacher=xcit_nano_12_p8", f"distill.teacher_checkpoint={checkpoint}",
                  'distill.teacher_args={"img_size": 16, "depth": 1}', "distill.alpha=0.3")
    with torch.no_grad():
        teacher_labels = model(IMAGES).argmax(-1)
    assert not torch.equal(teacher_labels, LABELS)  # the teacher's target is not the label: ignoring it shows
    word_logits = LOGITS.flip(0)
    loss = _training_loss(cfg)((LOGITS, word_logits), LABELS, IMAGES)
    by_hand = sum(0.7 * _cross_entropy_by_hand(branch, LABELS) + 0.3 * _cross_entropy_by_hand(branch, teacher_labels)
                  for branch in (LOGITS, word_logits))
    torch.testing.assert_close(loss, by_hand)


def test_the_configured_soft_distillation_mixes_in_the_teachers_softened_distribution_by_alpha(teacher):
    model, checkpoint = teacher
    cfg = _config("distill.teacher=xcit_nano_12_p8", f"distill.teacher_checkpoint={checkpoint}",
                  'distill.teacher_args={"img_size": 16, "depth": 1}', "distill.kind=soft", "distill.tau=3",
                  "distill.alpha=0.1")  # DeiT's soft row (DeiT §5.2)
    with torch.no_grad():
        teacher_logits = model(IMAGES).double().numpy()
    loss = _training_loss(cfg)(LOGITS, LABELS, IMAGES)
    # by hand, in float64: KL(p_t || p_s) at tau = 3, summed, x tau^2 / (batch x classes) (DeiT's losses.py)
    student = LOGITS.double().numpy()

    def log_softmax(z):
        z = z / 3.0
        return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)

    log_t, log_s = log_softmax(teacher_logits), log_softmax(student)
    soft = (np.exp(log_t) * (log_t - log_s)).sum() * 9.0 / student.size
    expected = 0.9 * _cross_entropy_by_hand(LOGITS, LABELS).item() + 0.1 * soft
    assert soft > 1e-4 and loss.item() == pytest.approx(expected, rel=1e-5)


# The students with DeiT's distillation token, one block at 16 px: DeiT-Ti, and XCiT-N12 (its token in class attention).
DISTILLED_STUDENTS = {"deit": ("deit_tiny_distilled_p16", "{patch_size: 4, depth: 1}"),
                      "xcit": ("xcit_nano_12_distilled_p16", "{patch_size: 8, depth: 1}")}


def _distilled_student_config(checkpoint, *overrides: str, student: str = "deit"):
    """A student with the distillation token, distilled from the fixture's teacher."""
    name, args = DISTILLED_STUDENTS[student]
    return _config(f"model.name={name}", f"model.args={args}",
                   "distill.teacher=xcit_nano_12_p8", f"distill.teacher_checkpoint={checkpoint}",
                   'distill.teacher_args={"img_size": 16, "depth": 1}', *overrides)


def test_a_distillation_token_learns_the_teacher_while_the_class_head_learns_the_labels(teacher):
    from models.layers.heads import DistilledLogits

    model, checkpoint = teacher
    with torch.no_grad():
        teacher_labels = model(IMAGES).argmax(-1)
    dist_logits = LOGITS.flip(0)
    loss = _training_loss(_distilled_student_config(checkpoint, "distill.alpha=0.3"))(
        DistilledLogits(LOGITS, dist_logits), LABELS, IMAGES)
    # DeiT's losses.py: the base loss on the class head's output, the distillation loss on the token's
    by_hand = 0.7 * _cross_entropy_by_hand(LOGITS, LABELS) + 0.3 * _cross_entropy_by_hand(dist_logits, teacher_labels)
    torch.testing.assert_close(loss, by_hand)


@pytest.mark.parametrize("student", DISTILLED_STUDENTS)
def test_the_distillation_token_and_its_head_train(teacher, student):
    from pipeline.components.modeling import build_model

    _, checkpoint = teacher
    cfg = _distilled_student_config(checkpoint, student=student)
    torch.manual_seed(0)
    student = build_model(cfg.model, 10).train()
    loss_of = _training_loss(cfg)
    before = {name: p.detach().clone() for name, p in student.named_parameters() if name in ("dist_token", "head_dist.weight")}
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):  # one fixed batch: the student fits it
        optimizer.zero_grad()
        loss = loss_of(student(IMAGES), LABELS, IMAGES)
        loss.backward()
        assert student.dist_token.grad.abs().sum() > 0 and student.head_dist.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(not torch.equal(p, before[name]) for name, p in student.named_parameters() if name in before)
    assert student.eval()(IMAGES).shape == (6, 10)  # one output at inference: the heads' mean


def test_a_distillation_token_without_a_teacher_is_refused_before_any_training():
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="deit_tiny_distilled_p16 has DeiT's distillation token"):
        _config("model.name=deit_tiny_distilled_p16", "model.args={patch_size: 4, depth: 1}")


def test_the_configured_teacher_runs_in_the_training_precision_it_is_given(teacher):
    _, checkpoint = teacher
    cfg = _config("distill.teacher=xcit_nano_12_p8", f"distill.teacher_checkpoint={checkpoint}",
                  'distill.teacher_args={"img_size": 16, "depth": 1}')
    loss = build_training_loss(cfg, BatchAugment(cfg.data.augment, 10), 10, torch.device("cpu"),
                               teacher_precision=torch.autocast("cpu", dtype=torch.bfloat16))
    output_dtypes = []
    loss.distillation.teacher.register_forward_hook(lambda module, args, output: output_dtypes.append(output.dtype))
    loss(LOGITS, LABELS, IMAGES)
    assert output_dtypes == [torch.bfloat16]
