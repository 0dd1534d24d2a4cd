"""What a person sees: vitsweep's own lines on the console, every library's chatter in a log file.

vitsweep's lines are printed where the facts are: the epoch line in Ray Train's controller, the
progress line on rank 0, the sweep table in the driver. Lines printed inside Ray processes carry
``MARK``; the driver passes them to its stdout and writes everything else Ray forwards (worker and
actor output, DeepSpeed's and Ray's own lines) to the run's log file, with the libraries' Python
logging and warnings of the driver itself. ``--verbose`` shows that output on the console too.

On a terminal the progress line is redrawn in place; otherwise (a file, CI, a Ray job's log) each
progress line is a plain line and no ANSI codes are written. Either way an epoch's line comes before the
next epoch's progress (``EpochOrder``), though two processes print them.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pipeline.uris import redact

MARK = "\x1evitsweep\x1e "  # prefix of vitsweep's own lines printed inside Ray processes
PROGRESS = "progress "  # after MARK: "progress EPOCH TEXT", a progress line, redrawn in place on a terminal
EPOCH_END = "epoch-end "  # after MARK: "epoch-end EPOCH TEXT", an epoch's line
LOG_FILE_NAME = "vitsweep.log"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Library loggers whose records belong in the log file, not on the console.
LIBRARY_LOGGERS = ("ray", "mlflow", "deepspeed", "torch", "numba", "filelock", "alembic", "urllib3", "py.warnings")


def counted(number: float, unit: str) -> str:
    """``number`` and its ``unit``, plural unless it is exactly one: "1 epoch", "0.5 CPUs", "3 workers"."""
    return f"{number:g} {unit}{'' if number == 1 else 's'}"


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


def say(text: str) -> None:
    """Print one of vitsweep's own lines from inside a Ray process (controller, worker)."""
    for line in text.splitlines():
        print(MARK + line, flush=True)


def say_progress(epoch: int, text: str) -> None:
    """A progress line of ``epoch`` (rank 0's, inside the epoch)."""
    print(f"{MARK}{PROGRESS}{epoch} {text}", flush=True)


def say_epoch_end(epoch: int, text: str) -> None:
    """``epoch``'s line (Ray Train's controller's, once the epoch is reported)."""
    print(f"{MARK}{EPOCH_END}{epoch} {text}", flush=True)


class EpochOrder:
    """Epoch E's line before epoch E+1's progress. Rank 0 prints the progress and the controller the
    epoch's line; Ray forwards each process's output on its own, and rank 0 starts the next epoch as soon
    as it has reported, so its progress can arrive first. A progress line of a later epoch waits while an
    earlier epoch's line is due; it is let out by that line, by a progress line of an epoch not later than
    the one due (the group restarted from a checkpoint: that line will not come), or at the end."""

    def __init__(self) -> None:
        self.due: int | None = None  # the epoch whose progress was shown and whose line has not come
        self.held: list[tuple[int, str]] = []

    def progress(self, epoch: int, text: str) -> list[str]:
        """The progress lines to show now, in order."""
        if self.due is not None and epoch > self.due:
            self.held.append((epoch, text))
            return []
        shown = [held for _, held in self.held] + [text]
        self.held, self.due = [], epoch
        return shown

    def epoch_end(self, epoch: int) -> list[str]:
        """The progress lines to show after ``epoch``'s line."""
        if self.due is not None and epoch < self.due:
            return []
        held, self.held, self.due = self.held, [], None
        return [shown for later, text in held for shown in self.progress(later, text)]

    def release(self) -> list[str]:
        """What still waits when the command ends (its epoch's line never came: a run killed or diverged)."""
        held, self.held = self.held, []
        return [text for _, text in held]


def quiet_environment() -> None:
    """Settings read by the libraries as they start (call before Ray starts; workers inherit them)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # deduplication would fold and delay our own lines
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # spot preemption only; logs an error line
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's boxed output; the sweep prints its own table
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # vitsweep prints its own links
    # else MLflow's own stderr handler prints "Creating initial MLflow database tables..." for a new store
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # it would send each of our lines twice
    os.environ.setdefault("TQDM_DISABLE", "1")  # unlabelled library bars (ffcv's writer); vitsweep says what it writes
    # MLflow's usage telemetry starts a thread in every process that fetches its settings from the internet.
    # Offline (a cluster without egress) the fetch fails and the thread removes an environment variable
    # while a request may be reading the environment: the request fails (MLflow 3.17, "failed with
    # exception '_MLFLOW_TELEMETRY_SESSION_ID'"). MLFLOW_DISABLE_TELEMETRY=false turns it back on.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


_active: Console | None = None


@contextlib.contextmanager
def command_console(verbose: bool = False) -> Iterator[Console]:
    """The console of a command that drives the libraries: their settings quieted before they are
    imported, their output kept for the command's log file (``Console.open_log``), closed at the end."""
    quiet_environment()
    console = Console(verbose=verbose, buffered=True).activate()
    console.capture_libraries()
    try:
        yield console
    finally:
        console.close()


