"""A loopback HTTP server that serves a directory's files by byte range, at a capped rate per connection.

What an object store looks like to staging: each connection streams at a bounded rate (one S3 or GCS
connection gives ~100 MB/s), so only parallel ranged reads make a node's copy fast. The server counts
the range requests in flight at once, and can hold them until that many are in flight (or until
``release()``), so a test can see the concurrency a client opens without timing anything. Every wait
is bounded and it listens on 127.0.0.1 only. Used by ``tests/test_data_staging_http.py``,
``tests/test_dataset_verification.py``, ``benchmarks/bench_staging.py`` and ``benchmarks/bench_remote_verify.py``.
"""
from __future__ import annotations

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOLD_LIMIT_S = 30.0  # a held request is answered after this long, released or not
_PIECE = 64 << 10  # bytes written between two checks of the rate
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeServer:
    """``with RangeServer(root) as server: server.url("x.beton")`` serves ``root/x.beton`` on loopback.

    ``bytes_per_second`` caps each connection (None: as fast as it goes); ``hold_until_in_flight``
    holds every range response until that many are in flight at once; ``honour_ranges=False``
    answers every request with the whole file (as a plain static server does); a range starting at
    or after ``fail_ranges_from`` is cut off half-way, as a dropped connection.
    """

    def __init__(self, root: Path, bytes_per_second: float | None = None, hold_until_in_flight: int | None = None,
                 honour_ranges: bool = True, fail_ranges_from: int | None = None):
        self.root, self.bytes_per_second = Path(root), bytes_per_second
        self.hold_until_in_flight, self.honour_ranges, self.fail_ranges_from = (
            hold_until_in_flight, honour_ranges, fail_ranges_from)
        self.in_flight = self.peak_in_flight = self.ranges_served = self.bytes_sent = 0
        self._count = threading.Lock()
        self._released = threading.Event()
        if hold_until_in_flight is None:
            self._released.set()
        self._http = _ThreadingServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self._http.server_port}/{name}"

    def release(self) -> None:
        """Answer the held range requests now."""
        self._released.set()

    def __enter__(self) -> RangeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._released.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=HOLD_LIMIT_S)

    def _range_started(self) -> None:
        with self._count:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            if self.hold_until_in_flight is not None and self.in_flight >= self.hold_until_in_flight:
                self._released.set()
        self._released.wait(HOLD_LIMIT_S)

    def _sent(self, size: int) -> None:
        with self._count:
            self.bytes_sent += size

    def _range_ended(self, served: bool) -> None:
        with self._count:
            self.in_flight -= 1
            self.ranges_served += served


class _ThreadingServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a client's streams all connect at once


def _handler_for(server: RangeServer) -> type[BaseHTTPRequestHandler]:
    class RangeHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connections, as with a store
        timeout = HOLD_LIMIT_S + 30  # a connection nobody talks to closes

        def log_message(self, *args) -> None:  # quiet: tests and the benchmark print their own
            pass

        def do_HEAD(self) -> None:
            path = self._file()
            if path:
                self._headers(200, path.stat().st_size, path.stat().st_size)

        def do_GET(self) -> None:
            path = self._file()
            if not path:
                return
            size = path.stat().st_size
            match = _RANGE.match(self.headers.get("Range", ""))
            if not (match and server.honour_ranges):
                self._headers(200, size, size)
                self._send(path, 0, size, cut=False)
                return
            start, end = int(match[1]), min(size, int(match[2]) + 1 if match[2] else size)
            if start >= size:
                self._headers(416, 0, size)
                return
            server._range_started()
            served = False
            try:
                self._headers(206, end - start, size, content_range=f"bytes {start}-{end - 1}/{size}")
                cut = server.fail_ranges_from is not None and start >= server.fail_ranges_from
                served = self._send(path, start, end, cut)
            finally:
                server._range_ended(served)

        def _file(self) -> Path | None:
            path = server.root / self.path.lstrip("/").split("?")[0]
            if path.is_file():
                return path
            self._headers(404, 0, 0)
            return None

        def _headers(self, status: int, length: int, size: int, content_range: str | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            if status in (200, 206):  # the object's version, as a store's ETag names it (a rewrite changes it)
                stat = (server.root / self.path.lstrip("/").split("?")[0]).stat()
                self.send_header("ETag", f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"')
            if content_range:
                self.send_header("Content-Range", content_range)
            self.end_headers()

        def _send(self, path: Path, start: int, end: int, cut: bool) -> bool:
            """Write bytes [start, end) at the capped rate; cut: stop half-way and drop the connection."""
            stop = start + (end - start) // 2 if cut else end
            began = time.monotonic()
            with open(path, "rb") as handle:
                handle.seek(start)
                sent = 0
                while start + sent < stop:
                    piece = handle.read(min(_PIECE, stop - start - sent))
                    self.wfile.write(piece)
                    sent += len(piece)
                    server._sent(len(piece))
                    if server.bytes_per_second:
                        time.sleep(max(0.0, began + sent / server.bytes_per_second - time.monotonic()))
            if cut:
                self.close_connection = True
                self.wfile.flush()
                return False
            return True

    return RangeHandler
