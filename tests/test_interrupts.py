"""SIGINT and SIGTERM in the main thread: raised at once as ``Interrupted`` (exit 130 / 143), or held
through a step that must not be cut short and raised when it ends; the handlers before are restored."""
import os
import signal

import pytest

from pipeline import interrupts
from pipeline.errors import Interrupted


def test_a_signal_inside_raised_interrupts_at_once_with_its_exit_code():
    reached = []
    with pytest.raises(Interrupted) as stop, interrupts.raised():
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("after the signal")
    assert reached == [] and stop.value.exit_code == 130 and stop.value.signal_name == "SIGINT"


def test_a_signal_inside_held_is_raised_once_the_block_has_ended():
    reached = []
    with pytest.raises(Interrupted) as stop, interrupts.held():
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("after the signal")
    assert reached == ["after the signal"] and stop.value.exit_code == 143


def test_the_handlers_before_are_back_after_a_block_that_replaced_them():
    before = signal.getsignal(signal.SIGTERM)
    with interrupts.held():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as ray.init installs its own
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_inside_ignored_is_dropped():
    with interrupts.ignored():
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process if it were not ignored
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN


def test_work_on_a_thread_hands_back_its_result_or_its_error():
    assert interrupts.OnThread(lambda: 42, "answer").result() == 42
    with pytest.raises(ZeroDivisionError):
        interrupts.OnThread(lambda: 1 / 0, "fails").result()


def test_a_command_called_on_another_thread_leaves_the_main_threads_handlers_alone():
    """A library user (or a test) may call `pipeline.training.driver.train` on a thread of its own: Python takes
    signals in the main thread only, so the blocks neither fail there nor touch the main thread's handlers."""
    before = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}

    def command() -> str:
        with interrupts.raised(), interrupts.held(), interrupts.ignored():
            return "done"

    assert interrupts.OnThread(command, name="command").result() == "done"
    assert {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS} == before
