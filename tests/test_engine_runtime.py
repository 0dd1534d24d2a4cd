"""What the worker applies to a real DeepSpeed engine: BatchNorm inside a bf16 model keeps fp32 running
statistics that follow the data as an fp32 run's do (in bf16 a running variance near 1 stops short of
the data's 1.05), `deepspeed.compile` compiles the engine without changing its steps, ZeRO sums bf16
gradients across ranks in fp32 (``deepspeed.reduce_in_fp32``), and DeepSpeed's CPU comm op is built once,
whichever shell a run starts from."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.config.loading import load_config
from pipeline.components.engine import compile_engine, deepspeed_config, input_dtype, keep_batchnorm_in_fp32

os.environ.setdefault("DS_ACCELERATOR", "cpu")
DATA_VARIANCE = 1.05


def train_batchnorm_model(precision: str, steps: int = 40, compiled: bool = False, *overrides: str):
    """A conv + BatchNorm model trained ``steps`` AdamW steps by a real DeepSpeed engine: (its BN, losses)."""
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():  # a frozen conv passing the data through: BN sees the data's variance in both runs
        model[0].weight.copy_(torch.eye(4, 3).view(4, 3, 1, 1))
    model[0].weight.requires_grad_(False)
    cfg = load_config("smoke", [f"deepspeed.precision={precision}", "optim.micro_batch_size=64",
                                f"deepspeed.compile={compiled}", *overrides])
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


def test_the_compile_backend_is_the_configs(single_process_group):
    """aot_eager captures and differentiates the graphs (AOT autograd compiles them) and generates no code:
    torch._dynamo's own counters, which inductor adds to for every graph it lowers."""
    from torch._dynamo.utils import counters

    counters.clear()
    train_batchnorm_model("fp32", 1, True, "deepspeed.compile_backend=aot_eager")
    assert counters["aot_autograd"]["total"] >= 1 and not counters["inductor"], dict(counters)


def test_a_compiled_bf16_engine_takes_the_same_steps_as_the_eager_one(single_process_group):
    (eager_bn, eager), (compiled_bn, compiled) = train_batchnorm_model("bf16", 3), train_batchnorm_model("bf16", 3, True)
    assert compiled == pytest.approx(eager, rel=2e-2)  # bf16 kernels fused differently
    torch.testing.assert_close(compiled_bn.running_var, eager_bn.running_var, atol=2e-3, rtol=0)


@pytest.mark.parametrize("reduce_in_fp32,reduced_in", [(True, torch.float32), (False, torch.bfloat16)])
def test_a_bf16_zero_engine_sums_gradients_across_ranks_in_fp32_unless_told_otherwise(single_process_group,
                                                                                       reduce_in_fp32, reduced_in):
    import deepspeed

    cfg = load_config("smoke", ["deepspeed.precision=bf16", "deepspeed.zero_stage=2",
                                f"deepspeed.reduce_in_fp32={str(reduce_in_fp32).lower()}"])
    layer = nn.Linear(4, 2)
    engine, _, _, _ = deepspeed.initialize(model=layer, optimizer=torch.optim.AdamW(layer.parameters()),
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    assert next(layer.parameters()).dtype == torch.bfloat16
    assert engine.optimizer.communication_data_type == reduced_in  # the dtype ZeRO casts gradients to for the sum


LOAD_THE_CPU_COMM_OP = ("from pipeline.components.engine import use_the_environments_ninja; use_the_environments_ninja(); "
                        "from deepspeed.accelerator import get_accelerator; "
                        "print(get_accelerator().create_op_builder('ShareMemCommBuilder').load().__file__)")


def _load_the_cpu_comm_op(path: str) -> Path:
    """Where a fresh worker-like process with ``path`` as its PATH loads DeepSpeed's CPU comm op from."""
    loaded = subprocess.run([sys.executable, "-c", LOAD_THE_CPU_COMM_OP], capture_output=True, text=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu", "PATH": path}, cwd=Path(__file__).parents[1])
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    return Path(loaded.stdout.split()[-1])


def test_deepspeeds_cpu_comm_op_is_built_once_whichever_ninja_a_shell_finds_first():
    # A shell with the venv activated finds pip's ninja first, one without it the system's (Debian's);
    # ninja 1.13 and 1.11 read each other's build log as stale, and rebuilt the op at every switch.
    venv = Path(sys.executable).parent
    venv_first = f"{venv}{os.pathsep}{os.environ['PATH']}"
    system_first = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if Path(d) != venv)
    built = _load_the_cpu_comm_op(venv_first)
    build_log = (built.parent / ".ninja_log").read_text()
    for path in (system_first, venv_first):
        assert _load_the_cpu_comm_op(path) == built
        assert (built.parent / ".ninja_log").read_text() == build_log, f"rebuilt with PATH={path}"
