"""The A100 job configs (cluster/jobs/*.yaml) follow the README's scaling rules: global batch =
micro batch x accumulation x GPUs, the learning rate given per 512 images so that it follows the
batch, ZeRO-2 unless the model states do not fit."""
from pathlib import Path

import pytest

from pipeline.config.loading import load_config
from pipeline.components.engine import deepspeed_config
from pipeline.components.lr_scaling import effective_lr, global_batch_size

JOBS = sorted((Path(__file__).resolve().parents[1] / "cluster" / "jobs").glob("*.yaml"))
BASE_LR, BASE_BATCH = 5e-4, 512  # DeiT/XCiT: lr = 5e-4 x global batch / 512
A100_BYTES = 40 * 2**30  # the smaller A100 (p4d.24xlarge, a2-highgpu-8g)


def zero_model_state_bytes(params: int, stage: int, world_size: int) -> float:
    """Per-GPU bytes of bf16 weights and gradients plus fp32 Adam state (master, m, v: 12 bytes),
    as ZeRO partitions them (Rajbhandari et al. 2020, Fig. 1: 2 + 2 + 12 bytes per parameter)."""
    weights, grads, optimizer = 2 * params, 2 * params, 12 * params
    if stage >= 1:
        optimizer /= world_size
    if stage >= 2:
        grads /= world_size
    if stage >= 3:
        weights /= world_size
    return weights + grads + optimizer


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_global_batch_is_micro_batch_times_accumulation_times_gpus(path):
    cfg = load_config(str(path))
    gpus = cfg.scaling.num_workers * cfg.scaling.gpus_per_worker
    assert deepspeed_config(cfg, cfg.scaling.num_workers)["train_batch_size"] == (
        cfg.optim.micro_batch_size * cfg.optim.grad_accum_steps * gpus)


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_gives_deits_rate_per_512_images_so_the_rate_follows_the_cluster(path):
    cfg = load_config(str(path))
    assert cfg.optim.lr is None and cfg.optim.lr_per_512 == BASE_LR  # never an absolute rate
    assert cfg.optim.schedule.warmup_epochs >= 5  # large batches need the warmup the rule comes with
    # One node instead of eight: XCiT's own global batch and rate, with no edit of the rate.
    one_node = load_config(str(path), [f"scaling.num_workers={cfg.scaling.num_workers // 8}"])
    assert global_batch_size(one_node.optim, one_node.scaling.num_workers) == 1024
    assert effective_lr(one_node.optim, one_node.scaling.num_workers) == pytest.approx(BASE_LR * 1024 / BASE_BATCH)


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_uses_zero2_because_its_model_states_fit_one_a100(path):
    from models.measure import count_params
    from pipeline.components.modeling import build_model

    cfg = load_config(str(path))
    params = count_params(build_model(cfg.model, 1000, device="meta"))
    # ZeRO-3 would add a parameter all-gather per layer; it pays only when ZeRO-2 leaves too little
    # of the GPU for activations (here: model states over half of it).
    assert zero_model_state_bytes(params, 2, cfg.scaling.num_workers) < A100_BYTES / 2
    assert cfg.deepspeed.zero_stage == 2


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_job_trains_on_gpus_in_bf16_one_worker_per_gpu(path):
    cfg = load_config(str(path))
    assert cfg.scaling.use_gpu and cfg.scaling.gpus_per_worker == 1
    assert cfg.deepspeed.precision == "bf16"  # A100 has bf16: no loss scaling to tune
    assert cfg.run.max_failures > 0  # losing one of 8 nodes restarts from the latest checkpoint
