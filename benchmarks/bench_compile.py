"""torch.compile (inductor, through DeepSpeed's engine.compile()) vs eager: one training step.

Two DeepSpeed engines of the same model, built as the worker builds them (pipeline.components.modeling,
pipeline.components.optim, pipeline.components.engine), train on the same pre-generated batches in one process: the eager
one and the one compile_engine() compiled. The compile itself (first steps) is timed separately;
then the two alternate, round by round, and the medians of their step times give the ratio.

    DS_ACCELERATOR=cpu python benchmarks/bench_compile.py [--model xcit_nano_12_p8] [--img-size 32] [--batch 32]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def build_engine(model_name: str, img_size: int, batch: int, compiled: bool):
    import deepspeed
    import torch

    from pipeline.config.loading import load_config
    from pipeline.components.engine import compile_engine, deepspeed_config, keep_batchnorm_in_fp32
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer

    cfg = load_config("smoke", [f"model.name={model_name}", f"model.img_size={img_size}",
                                f"optim.micro_batch_size={batch}", f"deepspeed.compile={compiled}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, num_classes=10)
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, world_size=1))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    keep_batchnorm_in_fp32(engine.module)
    compile_engine(engine, cfg)
    return engine


def step(engine, images, labels) -> float:
    import torch.nn.functional as F

    start = time.perf_counter()
    loss = F.cross_entropy(engine(images), labels)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xcit_nano_12_p8")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (the compile happens here)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0", "LOCAL_RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, 3, args.img_size, args.img_size, generator=generator),
                torch.randint(0, 10, (args.batch,), generator=generator)) for _ in range(args.steps)]

    engines = {"eager": build_engine(args.model, args.img_size, args.batch, compiled=False),
               "compiled": build_engine(args.model, args.img_size, args.batch, compiled=True)}
    first = {}
    for name, engine in engines.items():
        start = time.perf_counter()
        for images, labels in batches[: args.warmup]:
            step(engine, images, labels)
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name] += [step(engine, images, labels) for images, labels in batches]

    print(f"{args.model} at {args.img_size} px, batch {args.batch}, fp32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps each")
    print("| engine | first {} steps (s) | step ms (median) | step ms (min) |".format(args.warmup))
    print("| --- | ---: | ---: | ---: |")
    for name in engines:
        print(f"| {name} | {first[name]:.1f} | {1e3 * statistics.median(times[name]):.1f} | "
              f"{1e3 * min(times[name]):.1f} |")
    ratio = statistics.median(times["eager"]) / statistics.median(times["compiled"])
    print(f"compiled speed-up over eager (median step): {ratio:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
