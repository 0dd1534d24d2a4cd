"""What a trial's Ray Train run reports to Tune.

Its own light module: Ray Train's controller unpickles the callback, and so imports this module,
before the trial's workers start; the trial's recipe (``pipeline.sweeps.trial``) would cost it
torch, timm and ffcv, seconds of each trial's start on a small machine.
"""
from __future__ import annotations

from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from pipeline.sweeps.tracking import EPOCHS_DONE
from pipeline.report_keys import DIVERGED_KEY, MID_EPOCH_KEY


class SweepReportCallback(TuneReportCallback):
    """Ray Train -> Tune, adding ``epochs_done``; a divergence report is not a result, nor is a checkpoint's
    within an epoch (``run.checkpoint_every_steps``: the trial's Ray Train run resumes from it).

    The diverged worker reports no metrics (Tune would reject the result); the trial then fails
    through ``fit_and_record`` (MLflow FAILED) and Tune records the error, the sweep goes on.
    """

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        reported = metrics[0]
        if reported.get(DIVERGED_KEY) or MID_EPOCH_KEY in reported:
            return
        super().after_report(run_context, [{**reported, EPOCHS_DONE: int(reported["epoch"])}, *metrics[1:]],
                             checkpoint)
