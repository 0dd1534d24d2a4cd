"""DeiT's distillation: the teacher's argmax (hard) or softened distribution (soft) is the second target;
bad teachers fail early."""
import math
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_model

import models  # noqa: F401
from pipeline.config.schema import DataConfig, DistillConfig
from pipeline.components.distillation import DistillationLoss, build_teacher, soft_distillation
from pipeline.errors import InvalidInputError
from pipeline.trained.teacher import TEACHER_FILE


def _distill(path) -> DistillConfig:
    return DistillConfig(teacher="xcit_nano_12_p8", teacher_args={"img_size": 16, "depth": 1},
                         teacher_checkpoint=str(path))


def test_teacher_is_frozen_and_loaded_from_its_checkpoint(teacher_checkpoint):
    teacher = build_teacher(_distill(teacher_checkpoint), num_classes=10)
    assert not any(p.requires_grad for p in teacher.parameters())
    reference = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=1)
    from safetensors.torch import load_model

    load_model(reference, str(teacher_checkpoint))
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():  # as the teacher runs
        expected = reference.eval()(images)
    # The same weights: equal up to fp32 rounding, which the kernels' thread split changes (~1e-7)
    torch.testing.assert_close(teacher(images), expected, rtol=1e-5, atol=1e-6)


def test_loss_mixes_task_loss_and_cross_entropy_to_teacher_argmax(teacher_checkpoint):
    teacher = build_teacher(_distill(teacher_checkpoint), num_classes=10)
    loss_fn = DistillationLoss(torch.nn.CrossEntropyLoss(), teacher, DistillConfig(alpha=0.25), data=DataConfig())
    images, logits, labels = torch.randn(4, 3, 16, 16), torch.randn(4, 10), torch.randint(0, 10, (4,))
    teacher_labels = teacher(images).argmax(-1)
    expected = 0.75 * F.cross_entropy(logits, labels) + 0.25 * F.cross_entropy(logits, teacher_labels)
    assert torch.allclose(loss_fn(logits, labels, images), expected)


