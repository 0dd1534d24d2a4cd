"""svPN: exact (SVD, Eq. 5) vs fast approximation (power iteration, Eq. 8), forward + backward.

Sizes default to SoT-Tiny's head in training: 6 MGCrP heads of 14 x 14 cross-covariances over 196
word tokens (Table S-1), 128 images per GPU (Table S-3's batch 1024 over the paper's 8 GPUs), so
768 matrices per call. Every setting of Table 4c is timed, interleaved repeat by repeat so that
machine noise hits all of them alike; the paper's approximation (#sv = 1, #iter = 1) runs ~20x
faster than SVD in its whole-model throughput (Table 4c: 2226 vs 110 Hz). Medians are reported.

Each timed call is preceded by one untimed call of the same method (``--cache warm``, default), so
its inputs and working set are in the CPU caches, as in training, where svPN reads the matrices
MGCrP has just written. ``--cache cold`` times every method right after the others ran, which on
CPU adds cache misses (the SVD's working set evicts the approximation's) to the small methods.

    python benchmarks/bench_svpn.py                 # CPU, < 2 min on 2 cores
    python benchmarks/bench_svpn.py --device cuda --batch 128
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from models.layers.svpn import svpn_approx, svpn_exact

# (#sv, #iter) settings of Table 4c's lower panel.
APPROX_SETTINGS = [(1, 1), (1, 3), (1, 5), (2, 1), (3, 1)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=128, help="images per call (per-GPU training batch)")
    parser.add_argument("--heads", type=int, default=6, help="MGCrP heads h")
    parser.add_argument("--m", type=int, default=14, help="rows m of each cross-covariance")
    parser.add_argument("--n", type=int, default=14, help="columns n of each cross-covariance")
    parser.add_argument("--tokens", type=int, default=196, help="word tokens q pooled into each matrix")
    parser.add_argument("--alpha", type=float, default=0.5, help="svPN exponent")
    parser.add_argument("--repeats", type=int, default=30, help="timed repeats per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats per method")
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm",
                        help="warm: an untimed call of the same method right before each timed one")
    return parser.parse_args()


def cross_covariances(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    """Batch of (1/q) X Yᵀ matrices (Eq. 2) from random token projections, as MGCrP feeds svPN."""
    g = torch.Generator(device="cpu").manual_seed(0)
    count = args.batch * args.heads
    x = torch.randn(count, args.m, args.tokens, generator=g)
    y = torch.randn(count, args.n, args.tokens, generator=g)
    return (x @ y.mT / args.tokens).to(device)


def time_forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor,
                          upstream: torch.Tensor) -> float:
    """Milliseconds for one forward + backward of ``fn`` on ``q``."""
    q = q.detach().requires_grad_()
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(q).backward(upstream)
    if q.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    q = cross_covariances(args, device)
    upstream = torch.randn_like(q)
    v0 = torch.randn(args.n, device=device, requires_grad=True)  # the learned v⁽⁰⁾ of SvPN

    methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "svPN (SVD)": lambda m: svpn_exact(m, args.alpha),
    }
    for num_sv, iters in APPROX_SETTINGS:
        methods[f"svPN-hat (#sv={num_sv}, #iter={iters})"] = (
            lambda m, s=num_sv, i=iters: svpn_approx(m, v0, args.alpha, num_sv=s, iters=i))

    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(args.warmup + args.repeats):
        for name, fn in methods.items():  # interleaved: every method once per repeat
            if args.cache == "warm":
                time_forward_backward(fn, q, upstream)
            elapsed = time_forward_backward(fn, q, upstream)
            if repeat >= args.warmup:
                times[name].append(elapsed)

    exact_ms = statistics.median(times["svPN (SVD)"])
    print(f"device={device}, threads={torch.get_num_threads()}, matrices={q.shape[0]} x {args.m} x {args.n} "
          f"(batch {args.batch} x {args.heads} heads), forward + backward, {args.cache} cache, "
          f"median of {args.repeats}\n")
    print("| method | ms (median) | ms (min) | speed-up vs SVD |")
    print("| --- | ---: | ---: | ---: |")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.3f} | {min(samples):.3f} | {exact_ms / median:.1f}x |")


if __name__ == "__main__":
    main()
