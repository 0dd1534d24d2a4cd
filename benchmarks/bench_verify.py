"""Verifying a ~1 GB .beton: the whole-file SHA-256 (one core, older sidecars) vs the sidecar's
64 MiB chunk digests on a thread pool (every core), side by side; for a local file
(``check_beton(verify_checksum=True)``) and for staging a ``file://`` URI (copy + verify).

The file is random bytes (hashing does not care what they are); its sidecar is built for it, once
with chunk digests and once without, as ``vitsweep data write`` writes them now and did before.
Rounds alternate old and new, so both see the same machine load; the file stays in the page
cache, so this measures hashing, not the disk.

    nice -n 10 .venv/bin/python benchmarks/bench_verify.py             # ~1 min on 2 cores
    nice -n 10 .venv/bin/python benchmarks/bench_verify.py --gb 4 --rounds 5
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.data.integrity import verify_sha256
from pipeline.data.runtime import FFCV_VERSION
from pipeline.data.sidecar import (
    CHUNK_BYTES, ImageSizeStats, Sidecar, SourceInfo, WriteOptions, file_digests, write_sidecar,
)
from pipeline.data.staging import stage_dataset


def random_file(path: Path, size: int) -> None:
    block = os.urandom(64 << 20)
    with open(path, "wb") as handle:
        for start in range(0, size, len(block)):
            handle.write(block[: min(len(block), size - start)])


def sidecar_for(path: Path, chunked: bool) -> Sidecar:
    whole, chunks = file_digests(path, CHUNK_BYTES)
    return Sidecar(
        file=path.name, size_bytes=path.stat().st_size, sha256=whole, num_samples=1, classes=["bytes"],
        counts_per_class={"bytes": 1},
        image_size=ImageSizeStats(min_width=1, max_width=1, mean_width=1, min_height=1, max_height=1, mean_height=1),
        write=WriteOptions(), source=SourceInfo(kind="digits", location="random bytes"), ffcv_version=FFCV_VERSION,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        chunk_bytes=CHUNK_BYTES if chunked else None, chunk_sha256=chunks if chunked else None,
    )


def seconds(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gb * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="vitsweep-bench-verify-") as tmp:
        root = Path(tmp)
        sidecars = {}
        for kind, chunked in (("old", False), ("new", True)):
            folder = root / kind
            folder.mkdir()
            path = folder / "train.beton"
            if kind == "old":
                random_file(path, size)
            else:
                os.link(root / "old" / "train.beton", path)  # the same bytes, the other sidecar
            sidecars[kind] = sidecar_for(path, chunked)
            write_sidecar(path, sidecars[kind])
        write_start = time.perf_counter()
        file_digests(root / "new" / "train.beton")
        write_cost = time.perf_counter() - write_start

        results: dict[str, list[float]] = {f"{what} {kind}": [] for what in ("verify", "stage") for kind in sidecars}
        for _ in range(args.rounds):
            for kind, sidecar in sidecars.items():
                path = root / kind / "train.beton"
                results[f"verify {kind}"].append(seconds(lambda: verify_sha256(path, sidecar)))
                cache = root / f"cache-{kind}"
                results[f"stage {kind}"].append(seconds(lambda: stage_dataset(f"file://{path}", cache)))
                shutil.rmtree(cache)

    gb = size / 1e9
    print(f"{gb:.2f} GB, {os.cpu_count()} cores, {args.rounds} rounds (median); chunks of {CHUNK_BYTES >> 20} MiB\n")
    print("| operation | whole-file SHA-256 (old sidecar) | chunk digests on a thread pool (new) | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for what in ("verify", "stage"):
        old, new = statistics.median(results[f"{what} old"]), statistics.median(results[f"{what} new"])
        label = "verify a local file" if what == "verify" else "stage a file:// URI (copy + verify)"
        print(f"| {label} | {old:.2f} s ({gb / old:.2f} GB/s) | {new:.2f} s ({gb / new:.2f} GB/s) | {old / new:.2f}x |")
    print(f"\nwrite-time cost of the digests (whole + chunks, side by side): {write_cost:.2f} s")


if __name__ == "__main__":
    main()
