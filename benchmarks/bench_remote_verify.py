"""The driver's verification of a remote dataset: today's parallel ranged reads of the sidecar's chunks
(``verify_dataset``, ``data.stage_streams`` at once) vs the single stream it replaced (the whole file
read through one fsspec stream and hashed), side by side, against a loopback HTTP server that caps each
connection's rate (as an object store does: one S3/GCS connection gives ~100 MB/s).

The file is random bytes with a sidecar as ``vitsweep data write`` writes it (a SHA-256 per 64 MiB
chunk). Each variant reads it all: the record of a verification is kept in a fresh directory each time,
so nothing is trusted from an earlier one. Variants alternate over the rounds, so both see the same
machine load. The server (``tests/range_server.py``) listens on 127.0.0.1 only.

    nice -n 10 .venv/bin/python benchmarks/bench_remote_verify.py 2>/dev/null      # ~2 min on 2 cores
    nice -n 10 .venv/bin/python benchmarks/bench_remote_verify.py --mib 2048 --mib-per-connection 32 --streams 4 16
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_verify import random_file, sidecar_for  # noqa: E402  (this directory: the sidecar of random bytes)
from range_server import RangeServer  # noqa: E402

from pipeline.data.sidecar import write_sidecar  # noqa: E402
from pipeline.data.verification import verify_dataset  # noqa: E402


def verify_through_one_stream(url: str, record: Path) -> None:
    """What the driver did before: the whole file through one fsspec stream, hashed as it arrives."""
    filesystem, remote = fsspec.core.url_to_fs(url)
    with filesystem.open(remote, "rb") as handle:
        hashlib.file_digest(handle, "sha256").hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="file size in MiB (64 MiB chunks; default 1024)")
    parser.add_argument("--mib-per-connection", type=float, default=16.0,
                        help="the server's cap on each connection, MiB/s (default 16)")
    parser.add_argument("--streams", type=int, nargs="+", default=[16],
                        help="ranged reads at once (default 16: data.stage_streams' default)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    variants = {"before: one fsspec stream, whole-file SHA-256": verify_through_one_stream}
    variants |= {f"verify_dataset, {n} ranged reads at once":
                 (lambda n: lambda url, record: verify_dataset(url, record, streams=n))(n) for n in args.streams}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="vitsweep-bench-remote-verify-") as tmp:
        root = Path(tmp)
        (root / "bucket").mkdir()
        beton = root / "bucket" / "train.beton"
        random_file(beton, args.mib << 20)
        write_sidecar(beton, sidecar_for(beton, chunked=True))
        with RangeServer(root / "bucket", bytes_per_second=args.mib_per_connection * (1 << 20)) as server:
            for round_ in range(args.rounds):
                for index, (name, verify) in enumerate(variants.items()):
                    record = root / f"record-{round_}-{index}" / "verified-datasets.json"
                    start = time.perf_counter()
                    verify(server.url(beton.name), record)
                    seconds[name].append(time.perf_counter() - start)

    before = statistics.median(seconds[next(iter(variants))])
    print(f"{args.mib} MiB ({args.mib // 64} chunks of 64 MiB) over loopback HTTP, each connection capped at "
          f"{args.mib_per_connection:g} MiB/s; median of {args.rounds} rounds\n")
    print("| variant | seconds | MiB/s | speed-up vs before |")
    print("| --- | ---: | ---: | ---: |")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.1f} | {args.mib / median:.1f} | {before / median:.2f}x |")


if __name__ == "__main__":
    main()
