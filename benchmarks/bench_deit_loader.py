"""DeiT's full training recipe at 224 px: vitsweep's train loader vs timm's ``create_loader``, side by side.

Both produce training batches with the same augmentations, on the same cores (``--workers``):

- timm (as DeiT's ``main.py``): ``create_loader(is_training=True)`` over the JPEG folder --
  RandomResizedCrop (bicubic), flip, RandAugment ``rand-m9-mstd0.5-inc1`` (PIL), normalise, random
  erasing 0.25 in ``--workers`` DataLoader processes; Mixup 0.8 / CutMix 1.0 with label smoothing
  0.1 on each batch in the main process.
- vitsweep: ``build_train_loader`` over a ``.beton`` written from the same folder with
  ``vitsweep data write``'s defaults (ffcv-imagenet's: <= 500 px, half JPEG q90) -- RRC decode and
  flip on ``--workers`` numba threads, RandAugment batched on torch ops (``--workers`` intra-op
  threads), normalise; then ``BatchAugment`` (random erasing, Mixup/CutMix) on each batch.

A third column times what stays on the CPU cores of a GPU node, where RandAugment, erasing and
Mixup run on the GPU: vitsweep's decode, crop and flip alone (it sizes the cores one GPU needs).

The images are ImageNet-like JPEGs generated offline and reproducibly: 500x375, smooth colour
fields, shapes, texture and grain, saved at quality 92 (about 110 kB each, as ImageNet's average).
Rounds alternate timm and vitsweep epochs, after one untimed warm-up epoch each (DataLoader worker
start, FFCV's JIT compile), so both see the same machine load; the ratio is taken per round.

    nice -n 10 .venv/bin/python benchmarks/bench_deit_loader.py              # ~4 min on 2 cores
    nice -n 10 .venv/bin/python benchmarks/bench_deit_loader.py --images 768 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

DEIT_SPEC = "rand-m9-mstd0.5-inc1"
IMG_SIZE = 224
CLASSES = 4


def imagenet_like_jpeg(path: Path, seed: int, width: int = 500, height: int = 375, quality: int = 92) -> None:
    """Smooth colour fields + shapes + texture + grain: ~110 kB at quality 92 (ImageNet's average size)."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        box = (x0, y0, x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 150)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.0))
    texture = Image.fromarray(rng.integers(0, 256, (height // 4, width // 4, 3), dtype=np.uint8))
    texture = np.asarray(texture.resize((width, height), Image.BICUBIC), dtype=np.float32)
    pixels = 0.8 * np.asarray(image, dtype=np.float32) + 0.2 * texture + rng.normal(0, 16, (height, width, 3))
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=quality)


def make_folder(root: Path, count: int) -> float:
    """``count`` JPEGs in ``CLASSES`` class folders; returns their mean size in kB."""
    for index in range(count):
        folder = root / f"class{index % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        imagenet_like_jpeg(folder / f"{index:05d}.jpg", seed=index)
    return float(np.mean([p.stat().st_size for p in root.rglob("*.jpg")])) / 1e3


def timm_epochs(folder: Path, args):
    import torch
    from timm.data import Mixup, create_loader
    from timm.data.dataset import ImageDataset

    from pipeline.data.rand_augment import use_timms_posterize_as_intended

    use_timms_posterize_as_intended()
    loader = create_loader(
        ImageDataset(str(folder)), input_size=(3, IMG_SIZE, IMG_SIZE), batch_size=args.batch, is_training=True,
        use_prefetcher=False, re_prob=0.25, re_mode="pixel", re_count=1, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
        hflip=0.5, color_jitter=0.3, auto_augment=DEIT_SPEC, interpolation="bicubic",
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), num_workers=args.workers,
        pin_memory=False, persistent_workers=True, device=torch.device("cpu"),  # drops the last batch in training
    )
    return epoch_of(loader, Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=CLASSES))


def vitsweep_epochs(beton: Path, args, cpu_share_only: bool = False):
    """The full recipe on the CPU; or (``cpu_share_only``) only what stays on a GPU node's CPU cores --
    decode, crop, flip -- with RandAugment, erasing and Mixup left to the GPU."""
    from pipeline.config.schema import AugmentConfig, DataConfig
    from pipeline.data.augment import BatchAugment
    from pipeline.data.loaders import build_train_loader

    augment = AugmentConfig(rand_augment=None) if cpu_share_only else AugmentConfig()  # DeiT's defaults
    data = DataConfig(num_workers=args.workers, order="random", drop_last=True, augment=augment)
    loader = build_train_loader(data, beton, args.batch, IMG_SIZE, "cpu")
    if cpu_share_only:
        return epoch_of(loader, lambda images, labels: (images, labels))
    return epoch_of(loader, BatchAugment(data.augment, CLASSES, "cpu"))


def epoch_of(loader, batch_augment):
    """One pass over ``loader`` with ``batch_augment(images, labels)`` on each batch; returns the image count."""

    def epoch() -> int:
        seen = 0
        for images, labels in loader:
            images, targets = batch_augment(images, labels)
            seen += len(images)
        return seen

    return epoch


def cpu_seconds() -> float:
    """CPU time of this process and its children (timm's DataLoader workers): user + system."""
    import psutil

    seconds = 0.0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds += times.user + times.system
    return seconds


def timed(epoch) -> tuple[float, float]:
    """(images per second of wall time, images per CPU-second): the second is what one fully used
    core delivers, and holds when other processes share the machine (the wall rate does not)."""
    start, cpu_start = time.perf_counter(), cpu_seconds()
    seen = epoch()
    return seen / (time.perf_counter() - start), seen / (cpu_seconds() - cpu_start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=384)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="cores for each loader (default 2, this machine's)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.workers)  # the main process's Mixup / BatchAugment, both sides
    with tempfile.TemporaryDirectory(prefix="vitsweep-bench-deit-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        mean_kb = make_folder(root / "train", args.images)
        print(f"{args.images} JPEGs 500x375, mean {mean_kb:.0f} kB, generated in {time.perf_counter() - start:.0f} s")

        from pipeline.data.sidecar import FFCV_IMAGENET_WRITE
        from pipeline.data.sources import ImageFolderSource
        from pipeline.data.writing import write_beton

        beton = root / "train.beton"
        sidecar = write_beton(ImageFolderSource(root / "train"), beton, FFCV_IMAGENET_WRITE, num_workers=args.workers)
        print(f".beton ({FFCV_IMAGENET_WRITE.write_mode}, <= {FFCV_IMAGENET_WRITE.max_resolution} px): "
              f"{sidecar.size_bytes / 1e6:.1f} MB")

        runs = {
            "timm": timm_epochs(root / "train", args),
            "vitsweep": vitsweep_epochs(beton, args),
            "vitsweep, CPU share on a GPU node": vitsweep_epochs(beton, args, cpu_share_only=True),
        }
        for name, epoch in runs.items():
            epoch()  # warm-up: worker start, JIT compile
        rates: dict[str, list[float]] = {name: [] for name in runs}
        per_cpu_second: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(args.rounds):
            for name, epoch in runs.items():
                wall, cpu = timed(epoch)
                rates[name].append(wall)
                per_cpu_second[name].append(cpu)
            print(f"round {round_index + 1}: " + ", ".join(
                f"{name} {rates[name][-1]:.0f} images/s ({per_cpu_second[name][-1]:.0f} per CPU-second)"
                for name in runs), flush=True)
        print(f"load average during the run: {os.getloadavg()}")

    print(f"\n| loader (DeiT recipe, 224 px, {args.workers} cores) | images/s (median) "
          "| images per CPU-second (median) |")
    print("| --- | ---: | ---: |")
    for name in runs:
        print(f"| {name} | {statistics.median(rates[name]):.0f} | {statistics.median(per_cpu_second[name]):.0f} |")
    for label, table in (("images/s", rates), ("images per CPU-second", per_cpu_second)):
        ratios = [v / t for v, t in zip(table["vitsweep"], table["timm"])]
        print(f"vitsweep / timm, {label}, per round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
