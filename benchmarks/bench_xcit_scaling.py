"""XCiT vs DeiT: inference time and peak memory as the number of tokens grows 1x -> 4x -> 16x.

XCA attends across channels, so its cost grows linearly with the token count N, where token
self-attention grows as N² (paper 003 Sec. 3.2 "Complexity analysis", Fig. 2). The token count is grown
through the image size (default 112 -> 224 -> 448 px at patch 16: 49 -> 196 -> 784 tokens). Both of timm's
attention implementations are measured: 'unfused' materialises the N x N attention matrix as the paper's
baselines did; 'fused' (F.scaled_dot_product_attention, timm's default) does not, which makes token
attention's memory linear too, but not its time (XCiT's XCA is the same in both; only its class attention
differs). All runs are timed in alternating order within every repeat. Memory is the peak of the tensors a
forward pass allocates on top of the model's weights and input: ``torch.cuda.max_memory_allocated`` on CUDA;
on CPU, counted by a dispatch mode that follows every tensor storage an op creates until it is freed
(buffers internal to a fused kernel are invisible to it).

    python benchmarks/bench_xcit_scaling.py                  # small CPU defaults, < 3 min on 2 cores
    python benchmarks/bench_xcit_scaling.py --device cuda --batch-size 64 --img-sizes 224,448,896
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import weakref
from pathlib import Path

import timm
import torch
from timm.layers import set_fused_attn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models  # noqa: E402,F401  (registers vitsweep's variants)


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of the storages created by ops under this mode that are alive at the same time."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in inputs or key in self.live or storage.nbytes() == 0:
                    continue  # views, in-place results and storages already counted
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def peak_forward_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    if images.device.type == "cuda":
        torch.cuda.synchronize(images.device)
        torch.cuda.reset_peak_memory_stats(images.device)
        before = torch.cuda.memory_allocated(images.device)
        model(images)
        return torch.cuda.max_memory_allocated(images.device) - before
    with PeakTensorMemory() as tracker:
        model(images)
    return tracker.peak


def time_forward(model: torch.nn.Module, images: torch.Tensor, steps: int) -> float:
    """Seconds per image of ``steps`` forward passes."""
    sync = torch.cuda.synchronize if images.device.type == "cuda" else (lambda *_: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        model(images)
    sync()
    return (time.perf_counter() - start) / (steps * images.shape[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="xcit_tiny_12_p16,deit_tiny_p16", help="comma-separated variants")
    parser.add_argument("--img-sizes", default="112,224,448", help="comma-separated; x2 side = x4 tokens")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="forward passes per timed measurement")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved measurements per model and size")
    parser.add_argument("--attn-impls", default="unfused,fused", help="timm attention implementations to run")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    names, sizes = args.models.split(","), [int(s) for s in args.img_sizes.split(",")]
    impls = args.attn_impls.split(",")
    if not set(impls) <= {"fused", "unfused"}:
        raise SystemExit(f"--attn-impls={args.attn_impls!r}: valid entries are 'fused' and 'unfused'")

    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"device={device} ({hardware}), "
          f"batch={args.batch_size}, steps={args.steps}, repeats={args.repeats}, fp32 inference, "
          f"torch {torch.__version__}, timm {timm.__version__}\n")
    torch.set_grad_enabled(False)
    runs = {}
    for impl in impls:
        set_fused_attn(impl == "fused")  # read by timm's attention modules when they are built
        for name, size in itertools.product(names, sizes):
            torch.manual_seed(0)
            model = timm.create_model(name, img_size=size).to(device).eval()
            images = torch.randn(args.batch_size, 3, size, size, device=device)
            tokens = model.patch_embed.num_patches
            time_forward(model, images, 1)  # warm-up
            memory = peak_forward_bytes(model, images) / args.batch_size
            runs[impl, name, size] = dict(model=model, images=images, tokens=tokens, times=[], memory=memory)
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for key in order:
            runs[key]["times"].append(time_forward(runs[key]["model"], runs[key]["images"], args.steps))

    print("| model | attention | img size | tokens | ms / image | time vs 1x | peak memory / image (MB) "
          "| memory vs 1x |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for impl, name in itertools.product(impls, names):
        base = runs[impl, name, sizes[0]]
        base_time = statistics.median(base["times"])
        for size in sizes:
            run = runs[impl, name, size]
            t = statistics.median(run["times"])
            print(f"| {name} | {impl} | {size} | {run['tokens']} ({run['tokens'] / base['tokens']:.0f}x) | "
                  f"{1e3 * t:.1f} | "
                  f"{t / base_time:.1f}x | {run['memory'] / 2**20:.1f} | {run['memory'] / base['memory']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
