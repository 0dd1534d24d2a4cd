"""One-flag profiling (pipeline.components.profiling): the trace holds exactly the steps asked, after the
two it leaves out, each step's ops inside its ``ProfilerStep`` span, as torch's own Chrome trace format
reads (json); a run that ends early says what its trace holds. (A run's trace as an MLflow artifact:
test_training's ZeRO-2 bf16 run.)"""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.components.profiling import OPS_FILE, TRACE_FILE, StepProfiler

FIRST_TRACED_STEP = 3  # the documented start: the command's first step and one of warm-up are left out


@pytest.fixture(autouse=True)
def _kinetos_log_level_restored(monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)  # a CPU profiler quiets kineto in its process


def _train(steps: int, profiler: StepProfiler) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        nn.functional.cross_entropy(model(torch.randn(4, 12)), torch.randint(0, 5, (4,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step()


def _events(directory: Path) -> list[dict]:
    return json.loads((directory / TRACE_FILE).read_text())["traceEvents"]


def _step_spans(events: list[dict]) -> dict[str, tuple[float, float]]:
    return {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"}


@pytest.mark.parametrize("asked", [1, 3])
def test_the_trace_holds_the_steps_asked_after_the_first_two_each_with_its_forward_backward_and_update(asked):
    written: list[Path] = []
    profiler = StepProfiler(asked, torch.device("cpu"), written.append)
    _train(FIRST_TRACED_STEP - 1 + asked + 2, profiler)  # two steps more than the profile needs
    assert profiler.finish() == asked
    (directory,) = written  # once, when its last step was traced
    events = _events(directory)
    spans = _step_spans(events)
    # torch numbers a step by the profiler.step() calls before it: the third training step is ProfilerStep#2
    assert sorted(spans) == [f"ProfilerStep#{n}" for n in range(FIRST_TRACED_STEP - 1, FIRST_TRACED_STEP - 1 + asked)]
    for start, end in spans.values():
        inside = {e["name"] for e in events if e.get("ph") == "X" and start <= e["ts"] and e["ts"] + e.get("dur", 0) <= end}
        assert {"aten::addmm", "aten::gelu", "aten::gelu_backward"} <= inside, sorted(inside)
        assert any(name.startswith("Optimizer.step#AdamW") for name in inside), sorted(inside)
    assert "aten::addmm" in (directory / OPS_FILE).read_text()  # the table of ops by their own time


def test_a_run_that_ends_inside_the_profile_writes_what_it_traced_and_says_how_much():
    written: list[Path] = []
    profiler = StepProfiler(3, torch.device("cpu"), written.append)
    _train(FIRST_TRACED_STEP, profiler)  # one traced step of the three
    assert profiler.finish() == 1
    (directory,) = written
    traced = [name for name, (start, end) in _step_spans(_events(directory)).items() if end > start]
    assert f"ProfilerStep#{FIRST_TRACED_STEP - 1}" in traced


@pytest.mark.parametrize("steps", [0, FIRST_TRACED_STEP - 1])
def test_a_run_that_ends_before_the_first_traced_step_writes_no_trace(steps):
    written: list[Path] = []
    profiler = StepProfiler(2, torch.device("cpu"), written.append)
    _train(steps, profiler)
    assert profiler.finish() == 0
    assert written == []
