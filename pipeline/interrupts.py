"""SIGINT and SIGTERM, whatever the moment: the command stops, says so in one line and exits 130 / 143.

For the whole of a command (``raised``) both signals raise ``Interrupted`` in the main thread, so
whatever runs there stops and each layer cleans up on its way out (a local Ray is shut down, an open
MLflow run is marked KILLED). The one moment that cannot be interrupted in place is a local Ray's start-up: a
half-started Ray cannot be stopped whole (its agents would outlive the command), and ``ray.init``
replaces the SIGTERM handler with its own (an exit that stops nothing). While Ray starts, a signal
is held and raised as soon as ``ray.init`` returns (``held``), when Ray can be shut down cleanly.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from pipeline.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")
_held: list[int] = []  # signals received inside ``held``
_holding = False


def _interrupt(signum: int, frame) -> None:
    if _holding:
        _held.append(signum)
        return
    raise Interrupted(signum)


def _off_the_main_thread() -> bool:
    """Python runs signal handlers in the main thread only: a command called on another thread (a
    library user's, a test's) leaves signal handling to whoever owns the main thread."""
    return threading.current_thread() is not threading.main_thread()


@contextlib.contextmanager
def raised() -> Iterator[None]:
    """Inside the block both signals raise ``Interrupted`` in the main thread; the handlers there before
    are installed again after it (also undoing any the block installed). Elsewhere it does nothing."""
    if _off_the_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _interrupt) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """``raised``, but a signal arriving inside the block is raised only when the block has ended."""
    global _holding
    if _off_the_main_thread():
        yield
        return
    _held.clear()
    try:
        with raised():
            _holding = True
            try:
                yield
            finally:
                _holding = False
    finally:
        signums, _held[:] = list(_held), []
    if signums:
        raise Interrupted(signums[0])


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    """Signals inside the block are dropped: the command is stopping already, and cutting its clean-up
    short (Ray's shutdown) would leave processes behind. Elsewhere than the main thread it does nothing."""
    if _off_the_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


class OnThread(Generic[T]):
    """``function()`` on a daemon thread, its result (or error) handed back by ``result()``: the main
    thread stays free to take signals, and an interrupted command exits without waiting for it."""

    def __init__(self, function: Callable[[], T], name: str):
        self._outcome: dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, args=(function,), name=name, daemon=True)
        self._thread.start()

    def _run(self, function: Callable[[], T]) -> None:
        try:
            self._outcome["result"] = function()
        except BaseException as err:  # noqa: BLE001  (raised in the caller's thread by result())
            self._outcome["error"] = err

    def result(self) -> T:
        while self._thread.is_alive():
            self._thread.join(0.2)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["result"]
