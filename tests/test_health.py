"""Step-level health (pipeline.components.health), each figure against another way of getting it: the
gradient norm against ``torch.nn.utils.clip_grad_norm_`` on the same gradients (a real DeepSpeed engine,
each way it keeps or does not keep one), the data-wait share against a loader slowed by a known sleep, peak
memory against what psutil says the process holds, and the all_gather over 2 gloo ranks against each rank's
own numbers. (A run's MLflow steps: test_training's ZeRO-2 bf16 run.)"""
import copy
import multiprocessing
import os
import time

import psutil
import pytest
import torch
from torch import nn

from conftest import free_port
from pipeline.components.engine import deepspeed_config
from pipeline.components.health import (HEALTH_PREFIX, HealthReport, LossSpikes, StepHealth, computes_grad_norm,
                                        peak_memory_bytes, step_measuring_grad_norm)
from pipeline.config.loading import load_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")
CLIP = 0.05  # far below these gradients' norm: every step is clipped


@pytest.mark.parametrize("zero_stage,deepspeed_norm", [(0, False), (1, True), (2, True)],
                         ids=["zero0-torch-optimizer", "zero1", "zero2"])
def test_the_grad_norm_before_clipping_is_clip_grad_norm_s_on_the_same_gradients(single_process_group, zero_stage,
                                                                                 deepspeed_norm):
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))
    reference = copy.deepcopy(model)
    cfg = load_config("smoke", [f"deepspeed.zero_stage={zero_stage}", f"optim.grad_clip={CLIP}",
                                "optim.micro_batch_size=8"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    assert computes_grad_norm(engine) is deepspeed_norm
    images, labels = torch.randn(8, 12), torch.randint(0, 5, (8,))

    engine.backward(nn.functional.cross_entropy(engine(images), labels))
    measured = step_measuring_grad_norm(engine, deepspeed_norm)
    nn.functional.cross_entropy(reference(images), labels).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)  # the norm it measured, then clipped

    assert expected > 10 * CLIP
    torch.testing.assert_close(torch.as_tensor(measured, dtype=torch.float32), expected, rtol=1e-5, atol=0)


def test_the_window_reports_its_losses_the_last_norm_and_the_share_of_steps_clipped():
    health = StepHealth(torch.device("cpu"), grad_clip=1.0)
    for loss, norm in [(2.0, 0.5), (4.0, 2.0), (3.0, None), (1.0, 3.0)]:  # None: no optimizer step (accumulating)
        health.add_step(torch.tensor(loss), norm)
    report = health.gather(world_size=1)
    assert (report.loss_sum, report.steps, report.loss_max, report.grad_norm) == (10.0, 4, 4.0, 3.0)
    assert report.clipped_share == pytest.approx(2 / 3)  # 2.0 and 3.0 of the 3 steps taken exceed 1.0
    metrics = report.metrics()
    assert metrics[f"{HEALTH_PREFIX}loss"] == 2.5 and metrics[f"{HEALTH_PREFIX}loss_max"] == 4.0
    assert health.gather(world_size=1).steps == 0  # each gather starts a new window


def test_a_window_without_an_optimizer_step_has_no_grad_norm_and_nothing_clipped():
    health = StepHealth(torch.device("cpu"), grad_clip=None)
    health.add_step(torch.tensor(1.0), None)
    report = health.gather(world_size=1)
    assert report.grad_norm is None and report.clipped_share == 0.0
    assert f"{HEALTH_PREFIX}grad_norm" not in report.metrics()


def _window(mean: float, top: float) -> HealthReport:
    return HealthReport(loss_sum=10 * mean, steps=10, loss_max=top, grad_norm=1.0, clipped_share=0.0,
                        data_wait_share=[0.1], peak_memory_bytes=[2**30])


def test_a_window_whose_max_loss_exceeds_the_factor_times_the_running_median_is_a_spike():
    spikes = LossSpikes(factor=5.0, history=4, warmup=3)
    assert not spikes.observe(_window(2.0, 50.0))  # no median yet: the first 3 windows are never spikes
    assert not spikes.observe(_window(1.8, 2.2)) and not spikes.observe(_window(1.6, 2.0))
    assert not spikes.observe(_window(1.5, 9.0))  # median(2.0, 1.8, 1.6) = 1.8: 9.0 is not over 5 x 1.8
    assert spikes.observe(_window(1.4, 8.6)) and spikes.median == pytest.approx(1.7)  # median(2.0, 1.8, 1.6, 1.5) = 1.7: 8.5
    assert spikes.observe(_window(1.3, 8.0)) and spikes.median == pytest.approx(1.55)  # the last 4: 1.8 1.6 1.5 1.4
    assert spikes.count == 2


def test_the_run_ends_at_its_limits_spike_and_says_why():
    spikes = LossSpikes(factor=5.0, limit=2, history=4, warmup=3)
    for mean, top in [(2.0, 2.0), (2.0, 2.0), (2.0, 2.0), (2.0, 11.0)]:  # median 2: 11 is over 5 x 2
        spikes.observe(_window(mean, top))
    assert spikes.count == 1 and not spikes.exhausted  # one of two
    spikes.observe(_window(2.0, 10.5))
    assert spikes.exhausted and spikes.cause == "2 loss spikes over 5x the running median"
    unlimited = LossSpikes(factor=5.0, history=4, warmup=3)  # run.max_loss_spikes null: never
    for mean, top in [(2.0, 2.0)] * 3 + [(2.0, 50.0)] * 5:
        unlimited.observe(_window(mean, top))
    assert unlimited.count == 5 and not unlimited.exhausted


def _slow_loader(batches: int, sleep_s: float):
    for index in range(batches):
        time.sleep(sleep_s)
        yield index


def test_the_data_wait_share_is_the_loaders_sleep_over_the_windows_time():
    health = StepHealth(torch.device("cpu"), grad_clip=None)
    for _ in health.timed(_slow_loader(5, sleep_s=0.12)):
        time.sleep(0.04)  # the step's work: the loader's sleep is 3/4 of each batch's time
        health.add_step(torch.tensor(1.0), None)
    (share,) = health.gather(world_size=1).data_wait_share
    assert 0.6 < share < 0.8, share  # 0.75 and a little of the loop's own time


def test_peak_memory_on_cpu_is_at_least_what_the_process_holds_and_grows_with_what_it_touches():
    process = psutil.Process()
    before = peak_memory_bytes(torch.device("cpu"))
    assert before >= process.memory_info().rss
    held = torch.ones((before + 256 * 2**20) // 4)  # more than the peak so far, touched
    assert peak_memory_bytes(torch.device("cpu")) >= process.memory_info().rss >= held.numel() * 4


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        held = torch.ones(rank * 96 * 2**20)  # rank 1 touches 384 MiB more: it holds the most
        health = StepHealth(torch.device("cpu"), grad_clip=1.0)
        for _ in health.timed(_slow_loader(3, sleep_s=0.01 + 0.1 * rank)):  # rank 1 waits for its data
            time.sleep(0.05)  # each step's work
            health.add_step(torch.tensor(1.0 + rank), 2.0 if rank == 0 else 99.0)  # the norm is global: rank 0's
        results.put((rank, health.gather(world_size=2), held.sum().item()))
    finally:
        dist.destroy_process_group()


def test_two_ranks_windows_are_gathered_into_the_same_report_naming_the_slowest_and_largest_rank():
    context = multiprocessing.get_context("spawn")  # a fresh process: fork after OpenMP threads may hang
    results, port = context.Queue(), free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    reports = dict(results.get(timeout=120)[:2] for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert reports[0] == reports[1]  # every rank holds the whole picture
    report = reports[0]
    assert report.loss_sum == pytest.approx((3 * 1.0 + 3 * 2.0) / 2)  # the all-rank mean, summed over 3 steps
    assert report.loss_max == 2.0 and report.grad_norm == 2.0 and report.clipped_share == 1.0
    metrics = report.metrics()
    assert metrics[f"{HEALTH_PREFIX}data_wait_slowest_rank"] == 1.0 and report.data_wait_share[1] > 0.5
    assert metrics[f"{HEALTH_PREFIX}peak_memory_rank"] == 1.0, report.peak_memory_bytes
    assert report.peak_memory_bytes[1] - report.peak_memory_bytes[0] > 256 * 2**20
