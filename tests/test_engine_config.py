"""The DeepSpeed JSON is derived from the experiment config, never typed separately."""
import pytest

from pipeline.config.loading import load_config
from pipeline.components.engine import ZERO_BUCKET_ELEMENTS, deepspeed_config


def test_train_batch_size_is_micro_times_accumulation_times_world_size():
    cfg = load_config("smoke", ["optim.micro_batch_size=16", "optim.grad_accum_steps=4"])
    ds = deepspeed_config(cfg, world_size=8)
    assert ds["train_batch_size"] == 16 * 4 * 8
    assert ds["train_micro_batch_size_per_gpu"] == 16 and ds["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_is_passed_through(stage):
    assert deepspeed_config(load_config("smoke", [f"deepspeed.zero_stage={stage}"]), 2)["zero_optimization"]["stage"] == stage


@pytest.mark.parametrize("precision,bf16,fp16", [("fp32", False, False), ("bf16", True, False)])
def test_precision_switches_exactly_one_mode(precision, bf16, fp16):
    ds = deepspeed_config(load_config("smoke", [f"deepspeed.precision={precision}"]), 2)
    assert ds["bf16"]["enabled"] is bf16 and ds["fp16"]["enabled"] is fp16


def test_fp16_on_gpus_uses_dynamic_loss_scaling():
    cfg = load_config("smoke", ["deepspeed.precision=fp16", "scaling.use_gpu=true", "scaling.gpus_per_worker=1"])
    ds = deepspeed_config(cfg, 8)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0}


def test_gradient_clipping_follows_grad_clip_and_is_off_without_it():
    assert deepspeed_config(load_config("smoke", ["optim.grad_clip=1.0"]), 2)["gradient_clipping"] == 1.0
    assert deepspeed_config(load_config("smoke"), 2)["gradient_clipping"] == 0.0


def test_optimizer_offload_goes_to_cpu():
    ds = deepspeed_config(load_config("smoke", ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=true"]), 2)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_half_precision_casts_buffers_with_parameters():
    # BatchNorm's running statistics go back to fp32 after initialize (keep_batchnorm_in_fp32).
    assert deepspeed_config(load_config("smoke", ["deepspeed.precision=bf16"]), 2)["data_types"] == {"buffer_dtype": "bf16"}
    assert "data_types" not in deepspeed_config(load_config("smoke"), 2)


GPU = ["scaling.use_gpu=true", "scaling.gpus_per_worker=1"]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_gpus_overlaps_gradient_reduction_with_backward(stage):
    zero = deepspeed_config(load_config("smoke", [*GPU, f"deepspeed.zero_stage={stage}"]), 8)["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == ZERO_BUCKET_ELEMENTS


def test_zero_buckets_split_an_xcit_s12_so_reduction_starts_during_backward():
    from models.measure import build_on_meta, count_params

    params = count_params(build_on_meta("xcit_small_12_p16"))  # 26 M: the A100 job's model
    assert params / ZERO_BUCKET_ELEMENTS >= 3  # DeepSpeed's default 5e8 bucket: one, after backward


def test_cpu_runs_keep_deepspeeds_zero_defaults():
    zero = deepspeed_config(load_config("smoke", ["deepspeed.zero_stage=2"]), 2)["zero_optimization"]
    assert zero == {"stage": 2}
