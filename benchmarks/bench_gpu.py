"""vitsweep's training step vs timm's on the same GPU: images/s, GPU busy %, TFLOP/s and MFU.

For each model, one process on one GPU, measured one after the other in one run:

- **vitsweep**: the worker's step as it builds it (the A100 job's config, cluster/jobs/a100_8x8.yaml,
  at this batch): an FFCV loader (pipeline.data.loaders) over a generated ImageNet-like JPEG .beton
  with the job's augmentations, BatchAugment (random erasing, Mixup/CutMix) on the GPU, a DeepSpeed
  engine (pipeline.components.engine: bf16, ZeRO-2) with BatchNorm in fp32, optional engine.compile().
- **timm**: timm's benchmark.py train mode: the same timm model, channels_last, a bf16 autocast loop
  with AdamW, on synthetic batches already on the GPU (no loader, no augmentation).

Busy % is NVML's utilization.gpu (nvidia-smi sampled every 100 ms while the timed steps run); MFU is
models/measure.py's multiply-adds x 6 (forward + backward, 2 FLOPs each) x images/s over the GPU's
dense peak (pipeline.components.accelerator.PEAK_TFLOPS).

    python benchmarks/bench_gpu.py                                        # a GPU node: XCiT-N12, XCiT-S12 at 224 px
    python benchmarks/bench_gpu.py --device cpu --steps 2 --img-size 32   # dry run of the same code paths on CPU
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import init_single_process_group, synchronize  # noqa: E402  (its sibling, the same helpers)

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "cluster" / "jobs" / "a100_8x8.yaml"
NUM_CLASSES = 1000  # ImageNet's head on both sides


def refuse_without_gpu() -> str:
    """The GPU summary line, or exit 2 with why this node cannot run the benchmark."""
    from pipeline.components.accelerator import GpuUnavailableError, check_gpu_node

    try:
        return check_gpu_node()
    except GpuUnavailableError as err:
        print(f"no GPU: run on a GPU node ({err})", file=sys.stderr)
        raise SystemExit(2) from None


def write_dataset(workdir: Path, images: int, side: int) -> Path:
    """An ImageFolder of textured JPEGs (benchmarks/bench_loader.py's), written as a jpg-mode .beton."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_loader import make_jpeg_folder

    from pipeline.data.sidecar import WriteOptions
    from pipeline.data.sources import ImageFolderSource
    from pipeline.data.writing import write_beton

    make_jpeg_folder(workdir / "jpegs", images, side, quality=90)
    path = workdir / "train.beton"
    write_beton(ImageFolderSource(workdir / "jpegs"), path, WriteOptions(write_mode="jpg", jpeg_quality=90))
    return path


class BusySampler:
    """NVML's utilization.gpu of one GPU, sampled by ``nvidia-smi -lms 100`` while the block runs."""

    def __init__(self, device):
        import torch

        self.samples: list[float] = []
        self.process = None
        if device.type != "cuda" or shutil.which("nvidia-smi") is None:
            return
        props = torch.cuda.get_device_properties(device)
        bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        self.command = ["nvidia-smi", "-i", bus_id, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                        "-lms", "100"]

    def __enter__(self) -> BusySampler:
        if hasattr(self, "command"):
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line))

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
            self.reader.join(timeout=5)

    @property
    def busy(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def vitsweep_images_per_sec(args, model: str, beton: Path, device, storage: Path) -> tuple[float, float | None]:
    import deepspeed

    from pipeline.config.loading import load_config
    from pipeline.data.augment import BatchAugment
    from pipeline.data.loaders import build_train_loader
    from pipeline.components.engine import compile_engine, deepspeed_config, input_dtype, keep_batchnorm_in_fp32
    from pipeline.components.lr_scaling import effective_lr
    from pipeline.components.modeling import build_model
    from pipeline.components.optim import build_optimizer, build_scheduler

    gpu = device.type == "cuda"
    cfg = load_config(str(JOB), [
        f"model.name={model}", f"model.img_size={args.img_size}", f"optim.micro_batch_size={args.batch}",
        "scaling.num_workers=1", f"scaling.use_gpu={gpu}", f"scaling.gpus_per_worker={1 if gpu else 0}",
        f"data.num_workers={args.loader_threads}", f"run.storage_path={storage}",
        f"deepspeed.compile={args.compile}", *args.set,
    ])
    loader = build_train_loader(cfg.data, beton, cfg.optim.micro_batch_size, cfg.model.img_size, device, seed=0)
    net = build_model(cfg.model, NUM_CLASSES)
    optimizer = build_optimizer(net, cfg.optim, effective_lr(cfg.optim, world_size=1))
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch=len(loader))
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, world_size=1), dist_init_required=False)
    keep_batchnorm_in_fp32(engine.module)
    compile_engine(engine, cfg)
    augment = BatchAugment(cfg.data.augment, NUM_CLASSES, device)
    criterion = augment.loss()
    dtype = input_dtype(cfg)

    def batches():
        while True:
            yield from loader

    def step(images, labels) -> None:
        images, targets = augment(images, labels)
        loss = criterion(engine(images.to(dtype)).float(), targets)
        engine.backward(loss)
        engine.step()

    stream = batches()
    for _ in range(args.warmup):
        step(*next(stream))
    synchronize(device)
    with BusySampler(device) as sampler:
        start = time.perf_counter()
        for _ in range(args.steps):
            step(*next(stream))
        synchronize(device)
        seconds = time.perf_counter() - start
    engine.destroy()
    return args.steps * args.batch / seconds, sampler.busy


