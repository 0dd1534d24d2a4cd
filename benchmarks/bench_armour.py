"""Armour vs regular attention: training throughput (forward + backward + AdamW step), side by side.

Paper 002 Table 3 reports +7.2% / +6.7% / +6.9% GPU throughput for Armour-Ti/S/B over DeiT (the goal here:
>= +5%). Each model is built twice from the same seed, once with qkv='linear' (regular attention) and once
with qkv='armour' (W_Q = W_V); the two are timed in alternating order within every repeat, so drifts in
machine load hit both alike. Prints a markdown table of images/s (median over repeats) and the ratio.

    python benchmarks/bench_armour.py                       # small CPU defaults, < 3 min on 2 cores
    python benchmarks/bench_armour.py --device cuda --batch-size 128 --repeats 10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models  # noqa: E402,F401  (registers vitsweep's variants)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One model, its AdamW and a fixed batch; ``run(steps)`` returns images/s over that many train steps."""

    def __init__(self, name: str, qkv: str, args: argparse.Namespace, device: torch.device):
        torch.manual_seed(0)
        self.model = timm.create_model(name, qkv=qkv, img_size=args.img_size, num_classes=1000).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.05)
        self.images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
        self.labels = torch.randint(0, 1000, (args.batch_size,), device=device)
        self.amp = args.amp and device.type == "cuda"
        self.device = device
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self.model(self.images), self.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> float:
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return steps * self.images.shape[0] / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="deit_tiny_p16,xcit_nano_12_p16", help="comma-separated variants")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="train steps per timed measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed train steps per model first")
    parser.add_argument("--repeats", type=int, default=21, help="interleaved measurements per model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast (CUDA only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"device={device} ({hardware}), "
          f"img_size={args.img_size}, batch={args.batch_size}, steps={args.steps}, repeats={args.repeats}, "
          f"amp={args.amp and device.type == 'cuda'}, torch {torch.__version__}, timm {timm.__version__}\n")
    rows = []
    for name in args.models.split(","):
        trainers = {qkv: Trainer(name, qkv, args, device) for qkv in ("linear", "armour")}
        for trainer in trainers.values():
            trainer.run(args.warmup)
        speeds = {qkv: [] for qkv in trainers}
        for repeat in range(args.repeats):
            order = ("linear", "armour") if repeat % 2 == 0 else ("armour", "linear")
            for qkv in order:
                speeds[qkv].append(trainers[qkv].run(args.steps))
        paired = [a / r for a, r in zip(speeds["armour"], speeds["linear"])]
        for qkv, label in (("linear", "regular"), ("armour", "Armour")):
            median = statistics.median(speeds[qkv])
            gain = "" if qkv == "linear" else (
                f"{100 * (median / statistics.median(speeds['linear']) - 1):+.1f}% "
                f"(paired median {100 * (statistics.median(paired) - 1):+.1f}%)")
            rows.append(f"| {name} | {label} | {trainers[qkv].params / 1e6:.2f} | {median:.1f} | "
                        f"{min(speeds[qkv]):.1f}–{max(speeds[qkv]):.1f} | {gain} |")
        del trainers

    print("| model | attention | params (M) | train images/s (median) | min–max | Armour vs regular |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
