"""The training loss is one function of (model output, targets, images), whatever the recipe."""
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_model

import models  # noqa: F401
from pipeline.config import DataConfig, DistillConfig
from pipeline.distillation import HardDistillationLoss, build_teacher
from pipeline.losses import TrainingLoss


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
    distillation = HardDistillationLoss(torch.nn.CrossEntropyLoss(), teacher, alpha=0.5, data=DataConfig())
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    branches = (torch.randn(4, 10), torch.randn(4, 10))
    loss = TrainingLoss(torch.nn.CrossEntropyLoss(), distillation)(branches, labels, images)
    assert len(calls) == 1
    assert torch.allclose(loss, distillation(branches[0], labels, images) + distillation(branches[1], labels, images))