@contextlib.contextmanager
def library_prints() -> Iterator[None]:
    """What a library prints inside the block (DeepSpeed's checkpoint consolidation, MLflow's download
    bars) goes where library output goes (the log file), not to the console: ``sys.stdout`` and
    ``sys.stderr`` are swapped for the block's duration."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            yield
    finally:
        if captured.getvalue():
            active_console().library(captured.getvalue())


def active_console() -> Console:
    """The command's console (a plain stdout one when no command set it up, e.g. a library caller)."""
    global _active
    if _active is None:
        _active = Console()
    return _active


class Console:
    """The driver's console and log file for one command."""

    def __init__(self, verbose: bool = False, stream: TextIO | None = None, buffered: bool = False):
        """``buffered``: keep library output in memory until ``open_log`` names the file (a command's
        log lives in its run directory, which must not be written before the input checks pass);
        otherwise (a library caller) it goes to stderr."""
        self.verbose = verbose
        self._stream = stream
        self.log_path: Path | None = None
        self._lock = threading.Lock()
        self._live = False  # a progress line is on screen, to be overwritten
        self._epochs = EpochOrder()
        self._buffer = io.StringIO() if buffered else None
        self._log: TextIO | None = None
        self._handler = logging.StreamHandler(self)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout  # looked up when used: the process's stdout may be replaced

    @property
    def terminal(self) -> bool:
        return self.stream.isatty()

    # -- the driver's own output ------------------------------------------------------------------

    def line(self, text: str) -> None:
        with self._lock:
            self._end_live()
            self.stream.write(redact(text) + "\n")
            self.stream.flush()

    def progress(self, text: str) -> None:
        with self._lock:
            if self.terminal:
                self.stream.write("\r\x1b[K" + text)
                self._live = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def redraw(self, text: str) -> None:
        """Raw terminal output that redraws itself (the sweep table)."""
        with self._lock:
            self._end_live()
            self.stream.write(text)
            self.stream.flush()

    def _end_live(self) -> None:
        if self._live:
            self.stream.write("\r\x1b[K")
            self._live = False

    # -- everything else --------------------------------------------------------------------------

    def open_log(self, path: Path) -> None:
        """From now on the library output goes to ``path`` (what was kept so far first)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115  (closed by close())
        with self._lock:
            if self._buffer is not None:
                log.write(self._buffer.getvalue())
                self._buffer = None
            self._log, self.log_path = log, path

    def write(self, text: str) -> None:
        """File-like, for the libraries' logging handler; no credential of a URI reaches the file."""
        with self._lock:
            self.log.write(redact(text))

    @property
    def log(self) -> TextIO:
        """Where library output goes now: the log file, else the buffer, else stderr."""
        return self._log or self._buffer or sys.stderr

    def flush(self) -> None:
        self.log.flush()

    def library(self, text: str) -> None:
        self.write(text if text.endswith("\n") else text + "\n")
        if self.verbose:
            with self._lock:
                self._end_live()
                self.stream.write(redact(text if self.terminal else _ANSI.sub("", text)).rstrip("\n") + "\n")
                self.stream.flush()

    def capture_libraries(self) -> None:
        """Python logging of the libraries and warnings go to the log file (and the console with --verbose)."""
        logging.captureWarnings(True)
        root = logging.getLogger()
        root.handlers = [self._handler, *([logging.StreamHandler(self.stream)] if self.verbose else [])]
        root.setLevel(logging.INFO)
        for name in LIBRARY_LOGGERS:  # their own console handlers go; their records reach the root's
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True

    def route_ray_output(self) -> None:
        """Ray forwards every worker's and actor's stdout/stderr to the driver: ours to the console, the rest to the log.

        Ray 2.60 has no public hook for this; its dispatcher (``ray._private.ray_logging``) is the
        one place all forwarded lines pass, and vitsweep pins Ray to 2.60.x (pyproject.toml).
        """
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        dispatcher.remove_handler("ray_print_logs")
        dispatcher.remove_handler("vitsweep")
        dispatcher.add_handler("vitsweep", self._route)

    def _route(self, data: dict) -> None:
        if data.get("pid") == "autoscaler":  # Ray's own printer filters these down to events
            return
        who = data.get("actor_name") or data.get("task_name") or "worker"
        for line in data.get("lines", ()):
            if line.startswith(MARK + PROGRESS):
                epoch, text = line[len(MARK + PROGRESS):].split(" ", 1)
                for shown in self._epochs.progress(int(epoch), text):
                    self.progress(shown)
            elif line.startswith(MARK + EPOCH_END):
                epoch, text = line[len(MARK + EPOCH_END):].split(" ", 1)
                self.line(text)
                for shown in self._epochs.epoch_end(int(epoch)):
                    self.progress(shown)
            elif line.startswith(MARK):
                self.line(line[len(MARK):])
            else:
                self.library(f"({who} pid={data.get('pid')}{', stderr' if data.get('is_err') else ''}) {line}")

    def activate(self) -> Console:
        global _active
        _active = self
        return self

    def close(self) -> None:
        for shown in self._epochs.release():
            self.progress(shown)
        with self._lock:
            self._end_live()
            self.stream.flush()
        if self._log is not None:
            self._log.close()
        self._log = self._buffer = None
        global _active
        if _active is self:
            _active = None
