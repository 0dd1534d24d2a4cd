"""The Ray Train callback that turns each epoch's report into one MLflow step and one console line (a
checkpoint's report within an epoch: neither; rank 0 says it among its progress lines)."""
from __future__ import annotations

from functools import partial
from typing import Any

from ray.train import UserCallback

from pipeline.console import say, say_epoch_end
from pipeline.report_keys import DIVERGED_CAUSE_KEY, DIVERGED_KEY, MID_EPOCH_KEY
from pipeline.tracking.store import MlflowRun
from pipeline.training.cost import TARGET_EPOCH, RunCost

class MLflowEpochLogger(UserCallback):
    """Ray Train callback (runs in the controller, on the driver's node): one MLflow step per epoch,
    with the run's cost so far beside it (``pipeline.training.cost``).

    Workers report already all-reduced metrics, so rank 0's dict is the run's.
    """

    def __init__(self, run: MlflowRun, epochs: int, cost: RunCost, announce: bool = True):
        """``announce``: print the epoch line on the console (a sweep shows its own table instead)."""
        self.run, self.epochs, self.cost, self.announce = run, epochs, cost, announce

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        reported = metrics[0]
        show = say if self.announce else print  # print: to the log file only
        if reported.get(DIVERGED_KEY):
            where = f"epoch {int(reported['epoch'])} step {int(reported['step'])}" + (
                f" ({reported[DIVERGED_CAUSE_KEY]})" if reported.get(DIVERGED_CAUSE_KEY) else "")
            self.run.mark_diverged(where)
            show(f"loss diverged at {where}: stopping")
            return
        if MID_EPOCH_KEY in reported:  # run.checkpoint_every_steps: no epoch ended
            return
        cost = self.cost.at_epoch(reported)
        self.run.log_epoch({**reported, **cost})
        epoch = int(reported["epoch"])
        show_epoch = partial(say_epoch_end, epoch) if self.announce else print
        show_epoch(
            f"epoch {epoch}/{self.epochs}  train_loss {reported['train_loss']:.4f}  "
            f"val_loss {reported['val_loss']:.4f}  val_top1 {reported['val_top1']:.2f}%  "
            f"val_top5 {reported['val_top5']:.2f}%  lr {reported['lr']:.2e}  "
            f"{reported['images_per_sec']:.0f} img/s  {reported['epoch_time_s']:.1f}s"
            + ("  (checkpoint saved)" if checkpoint is not None else "")
            + ("  (resumed from a checkpoint)" if "resumed_at_epoch" in reported else "")
        )
        if TARGET_EPOCH in cost:  # beside the epoch's line, in its order
            show_epoch(self.cost.describe_target_reached(cost))
