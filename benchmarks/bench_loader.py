"""FFCV vs torchvision ImageFolder + DataLoader on the same JPEGs, side by side; FFCV write speed too.

Both loaders do the same work per image: decode, RandomResizedCrop (same scale/ratio), horizontal
flip, to a float tensor, normalise; same batch size, same number of workers (FFCV: decoding
threads; torchvision: DataLoader processes). The JPEG ImageFolder is generated from scikit-learn's
digits (offline): each digit upscaled, tinted and textured so the JPEGs are not trivially small.
FFCV reads a .beton written from that folder, in jpg mode (the same pixels re-encoded at the same
quality) and in raw mode. Warm-up epochs (FFCV's JIT compile, DataLoader's worker start) are not
timed.

    .venv/bin/python benchmarks/bench_loader.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_loader.py --images 2000 --epochs 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_jpeg_folder(root: Path, count: int, size: int, quality: int, seed: int = 0) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    for index in range(count):
        which = index % len(digits.target)
        ink = Image.fromarray(np.uint8(digits.images[which] * (255 / 16))).resize((size, size), Image.BICUBIC)
        ink = np.asarray(ink, dtype=np.float32)[..., None] / 255
        paper = rng.uniform(60, 200, 3) + rng.normal(0, 12, (size, size, 3))  # tinted, grainy background
        colour = rng.uniform(0, 255, 3)
        pixels = np.clip(paper * (1 - ink) + colour * ink, 0, 255).astype(np.uint8)
        folder = root / str(digits.target[which])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{index:06d}.jpg", quality=quality)


def timed_epochs(batches, epochs: int) -> float:
    """Images per second over ``epochs`` full passes, after one untimed warm-up pass."""
    for _ in batches():
        pass
    seen, start = 0, time.perf_counter()
    for _ in range(epochs):
        for images, *_ in batches():
            seen += len(images)
    return seen / (time.perf_counter() - start)


def bench_ffcv(path: Path, args) -> float:
    from pipeline.config.schema import AugmentConfig, DataConfig
    from pipeline.data.loaders import build_train_loader

    data = DataConfig(
        num_workers=args.workers, order="random", os_cache=True, drop_last=True, mean=MEAN, std=STD,
        augment=AugmentConfig(rand_augment=None, hflip=0.5, mixup_alpha=0, cutmix_alpha=0, random_erasing=0),
    )
    loader = build_train_loader(data, path, args.batch_size, args.crop, "cpu")
    return timed_epochs(lambda: loader, args.epochs)


def bench_torchvision(root: Path, args) -> float:
    import torch
    from torchvision import datasets, transforms

    from pipeline.config.schema import DataConfig

    defaults = DataConfig()
    transform = transforms.Compose([
        transforms.RandomResizedCrop(args.crop, scale=defaults.crop_scale, ratio=defaults.crop_ratio),
        transforms.RandomHorizontalFlip(0.5),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    loader = torch.utils.data.DataLoader(
        datasets.ImageFolder(str(root), transform=transform), batch_size=args.batch_size, shuffle=True,
        num_workers=args.workers, drop_last=True, persistent_workers=True,
    )
    return timed_epochs(lambda: loader, args.epochs)


def write(root: Path, out: Path, mode: str, args) -> float:
    from pipeline.data.sidecar import WriteOptions
    from pipeline.data.sources import ImageFolderSource
    from pipeline.data.writing import write_beton

    start = time.perf_counter()
    source = ImageFolderSource(root)
    write_beton(source, out, WriteOptions(write_mode=mode, jpeg_quality=args.quality), num_workers=args.workers)
    return len(source) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--size", type=int, default=96, help="JPEG side in pixels")
    parser.add_argument("--crop", type=int, default=64, help="output side after RandomResizedCrop")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per loader")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed after")
    args = parser.parse_args()

    from pipeline.data.runtime import quiet_numba_finalizers

    quiet_numba_finalizers()
    import torch

    torch.set_num_threads(1)  # the consuming loop only iterates; the workers do the work
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        jpegs = workdir / "jpegs"
        start = time.perf_counter()
        make_jpeg_folder(jpegs, args.images, args.size, args.quality)
        generate_s = time.perf_counter() - start
        write_jpg = write(jpegs, workdir / "jpg.beton", "jpg", args)
        write_raw = write(jpegs, workdir / "raw.beton", "raw", args)
        results = [
            ("torchvision ImageFolder + DataLoader (PIL)", bench_torchvision(jpegs, args)),
            ("FFCV Loader, .beton jpg mode (same JPEG quality)", bench_ffcv(workdir / "jpg.beton", args)),
            ("FFCV Loader, .beton raw mode", bench_ffcv(workdir / "raw.beton", args)),
        ]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    baseline = results[0][1]
    print(f"\n{args.images} JPEGs at {args.size}px (q{args.quality}) -> RandomResizedCrop {args.crop}px + flip + "
          f"normalise; batch {args.batch_size}; {args.workers} workers; {args.epochs} timed epochs; "
          f"{os.cpu_count()} CPUs\n")
    print("| loader | images/s | vs torchvision |")
    print("|---|---:|---:|")
    for name, rate in results:
        print(f"| {name} | {rate:,.0f} | {rate / baseline:.1f}x |")
    print("\n| FFCV write (from the JPEG folder, incl. scan + SHA-256) | images/s |")
    print("|---|---:|")
    print(f"| jpg mode | {write_jpg:,.0f} |")
    print(f"| raw mode | {write_raw:,.0f} |")
    print(f"\n(generating the JPEG folder took {generate_s:.1f}s)")


if __name__ == "__main__":
    main()
