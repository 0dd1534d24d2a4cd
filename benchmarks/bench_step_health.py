"""Step-level health's cost (#42): the worker's step with it against the step before it, side by side.

Two gloo ranks (one process and one CPU thread each, as a Ray worker with cpus_per_worker=1), each a real
DeepSpeed engine on the same model and pre-generated batches, alternating blocks of steps:

- before: the loss summed on the device and all-reduced at each logging step (the worker's ``sync_loss``
  until #42: its divergence check and progress line);
- health: each step's loss and gradient norm into ``StepHealth`` (``step_measuring_grad_norm``), the loader
  timed, and one all_gather of its scalars per rank at each logging step (``StepHealth.gather``).

Reports each side's median time per step (a logging window's time over its steps) and their ratio, at
``run.log_every_steps`` 20 (the default) and 1 (every step a logging step: the worst case).

    python benchmarks/bench_step_health.py [--zero-stage 1] [--steps 40] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _engine(zero_stage: int):
    import deepspeed
    import torch

    from pipeline.components.engine import deepspeed_config
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer
    from pipeline.config.loading import load_config

    cfg = load_config("smoke", [f"deepspeed.zero_stage={zero_stage}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=10)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg.optim, 1e-3),
                                           config=deepspeed_config(cfg, world_size=2), dist_init_required=False)
    return engine, cfg


def _before(engine, batches, every: int) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    started, unsynced = time.perf_counter(), torch.zeros(())
    for step, (images, labels) in enumerate(batches):
        loss = F.cross_entropy(engine(images), labels)
        engine.backward(loss)
        engine.step()
        unsynced += loss.detach().float()
        if (step + 1) % every == 0:
            total = unsynced.clone()
            dist.all_reduce(total)
            assert torch.isfinite(total)
            unsynced.zero_()
    return (time.perf_counter() - started) / len(batches)


def _health(engine, batches, every: int) -> float:
    import torch
    import torch.nn.functional as F

    from pipeline.components.health import StepHealth, computes_grad_norm, step_measuring_grad_norm

    health, deepspeed_norm = StepHealth(torch.device("cpu"), grad_clip=None), computes_grad_norm(engine)
    started = time.perf_counter()
    for step, (images, labels) in enumerate(health.timed(batches)):
        loss = F.cross_entropy(engine(images), labels)
        engine.backward(loss)
        health.add_step(loss.detach().float(), step_measuring_grad_norm(engine, deepspeed_norm))
        if (step + 1) % every == 0:
            assert health.gather(world_size=2).finite
    return (time.perf_counter() - started) / len(batches)


def _rank(rank: int, port: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.components.engine import use_the_environments_ninja

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    use_the_environments_ninja()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    engine, cfg = _engine(args.zero_stage)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(cfg.optim.micro_batch_size, 3, cfg.model.img_size, cfg.model.img_size,
                            generator=generator), torch.randint(0, 10, (cfg.optim.micro_batch_size,), generator=generator))
               for _ in range(args.steps)]
    _before(engine, batches[:5], 5)  # warm-up
    _health(engine, batches[:5], 5)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for every in (20, 1):
            times.setdefault(("before", every), []).append(_before(engine, batches, every))
            times.setdefault(("health", every), []).append(_health(engine, batches, every))
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    import multiprocessing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="before/health alternations")
    args = parser.parse_args()

    with socket.socket() as probe:  # a free port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, port, args, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    times = results.get(timeout=1800)
    for process in ranks:
        process.join()
    print(f"\nsmoke model (xcit_nano_12_p8, depth 2, 16 px, micro-batch 32), fp32, ZeRO-{args.zero_stage}, "
          f"2 gloo ranks x 1 CPU thread, {args.rounds} alternating rounds of {args.steps} steps\n")
    print("| run.log_every_steps | before: median step (ms) | health: median step (ms) | health / before |")
    print("| ---: | ---: | ---: | ---: |")
    for every in (20, 1):
        before, health = (statistics.median(times[(side, every)]) * 1e3 for side in ("before", "health"))
        print(f"| {every} | {before:.1f} | {health:.1f} | {health / before:.3f}x |")


if __name__ == "__main__":
    main()