def test_soft_distillation_is_deits_kl_at_temperature_on_fixed_logits():
    # two samples, three classes, tau = 2: softmax by hand of z / 2
    student = torch.tensor([[2.0, 0.0, -2.0], [0.0, 0.0, 0.0]])
    teacher = torch.tensor([[0.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    e = math.e
    p_s = [[e / (e + 1 + 1 / e), 1 / (e + 1 + 1 / e), (1 / e) / (e + 1 + 1 / e)], [1 / 3, 1 / 3, 1 / 3]]
    p_t = [[1 / (2 + e), e / (2 + e), 1 / (2 + e)], [e**2 / (e**2 + 2), 1 / (e**2 + 2), 1 / (e**2 + 2)]]
    kl = sum(t * math.log(t / s_) for row_t, row_s in zip(p_t, p_s) for t, s_ in zip(row_t, row_s))
    assert soft_distillation(student, teacher, tau=2.0).item() == pytest.approx(kl * 4 / 6, rel=1e-6)
    assert soft_distillation(teacher, teacher, tau=2.0).item() == pytest.approx(0.0, abs=1e-7)  # nothing to learn


def test_tau_applies_to_soft_distillation_only():
    with pytest.raises(ValueError, match="tau=3 applies to kind=soft only"):
        DistillConfig(tau=3.0)
    assert DistillConfig(kind="soft", tau=3.0).tau == 3.0


def test_checkpoint_of_another_architecture_is_invalid_input(tmp_path):
    other = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=2)
    path = tmp_path / "other.safetensors"
    save_model(other, str(path))
    with pytest.raises(InvalidInputError, match="does not fit the teacher"):
        build_teacher(_distill(path), num_classes=10)


def test_missing_teacher_checkpoint_is_invalid_input(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        build_teacher(_distill(tmp_path / "missing.safetensors"), num_classes=10)


@pytest.mark.slow
def test_a_distilled_run_under_zero3_completes_and_records_the_teacher(finished_run, teacher_source):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    storage, _, result = finished_run
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["deepspeed.zero_stage"] == "3"
    assert run.data.params["distill.teacher_from"] == str(teacher_source)  # the source as the user gave it
    assert f"  distilling from {teacher_source} (hard)" in result.stdout
    # the teacher the workers read: the source's weights, saved once in the run directory
    saved, given = load_file(storage / "done" / TEACHER_FILE), load_file(teacher_source)
    assert saved.keys() == given.keys() and all(torch.equal(saved[key], given[key]) for key in saved)
    # the student has DeiT's distillation token: its head starts with zero bias (timm's ViT init) and learned
    # the teacher; inference averages both heads (test_fault_injection scores the run's metrics with them)
    final = load_file(client.download_artifacts(run.info.run_id, "model.safetensors", str(storage)))
    assert run.data.params["model.name"] == "deit_tiny_distilled_p16" and "dist_token" in final
    assert final["head_dist.bias"].abs().sum() > 0 and not torch.equal(final["head_dist.weight"], final["head.weight"])


def test_a_teacher_from_a_model_source_is_its_card_s_model_normalised_as_trained(teacher_source, teacher_checkpoint,
                                                                                  tmp_path):
    from safetensors.torch import load_model

    from pipeline.trained.teacher import load_teacher, resolve_teacher

    found = resolve_teacher(DistillConfig(teacher_from=str(teacher_source)), num_classes=10, img_size=16, sizes=[16],
                            run_dir=str(tmp_path / "run"), storage_path=str(tmp_path), tracking_uri="unused:")
    found.save()
    teacher = load_teacher(found.location, img_size=16)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    reference = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=1).eval()
    load_model(reference, str(teacher_checkpoint))
    images = torch.randn(2, 3, 16, 16)  # as the student sees them: normalised by ImageNet's statistics
    student_mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    student_std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    pixels = images * student_std + student_mean
    with torch.no_grad():
        expected = reference((pixels - 0.5) / 0.25)  # the card's normalisation, by hand
        given = teacher(teacher.normalize_input(images, student_mean, student_std))
    torch.testing.assert_close(given, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source, classes, message", [
    ("teacher_source", 2, "it classifies 10 classes and the student's data has 2"),
    ("teacher_checkpoint", 10, "is a bare weights file: it does not say which model it holds; give it as "
                               "distill.teacher"),
])
def test_a_teacher_that_cannot_teach_the_student_is_refused_naming_it(source, classes, message, request, tmp_path):
    from pipeline.trained.teacher import resolve_teacher

    path = request.getfixturevalue(source)
    with pytest.raises(InvalidInputError, match=re.escape(f"distill.teacher_from='{path}'") + ":? " + message):
        resolve_teacher(DistillConfig(teacher_from=str(path)), num_classes=classes, img_size=16, sizes=[16],
                        run_dir=str(tmp_path / "run"), storage_path=str(tmp_path), tracking_uri="unused:")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_teacher_is_given_one_way():
    with pytest.raises(ValueError, match="give one of the two"):
        DistillConfig(teacher_from="runs:/abc/model", teacher="xcit_nano_12_p8", teacher_checkpoint="t.safetensors")
    assert DistillConfig(teacher_from="models:/digits@champion").enabled and not DistillConfig().enabled


@pytest.mark.slow
def test_a_run_without_an_ema_logs_no_ema_metrics_or_weights(finished_run):
    """The EMA's records appear exactly when it is on: test_training's run keeps one, this one does not."""
    from mlflow.tracking import MlflowClient

    storage, _, _ = finished_run
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id])
    assert run.data.params["optim.ema_decay"] == "None"
    assert not [metric for metric in ("val_top1_ema", "val_top5_ema", "val_loss_ema")
                if client.get_metric_history(run.info.run_id, metric)]
    assert "model_ema.safetensors" not in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_a_sweep_checks_each_trials_teacher_once_per_input_size_and_names_the_trials_that_cannot_use_it(
        teacher_source, tmp_path):
    from pipeline.config.loading import load_config
    from pipeline.sweeps.planning import Candidate, check_teachers
    from pipeline.sweeps.spaces import SpaceError

    def candidate(img_size):
        cfg = load_config("smoke", [f"distill.teacher_from={teacher_source}", f"model.img_size={img_size}",
                                    f"run.storage_path={tmp_path}"])
        return Candidate({"model.img_size": img_size}, {"model.img_size": img_size}, cfg, None)

    sources = check_teachers([candidate(16), candidate(16), candidate(24)], num_classes=10, tracking_uri="unused:")
    assert list(sources) == [(str(teacher_source), False)]  # saved beside the trials' initial weights
    assert sources[str(teacher_source), False].card.model.name == "xcit_nano_12_p8"
    with pytest.raises(SpaceError, match=r"trials with model.img_size=16: distill.teacher_from=.* it classifies 10 "
                                         r"classes and the student's data has 3"):
        check_teachers([candidate(16)], num_classes=3, tracking_uri="unused:")


