"""Transfer, offline: pre-train on some digits, fine-tune on a few labelled images of the other digits at
another resolution, against the same model trained from scratch on the same images; seeds, mean ± sd.

The task, from the offline `digits` data (`vitsweep data write digits --classes ... --per-class N`):

- pre-training: digits 0-5, every training image (866), at 16 px: `vitsweep train`, one run;
- the new task: digits 6-9, ``--per-class`` training images of each (default 10: 40 images), at 32 px,
  validated on every validation image of 6-9 (143). Fine-tuning it from the pre-trained run takes a
  new head (4 classes, not 6) and, the model being EIT3/1/4-Mini with its learned position embedding,
  the embedding resampled from 4x4 to 8x8 tokens (paper 001 Table 6's model, the strongest from
  scratch on small data here: ``benchmarks/RESULTS.md``, "Fidelity");
- one sweep, `vitsweep tune`, its knob the source: ``model.init_from`` in {the pre-trained run, null
  (from scratch)} x ``run.seed`` 0..``--seeds``-1, the same recipe, data and epochs for both; the
  table is `vitsweep compare`'s, mean ± sd over the seeds.

    flock /tmp/vitsweep-heavy.lock env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_transfer.py
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")
SOURCE_CLASSES, TARGET_CLASSES = "0,1,2,3,4,5", "6,7,8,9"
SPACE = """\
description: fine-tuned from digits 0-5 at 16 px vs from scratch, on {per_class} images of each of digits 6-9 at 32 px
fixed:
  model.img_size: 32
  optim.epochs: {epochs}
  optim.micro_batch_size: 10
  tune.scheduler: fifo
  scaling.num_workers: 1
  scaling.cpus_per_worker: 0.5
  tune.trial_cpus: 0.5
params:
  model.init_from: {{values: [{source}, null]}}
  run.seed: {{values: [{seeds}]}}
"""


def vitsweep(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run([VITSWEEP, *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"`vitsweep {' '.join(args)}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def write_data(storage: Path, per_class: int, source_size: int, target_size: int) -> dict[str, Path]:
    """The four datasets (written once): pre-training train/val and the new task's train/val."""
    plans = {
        "source_train": ("train", SOURCE_CLASSES, None, source_size),
        "source_val": ("val", SOURCE_CLASSES, None, source_size),
        "target_train": ("train", TARGET_CLASSES, per_class, target_size),
        "target_val": ("val", TARGET_CLASSES, None, target_size),
    }
    files = {}
    for name, (split, classes, count, size) in plans.items():
        path = storage / "data" / f"{name}_{size}px{f'_{count}each' if count else ''}.beton"
        if not path.exists():
            vitsweep("data", "write", "digits", str(path), "--split", split, "--img-size", str(size),
                     "--write-mode", "raw", "--classes", classes, *(["--per-class", str(count)] if count else []))
        files[name] = path
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, default=Path("vitsweep-runs") / "transfer-digits")
    parser.add_argument("--model", default="eit3_1_4_mini")
    parser.add_argument("--per-class", type=int, default=10, help="training images of each new class")
    parser.add_argument("--pretrain-epochs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=20, help="fine-tuning / from-scratch epochs")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--source-size", type=int, default=16)
    parser.add_argument("--target-size", type=int, default=32)
    args = parser.parse_args()
    storage = args.storage.resolve()
    started = time.time()
    files = write_data(storage, args.per_class, args.source_size, args.target_size)
    source = f"{args.model}-digits0to5-{args.source_size}px"
    common = ["--set", f"run.storage_path={storage}", "--set", f"model.name={args.model}", "--set", "data.prepare=null"]
    if not (storage / source).is_dir():
        vitsweep("train", "--config", "default", *common, "--set", f"model.img_size={args.source_size}",
                 "--set", f"data.train={files['source_train']}", "--set", f"data.val={files['source_val']}",
                 "--set", f"optim.epochs={args.pretrain_epochs}", "--set", "scaling.num_workers=1",
                 "--set", f"run.name={source}")
    pretrained = time.time()
    space = storage / "transfer_digits.yaml"
    space.write_text(SPACE.format(per_class=args.per_class, epochs=args.epochs, source=source,
                                  seeds=", ".join(map(str, range(args.seeds)))))
    name = f"transfer-{args.model}-{args.per_class}each-{time.strftime('%Y%m%d-%H%M%S')}"
    vitsweep("tune", "--config", "default", "--space", str(space), *common, "--set", f"tune.name={name}",
             "--set", f"data.train={files['target_train']}", "--set", f"data.val={files['target_val']}")
    table = vitsweep("compare", "vitsweep", "--sweep", name, "--set", f"run.storage_path={storage}").stdout
    print(table)
    print(f"pre-training {pretrained - started:.0f} s, sweep {time.time() - pretrained:.0f} s; "
          f"sweep {name} in {storage}")


if __name__ == "__main__":
    main()
