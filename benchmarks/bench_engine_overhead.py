"""DeepSpeed engine inside a Ray Train worker vs a bare PyTorch loop: same model, batch, data.

Both sides train the same timm model with the same AdamW groups (pipeline.components.optim) on the same
pre-generated batches, single process each, one CPU thread each (what a Ray worker with
cpus_per_worker=1 gets), measured side by side in one run: bare, Ray, bare, Ray, ...
Reports the median optimizer-step time of each and their ratio (goal: Ray+DeepSpeed <= 1.10x).

    python benchmarks/bench_engine_overhead.py [--model xcit_nano_12_p8] [--img-size 32] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def make_batches(num: int, batch: int, img_size: int, num_classes: int, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, img_size, img_size, generator=generator),
             torch.randint(0, num_classes, (batch,), generator=generator)) for _ in range(num)]


def bare_step_times(model_cfg: dict, optim_cfg: dict, steps: int, warmup: int, batch: int) -> list[float]:
    import torch
    import torch.nn.functional as F

    from pipeline.config.schema import ModelConfig, OptimConfig
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**model_cfg), num_classes=10)
    optim = OptimConfig(**optim_cfg)
    optimizer = build_optimizer(model, optim, effective_lr(optim, world_size=1))
    times = []
    for i, (images, labels) in enumerate(make_batches(warmup + steps, batch, model_cfg["img_size"], 10)):
        start = time.perf_counter()
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def ray_worker(config: dict) -> None:
    import deepspeed
    import ray.train
    import torch
    import torch.nn.functional as F

    from pipeline.config.schema import ExperimentConfig
    from pipeline.components.engine import deepspeed_config
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ExperimentConfig.model_validate(config["experiment"])
    model = build_model(cfg.model, num_classes=10)
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, world_size=1))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, 1),
                                           dist_init_required=False)
    times = []
    batches = make_batches(config["warmup"] + config["steps"], cfg.optim.micro_batch_size, cfg.model.img_size, 10)
    for i, (images, labels) in enumerate(batches):
        start = time.perf_counter()
        loss = F.cross_entropy(engine(images), labels)
        engine.backward(loss)
        engine.step()
        if i >= config["warmup"]:
            times.append(time.perf_counter() - start)
    if ray.train.get_context().get_world_rank() == 0:  # one local worker: hand the times over as a file
        with open(config["out"], "w") as out:
            json.dump(times, out)
    ray.train.report({"steps": len(times)})


def ray_step_times(experiment: dict, steps: int, warmup: int, storage: str) -> list[float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = os.path.join(storage, "step_times.json")
    trainer = TorchTrainer(
        ray_worker,
        train_loop_config={"experiment": experiment, "steps": steps, "warmup": warmup, "out": out},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, worker_runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}}),
    )
    trainer.fit()
    with open(out) as times:
        return json.load(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xcit_nano_12_p8")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="bare/Ray alternations")
    parser.add_argument("--zero-stage", type=int, default=0)
    args = parser.parse_args()

    import tempfile

    import ray

    from pipeline.config.loading import validate

    experiment = validate({
        "model": {"name": args.model, "img_size": args.img_size},
        "optim": {"micro_batch_size": args.batch, "epochs": 1, "schedule": {"warmup_epochs": 0}},
        "deepspeed": {"zero_stage": args.zero_stage, "precision": "fp32"},
        "scaling": {"num_workers": 1},
    })
    dumped = experiment.model_dump(mode="json")
    ray.init(address="local", num_cpus=2, logging_level="ERROR", log_to_driver=False)
    bare, inside = [], []
    with tempfile.TemporaryDirectory() as storage:
        for _ in range(args.rounds):
            bare += bare_step_times(dumped["model"], dumped["optim"], args.steps, args.warmup, args.batch)
            inside += ray_step_times(dumped, args.steps, args.warmup, storage)
    bare_ms, inside_ms = statistics.median(bare) * 1e3, statistics.median(inside) * 1e3
    print(f"\n{args.model} @ {args.img_size}px, batch {args.batch}, fp32, ZeRO-{args.zero_stage}, 1 CPU thread, "
          f"{len(bare)} steps each ({args.rounds} alternating rounds)\n")
    print("| loop | median step (ms) | min (ms) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| bare PyTorch (torch AdamW) | {bare_ms:.1f} | {min(bare) * 1e3:.1f} | 1.00x |")
    print(f"| DeepSpeed engine in a Ray Train worker | {inside_ms:.1f} | {min(inside) * 1e3:.1f} | "
          f"{inside_ms / bare_ms:.2f}x |")


if __name__ == "__main__":
    main()