def test_a_teacher_must_run_on_every_crop_size_the_student_is_fed(tmp_path):
    from pipeline.components.model_card import ModelCard
    from pipeline.config.schema import ModelConfig
    from pipeline.trained.model_source import ModelSource, Provenance
    from pipeline.trained.teacher import check_teacher

    # a DeiT teacher with its fixed 4 x 4 position table at 64 px: it teaches a 64 px student, not its 32 px crops
    card = ModelCard(model=ModelConfig(name="deit_tiny_p16", img_size=64, args={"depth": 1}), num_classes=10)
    weights = timm.create_model("deit_tiny_p16", img_size=64, num_classes=10, depth=1).state_dict()
    source = ModelSource(weights, card, Provenance("deit-teacher", "safetensors", str(tmp_path / "t.safetensors")))
    check_teacher(source, num_classes=10, img_size=64, sizes=[64])
    with pytest.raises(InvalidInputError, match=r"distill.teacher_from='deit-teacher': its model deit_tiny_p16 cannot "
                                                r"run on the student's 32 px crops \(data.progressive\): Input height "
                                                r"\(32\) doesn't match model \(64\)"):
        check_teacher(source, num_classes=10, img_size=64, sizes=[32, 48, 64])
    with pytest.raises(InvalidInputError, match=r"its model deit_tiny_p16 \(trained at 64 px\) cannot teach at the "
                                                r"student's 40 px: "):
        check_teacher(source, num_classes=10, img_size=40)


def test_a_restarted_run_keeps_its_saved_teacher_and_refuses_another(teacher_source, tmp_path):
    from pipeline.trained.teacher import resolve_teacher

    run = dict(num_classes=10, img_size=16, sizes=[16], run_dir=str(tmp_path / "run"), storage_path=str(tmp_path),
               tracking_uri="unused:")
    resolve_teacher(DistillConfig(teacher_from=str(teacher_source)), **run).save()
    again = resolve_teacher(DistillConfig(teacher_from=str(teacher_source)), **run)
    assert again.source.provenance.given == str(teacher_source)  # read back from the run directory
    with pytest.raises(InvalidInputError, match=re.escape(
            f"{tmp_path / 'run'} distils from the teacher it saved when it started, '{teacher_source}'; this config "
            "names 'runs:/0123/model' (its EMA weights): give the run another run.name")):
        resolve_teacher(DistillConfig(teacher_from="runs:/0123/model", teacher_ema=True), **run)


def test_a_teacher_that_names_no_model_source_is_refused_naming_the_key(tmp_path):
    from pipeline.trained.teacher import resolve_teacher

    with pytest.raises(InvalidInputError, match=r"^distill.teacher_from: model source 'nosuchrun' does not exist"):
        resolve_teacher(DistillConfig(teacher_from="nosuchrun"), num_classes=10, img_size=16, sizes=[16],
                        run_dir=str(tmp_path / "run"), storage_path=str(tmp_path), tracking_uri="unused:")


def test_teacher_ema_takes_a_sources_ema_and_needs_one():
    assert DistillConfig(teacher_from="digits16", teacher_ema=True).teacher_ema
    with pytest.raises(ValueError, match="teacher_ema takes the EMA weights of distill.teacher_from, which is not set"):
        DistillConfig(teacher_ema=True)
