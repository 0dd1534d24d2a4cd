"""The driver's console as Ray forwards vitsweep's lines to it: each epoch's line before the next
epoch's progress, though rank 0 prints the progress and Ray Train's controller the epoch's line, and Ray
forwards each process's output on its own (``pipeline.console.EpochOrder``). The lines are made by the
functions the worker and the controller print them with; Ray's dispatcher hands the driver a dict per
batch of one process's lines (``ray._private.ray_logging``)."""
import contextlib
import io

from pipeline.console import Console, say_epoch_end, say_progress


def printed(say, *args) -> str:
    """The line ``say`` prints inside a Ray process (without its newline)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        say(*args)
    return out.getvalue().rstrip("\n")


def progress(epoch: int, step: int) -> str:
    return printed(say_progress, epoch, f"epoch {epoch}/3  step {step}/2")


def epoch_line(epoch: int) -> str:
    return printed(say_epoch_end, epoch, f"epoch {epoch}/3  train_loss 1.0")


def shown(*batches: tuple[str, list[str]], close: bool = True) -> list[str]:
    """What a piped console shows of ``batches`` ((process, lines), in the order Ray delivers them)."""
    stream = io.StringIO()
    console = Console(stream=stream)
    for process, lines in batches:
        console._route({"lines": lines, "pid": process, "actor_name": process})
    if close:
        console.close()
    return stream.getvalue().splitlines()


def test_the_next_epochs_progress_waits_for_the_epochs_line_that_the_controller_prints():
    assert shown(("rank0", [progress(1, 1), progress(1, 2), progress(2, 1)]),
                 ("controller", [epoch_line(1)]),
                 ("rank0", [progress(2, 2)]), ("controller", [epoch_line(2)]), ("rank0", [progress(3, 1)])) == [
        "epoch 1/3  step 1/2", "epoch 1/3  step 2/2", "epoch 1/3  train_loss 1.0",
        "epoch 2/3  step 1/2", "epoch 2/3  step 2/2", "epoch 2/3  train_loss 1.0", "epoch 3/3  step 1/2"]


def test_progress_two_epochs_ahead_waits_for_each_epochs_line_in_turn():
    assert shown(("rank0", [progress(1, 2), progress(2, 2), progress(3, 1)]),
                 ("controller", [epoch_line(1)]), ("controller", [epoch_line(2)]), close=False) == [
        "epoch 1/3  step 2/2", "epoch 1/3  train_loss 1.0", "epoch 2/3  step 2/2", "epoch 2/3  train_loss 1.0",
        "epoch 3/3  step 1/2"]


def test_a_group_restarted_from_a_checkpoint_shows_its_progress_at_once():
    """A worker lost in epoch 2: the group restarts from epoch 1's checkpoint and trains epoch 2 again;
    epoch 2's line never came for the lost attempt, so nothing waits for it."""
    assert shown(("rank0", [progress(1, 2)]), ("controller", [epoch_line(1)]), ("rank0", [progress(2, 1)]),
                 ("rank0", [progress(2, 1), progress(2, 2)]), close=False) == [
        "epoch 1/3  step 2/2", "epoch 1/3  train_loss 1.0", "epoch 2/3  step 1/2", "epoch 2/3  step 1/2",
        "epoch 2/3  step 2/2"]


def test_progress_still_waiting_when_the_command_ends_is_shown_then():
    lines = [progress(1, 2), progress(2, 1)]
    assert shown(("rank0", lines), close=False) == ["epoch 1/3  step 2/2"]
    assert shown(("rank0", lines)) == ["epoch 1/3  step 2/2", "epoch 2/3  step 1/2"]


def test_other_lines_of_the_processes_go_to_the_log_not_the_console():
    stream, log = io.StringIO(), io.StringIO()
    console = Console(stream=stream)
    console._log = log
    console._route({"lines": [progress(1, 2), "a library's line"], "pid": 7, "actor_name": "RayTrainWorker"})
    assert stream.getvalue() == "epoch 1/3  step 2/2\n"
    assert log.getvalue() == "(RayTrainWorker pid=7) a library's line\n"
