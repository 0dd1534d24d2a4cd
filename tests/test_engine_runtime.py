"""What the worker applies to a real DeepSpeed engine: BatchNorm inside a bf16 model keeps fp32 running
statistics that follow the data as an fp32 run's do (in bf16 a running variance near 1 stops short of
the data's 1.05), and `deepspeed.compile` compiles the engine without changing its steps."""
import os

import pytest
import torch
from torch import nn

from pipeline.config import load_config
from pipeline.engine import compile_engine, deepspeed_config, input_dtype, keep_batchnorm_in_fp32

os.environ.setdefault("DS_ACCELERATOR", "cpu")
DATA_VARIANCE = 1.05


def train_batchnorm_model(precision: str, steps: int = 40, compiled: bool = False):
    """A conv + BatchNorm model trained ``steps`` AdamW steps by a real DeepSpeed engine: (its BN, losses)."""
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():  # a frozen conv passing the data through: BN sees the data's variance in both runs
        model[0].weight.copy_(torch.eye(4, 3).view(4, 3, 1, 1))
    model[0].weight.requires_grad_(False)
    cfg = load_config("smoke", [f"deepspeed.precision={precision}", "optim.micro_batch_size=64",
                                f"deepspeed.compile={compiled}"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model[1:].parameters(), lr=1e-3),
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    assert keep_batchnorm_in_fp32(engine.module) == 1
    assert compile_engine(engine, cfg) is compiled and engine.is_compiled is compiled
    dtype = input_dtype(cfg)
    generator, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        images = torch.randn(64, 3, 4, 4, generator=generator) * DATA_VARIANCE**0.5
        loss = engine(images.to(dtype)).float().logsumexp(1).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine.module[1], losses


def test_bf16_batchnorm_running_statistics_stay_fp32_and_match_an_fp32_run(single_process_group):
    (bf16, _), (fp32, _) = train_batchnorm_model("bf16"), train_batchnorm_model("fp32")
    assert bf16.running_var.dtype == bf16.running_mean.dtype == torch.float32
    assert fp32.running_var[:3].mean().item() == pytest.approx(DATA_VARIANCE, abs=0.03)  # sampling noise
    torch.testing.assert_close(bf16.running_var, fp32.running_var, atol=2e-3, rtol=0)
    torch.testing.assert_close(bf16.running_mean, fp32.running_mean, atol=2e-3, rtol=0)


def test_bf16_batchnorm_keeps_bf16_parameters_and_returns_bf16_activations(single_process_group):
    batchnorm, _ = train_batchnorm_model("bf16", steps=2)
    assert batchnorm.weight.dtype == batchnorm.bias.dtype == torch.bfloat16  # DeepSpeed's flat bf16 groups
    assert batchnorm(torch.randn(2, 4, 4, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert isinstance(batchnorm.weight, nn.Parameter)  # the hooks put the Parameters back


def test_a_compiled_bf16_engine_takes_the_same_steps_as_the_eager_one(single_process_group):
    (eager_bn, eager), (compiled_bn, compiled) = train_batchnorm_model("bf16", 3), train_batchnorm_model("bf16", 3, True)
    assert compiled == pytest.approx(eager, rel=2e-2)  # bf16 kernels fused differently
    torch.testing.assert_close(compiled_bn.running_var, eager_bn.running_var, atol=2e-3, rtol=0)