def timm_images_per_sec(args, model: str, device) -> tuple[float, float | None]:
    import timm
    import torch
    from timm.optim import create_optimizer_v2

    net = timm.create_model(model, num_classes=NUM_CLASSES, img_size=args.img_size).to(device)
    net = net.to(memory_format=torch.channels_last).train()
    optimizer = create_optimizer_v2(net, "adamw", lr=1e-4, weight_decay=0.05)
    if args.compile:
        net = torch.compile(net)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device).contiguous(
        memory_format=torch.channels_last)
    targets = torch.randint(0, NUM_CLASSES, (args.batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(net(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    synchronize(device)
    with BusySampler(device) as sampler:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(device)
        seconds = time.perf_counter() - start
    return args.steps * args.batch / seconds, sampler.busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["xcit_nano_12_p16", "xcit_small_12_p16"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=None, help="per GPU; default 128 (the A100 job's), 16 on CPU")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps; default 10, 1 on CPU")
    parser.add_argument("--loader-threads", type=int, default=min(10, os.cpu_count() or 1),
                        help="FFCV decoding threads (the A100 job gives each GPU 10)")
    parser.add_argument("--images", type=int, default=None, help="generated JPEGs; default 16 batches")
    parser.add_argument("--compile", action="store_true", help="torch.compile both sides")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a vitsweep config override for its side, e.g. data.augment.rand_augment=null")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    args.batch = args.batch or (16 if cpu else 128)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 10)
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import torch

    from models.measure import build_on_meta, count_gmacs
    from pipeline.components.accelerator import math_mode, mfu, peak_tflops, prepare_gpu_worker, training_tflops
    from pipeline.config.loading import load_config
    from pipeline.data.runtime import quiet_numba_finalizers

    quiet_numba_finalizers()
    if cpu:
        device, summary, peak = torch.device("cpu"), f"CPU dry run ({os.cpu_count()} CPUs): not a GPU result", None
    else:
        summary = refuse_without_gpu()
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        job = load_config(str(JOB))
        prepare_gpu_worker(job.deepspeed.tf32)
        peak = peak_tflops(torch.cuda.get_device_name(device), math_mode(job.deepspeed.precision, job.deepspeed.tf32))
    init_single_process_group("gloo" if cpu else "nccl")

    workdir = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    rows = []
    try:
        beton = write_dataset(workdir, args.images or 16 * args.batch, side=max(48, args.img_size * 12 // 7))
        for model in args.models:
            gmacs = count_gmacs(build_on_meta(model, num_classes=NUM_CLASSES, img_size=args.img_size), args.img_size)
            ours = vitsweep_images_per_sec(args, model, beton, device, workdir / "runs")
            theirs = timm_images_per_sec(args, model, device)
            for side, (rate, busy) in (("vitsweep", ours), ("timm", theirs)):
                rows.append((model, side, rate, busy, training_tflops(gmacs, rate),
                             None if peak is None else mfu(gmacs, rate, peak), rate / theirs[0]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n{summary}; torch {torch.__version__}; {args.img_size} px, batch {args.batch}, bf16, "
          f"{args.steps} timed steps after {args.warmup}; compile={args.compile}; peak {peak} TFLOP/s")
    print("| model | step | images/s | GPU busy % | TFLOP/s | MFU | vs timm |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for model, side, rate, busy, tflops, utilisation, ratio in rows:
        print(f"| {model} | {side} | {rate:.1f} | {'n/a' if busy is None else f'{busy:.0f}'} | {tflops:.2f} | "
              f"{'n/a' if utilisation is None else f'{100 * utilisation:.1f} %'} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
