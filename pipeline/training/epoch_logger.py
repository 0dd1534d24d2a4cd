"""The Ray Train callback that turns each epoch's report into one MLflow step and one console line."""
from __future__ import annotations

from functools import partial
from typing import Any

from ray.train import UserCallback

from pipeline.console import say, say_epoch_end
from pipeline.report_keys import DIVERGED_CAUSE_KEY, DIVERGED_KEY
from pipeline.tracking.store import MlflowRun

class MLflowEpochLogger(UserCallback):
    """Ray Train callback (runs in the controller, on the driver's node): one MLflow step per epoch.

    Workers report already all-reduced metrics, so rank 0's dict is the run's.
    """

    def __init__(self, run: MlflowRun, epochs: int, announce: bool = True):
        """``announce``: print the epoch line on the console (a sweep shows its own table instead)."""
        self.run, self.epochs, self.announce = run, epochs, announce

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        reported = metrics[0]
        show = say if self.announce else print  # print: to the log file only
        if reported.get(DIVERGED_KEY):
            where = f"epoch {int(reported['epoch'])} step {int(reported['step'])}" + (
                f" ({reported[DIVERGED_CAUSE_KEY]})" if reported.get(DIVERGED_CAUSE_KEY) else "")
            self.run.mark_diverged(where)
            show(f"loss diverged at {where}: stopping")
            return
        self.run.log_epoch(reported)
        epoch = int(reported["epoch"])
        (partial(say_epoch_end, epoch) if self.announce else print)(
            f"epoch {epoch}/{self.epochs}  train_loss {reported['train_loss']:.4f}  "
            f"val_loss {reported['val_loss']:.4f}  val_top1 {reported['val_top1']:.2f}%  "
            f"val_top5 {reported['val_top5']:.2f}%  lr {reported['lr']:.2e}  "
            f"{reported['images_per_sec']:.0f} img/s  {reported['epoch_time_s']:.1f}s"
            + ("  (checkpoint saved)" if checkpoint is not None else "")
            + ("  (resumed from a checkpoint)" if "resumed_at_epoch" in reported else "")
        )
