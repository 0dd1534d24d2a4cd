"""Error types the CLI maps to exit codes: bad input exits 2, a failed run 1, a signal 128 + its number;
and an error said in one line."""
import signal


class InvalidInputError(ValueError):
    """The user's input (config, path, dataset, search space) is wrong; nothing was started."""


class ConfigError(InvalidInputError):
    """The experiment config failed validation; the message names each offending key and value."""


class RunFailed(RuntimeError):
    """A run failed at run time; its MLflow run is FAILED, and the message is the one-line reason."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the command (``pipeline.interrupts``); ``outcome`` says what became of
    its work, filled in by the layer that recorded it (an MLflow run marked KILLED)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name, self.exit_code = signal.Signals(signum).name, 128 + signum
        self.outcome = ""


class AlreadyFinished(Exception):
    """A run asked for again, with the same config, has finished already: nothing to do (exit 0)."""


def error_line(err: BaseException) -> str:
    """The last line of an error, as a worker's traceback ends (Ray wraps worker errors in several layers)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]
