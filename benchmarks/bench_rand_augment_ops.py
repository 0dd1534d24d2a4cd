"""RandAugment's ops at 224 px, per image: this checkout's batched op (``pipeline.data.rand_augment``)
vs the same op from an earlier commit (``--previous``) vs timm's ``AugmentOp`` (PIL), side by side.

The previous column loads ``pipeline/data/rand_augment.py`` as it was at ``--previous`` (``git show``,
so run it from a git checkout); the default is the last commit before rotate, shear and translate
became Pillow's exact bicubic affine transform (they were 4-tap row/column shifts and torch's
``grid_sample`` then). Each op runs at magnitude 9 on ``--images`` natural images (scikit-learn's two
sample photographs, repeated): by default 4, about one op's share of a DeiT batch of 64 (2 layers at
p = 0.5 over 15 ops), on ``--threads`` intra-op threads. timm's side applies its own ``AugmentOp`` to
each image, as a DataLoader worker does. Rounds alternate the three sides; medians of ms per image.

    python benchmarks/bench_rand_augment_ops.py                      # ~1 min on 2 cores
    python benchmarks/bench_rand_augment_ops.py --threads 2 --ops Rotate ShearX
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_sample_image
from timm.data import auto_augment

from pipeline.data.rand_augment import OPS, timm_hparams

IMG_SIZE = 224
MEAN = (0.485, 0.456, 0.406)
PREVIOUS = "a3e13dbd9a33acfc0349296144176b94df3b2250"  # main before the exact affine ops (issue #23)
GEOMETRIC = ["Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"]


def photographs(count: int) -> list[np.ndarray]:
    photos = []
    for name in ("china.jpg", "flower.jpg"):
        photo = load_sample_image(name)
        side, left = photo.shape[0], (photo.shape[1] - photo.shape[0]) // 2
        photos.append(np.asarray(Image.fromarray(photo[:, left:left + side]).resize((IMG_SIZE, IMG_SIZE), Image.BICUBIC)))
    return [photos[index % 2] for index in range(count)]


def module_at(revision: str) -> types.ModuleType:
    """``pipeline.data.rand_augment`` as committed at ``revision``, loaded beside this checkout's."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{revision}:pipeline/data/rand_augment.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"rand_augment_at_{revision[:7]}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(source, f"{revision[:7]}:pipeline/data/rand_augment.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4, help="images per op call (one op's share of a batch)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--previous", default=PREVIOUS, metavar="REV", help="commit of the previous ops")
    parser.add_argument("--ops", nargs="*", default=GEOMETRIC, help="op names (default: the geometric ones)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    previous = module_at(args.previous)

    hparams = timm_hparams(IMG_SIZE, MEAN)
    fill = torch.tensor(hparams["img_mean"], dtype=torch.float32)
    images = photographs(args.images)
    batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().contiguous()
    pil_images = [Image.fromarray(image) for image in images]
    magnitudes = torch.full((args.images,), 9.0, dtype=torch.float64)
    signs = torch.ones_like(magnitudes)

    print(f"{args.images} images of {IMG_SIZE} px, magnitude 9, {args.threads} thread(s), median of {args.rounds}; "
          f"previous = {args.previous[:7]}")
    print("\n| op | this checkout (ms/image) | previous (ms/image) | timm AugmentOp, PIL (ms/image) "
          "| this / previous | this / timm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.ops:
        sides = {}
        for side, module in (("this", None), ("previous", previous)):
            op, level = OPS[name] if module is None else module.OPS[name]
            arguments = level(magnitudes, signs, hparams)
            sides[side] = lambda op=op, arguments=arguments: op(batch, arguments, fill)
        timm_op = auto_augment.AugmentOp(name, prob=1.0, magnitude=9, hparams=hparams)
        sides["timm"] = lambda: [timm_op(image) for image in pil_images]
        times: dict[str, list[float]] = {side: [] for side in sides}
        random.seed(0)
        for run in sides.values():
            run()  # warm-up (numba's compile or cache load)
        for _ in range(args.rounds):
            for side, run in sides.items():
                start = time.perf_counter()
                run()
                times[side].append((time.perf_counter() - start) / args.images * 1e3)
        this, before, timm = (statistics.median(times[side]) for side in ("this", "previous", "timm"))
        print(f"| {name} | {this:.3f} | {before:.3f} | {timm:.3f} | {this / before:.2f}x | {this / timm:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
