"""Staging a URI through one stream vs parallel ranged reads, against a loopback HTTP server that caps
each connection's rate (as an object store does: one S3/GCS connection gives ~100 MB/s), side by side.

The file is random bytes with a sidecar as ``vitsweep data write`` writes it (a SHA-256 per 64 MiB
chunk). Each variant stages it into an empty cache and the copy is hashed against the sidecar's
whole-file SHA-256 afterwards. The variants:

- the previous staging's loop: one fsspec stream (``open().read()``, 8 MiB at a time), hashed as it streams;
- ``stage_dataset(..., streams=N)`` for each N asked (1 = one stream of ranged reads).

The server (``tests/range_server.py``) listens on 127.0.0.1 only and every request is bounded by its rate.

    nice -n 10 .venv/bin/python benchmarks/bench_staging.py 2>/dev/null       # ~3 min
    nice -n 10 .venv/bin/python benchmarks/bench_staging.py --mib 512 --mib-per-connection 32 --streams 1 8
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import fsspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_verify import random_file, sidecar_for  # noqa: E402  (this directory: the sidecar of random bytes)
from range_server import RangeServer  # noqa: E402

from pipeline.data.sidecar import sha256_of, write_sidecar  # noqa: E402
from pipeline.data.staging import stage_dataset  # noqa: E402

_READ = 8 << 20  # the previous staging's read size


def stage_through_one_stream(url: str, cache: Path) -> Path:
    """What staging did before: one fsspec stream, copied and hashed as it arrives."""
    filesystem, remote = fsspec.core.url_to_fs(url)
    cache.mkdir(parents=True)
    local, digest = cache / Path(remote).name, hashlib.sha256()
    with filesystem.open(remote, "rb") as source, open(local, "wb") as target:
        while chunk := source.read(_READ):
            target.write(chunk)
            digest.update(chunk)
    return local


def timed(stage) -> tuple[float, Path]:
    start = time.perf_counter()
    local = stage()
    return time.perf_counter() - start, local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="file size in MiB (64 MiB chunks; default 1024)")
    parser.add_argument("--mib-per-connection", type=float, default=16.0,
                        help="the server's cap on each connection, MiB/s (default 16)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16],
                        help="streams to stage with (default 1 4 8 16; 16 is data.stage_streams' default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vitsweep-bench-staging-") as tmp:
        root = Path(tmp)
        (root / "bucket").mkdir()
        beton = root / "bucket" / "train.beton"
        random_file(beton, args.mib << 20)
        sidecar = sidecar_for(beton, chunked=True)
        write_sidecar(beton, sidecar)
        variants = {"previous staging: one fsspec stream (open().read())": stage_through_one_stream}
        variants |= {f"stage_dataset, streams={n}": (lambda n: lambda url, cache: stage_dataset(url, cache, n))(n)
                     for n in args.streams}
        results = {}
        with RangeServer(root / "bucket", bytes_per_second=args.mib_per_connection * (1 << 20)) as server:
            for index, (name, stage) in enumerate(variants.items()):
                cache = root / f"cache-{index}"
                seconds, local = timed(lambda: stage(server.url(beton.name), cache))
                verified = sha256_of(local) == sidecar.sha256
                results[name] = (seconds, verified, server.peak_in_flight, server.bytes_sent)
                server.peak_in_flight = server.bytes_sent = 0
                shutil.rmtree(cache)

    mib = args.mib
    previous, one_stream = results[next(iter(variants))][0], results.get("stage_dataset, streams=1", [None])[0]
    print(f"{mib} MiB ({mib // 64} chunks of 64 MiB) over loopback HTTP, each connection capped at "
          f"{args.mib_per_connection:g} MiB/s\n")
    print("| variant | seconds | MiB/s | ranges in flight (peak) | MiB sent by the server | bytes verified "
          "| speed-up vs previous | vs streams=1 |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for name, (seconds, verified, peak, sent) in results.items():
        versus_one = f"{one_stream / seconds:.2f}x" if one_stream else "-"
        print(f"| {name} | {seconds:.1f} | {mib / seconds:.1f} | {peak} | {sent / (1 << 20):.0f} | "
              f"{'yes' if verified else 'NO'} | {previous / seconds:.2f}x | {versus_one} |")


if __name__ == "__main__":
    main()
