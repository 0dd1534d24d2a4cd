"""ffcv's process-wide side effects, contained.

- ``import ffcv`` calls ``torch.set_num_threads(1)``, and every ``Loader.__init__``/``__iter__``
  sets it to the loader's ``num_workers``: CPU training would silently run on the wrong number of
  threads. Import ffcv through this module (``pipeline.data`` modules all do) and build loaders as
  ``ThreadCountPreservingLoader``. Only the calling thread's count changes (OpenMP keeps it per
  thread), so the loader's own background thread may keep ffcv's setting.
- ``import ffcv`` fills a numba typed ``Dict``, which JIT-compiles numba's dict functions: ~3 s
  in every process (the driver, each Ray Train worker). ``cache_numba_typed_dict`` turns on numba's
  on-disk cache for exactly those functions first, so only the first process on a machine pays.
- ffcv's epoch threads are stopped and joined at interpreter exit (see ``_stop_epoch_threads``).
- When a Loader is garbage-collected, numba dispatcher finalizers can report a harmless
  ``KeyError`` through ``sys.unraisablehook``; ``quiet_numba_finalizers`` drops exactly that report
  for user-facing commands and passes every other one on.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch


@contextlib.contextmanager
def preserved_torch_threads() -> Iterator[None]:
    """Restore torch's intra-op thread count after the block, whatever ffcv set it to."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cache_numba_typed_dict() -> None:
    """Numba's own ``cache=True``, for its typed-dict dispatchers (compiled once per machine, then
    loaded from numba's cache directory, keyed by numba's source and the CPU)."""
    import numba.typed.typeddict
    from numba.core.dispatcher import Dispatcher

    for value in vars(numba.typed.typeddict).values():
        if isinstance(value, Dispatcher):
            value.enable_caching()


cache_numba_typed_dict()
with preserved_torch_threads():
    import ffcv  # noqa: F401  (sets torch's thread count to 1 at import)
    from ffcv.loader import Loader as _FFCVLoader

FFCV_VERSION = importlib.metadata.version("ffcv")  # ffcv.__version__ says 0.0.3rc1 in 1.0.2


class ThreadCountPreservingLoader(_FFCVLoader):
    """``ffcv.loader.Loader`` that leaves the caller's torch thread count as it found it."""

    def __init__(self, *args, **kwargs):
        with preserved_torch_threads():
            super().__init__(*args, **kwargs)

    def __iter__(self):
        with preserved_torch_threads():
            return stopped_at_exit(super().__iter__())


# ffcv's epoch thread is a daemon running torch ops (ToDevice, normalising, RandAugment) that release
# the GIL; one still inside such an op when the interpreter exits is unwound through C++ frames that
# cannot unwind ("terminate called without an active exception", exit code 134). Stop them first.
_live_epoch_iterators: weakref.WeakSet = weakref.WeakSet()


def stopped_at_exit(iterator):
    """``iterator`` (an ffcv epoch thread), registered to be stopped before the interpreter exits."""
    _live_epoch_iterators.add(iterator)
    return iterator


@atexit.register
def _stop_epoch_threads(timeout_s: float = 10.0) -> None:
    iterators = list(_live_epoch_iterators)
    for iterator in iterators:
        iterator.terminate_event.set()  # checked between batches
    for iterator in iterators:
        iterator.join(timeout_s)


_NUMBA_DISPATCHER = str(Path("numba") / "core" / "dispatcher.py")


def _is_numba_finalizer_key_error(unraisable) -> bool:
    if unraisable.exc_type is not KeyError:
        return False
    traceback = unraisable.exc_traceback
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_name == "finalizer" and code.co_filename.endswith(_NUMBA_DISPATCHER):
            return True
        traceback = traceback.tb_next
    return False


def quiet_numba_finalizers() -> None:
    """Drop numba's finalizer ``KeyError`` reports (Loader GC); every other report goes through."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_numba_finalizer_key_errors", False):
        return

    def hook(unraisable) -> None:
        if not _is_numba_finalizer_key_error(unraisable):
            previous(unraisable)

    hook._drops_numba_finalizer_key_errors = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook

