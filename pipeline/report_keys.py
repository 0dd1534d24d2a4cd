"""Keys of what the workers report each epoch (``ray.train.report``) beside the metrics themselves,
shared by the worker that writes them and the controller's callbacks that read them
(``pipeline.training.epoch_logger``, ``pipeline.sweeps.tune_callback``) and the run that records them
(``pipeline.tracking.store``). A module of its own, importing nothing: the workers would otherwise
import MLflow, and the controller torch, on the way to every run's first step."""

DIVERGED_KEY = "diverged"  # a worker's report that the loss became NaN/inf (also the MLflow tag saying where)
DIVERGED_CAUSE_KEY = "diverged_cause"  # beside it, why where it was no NaN/inf (run.max_loss_spikes reached)
INITIAL_PREFIX = "initial_"  # metrics of the weights a run started from, evaluated before any step
MID_EPOCH_KEY = "mid_epoch_steps"  # a checkpoint's report within an epoch (run.checkpoint_every_steps): its steps done
EPOCH_STEPS_KEY = "epoch_steps"  # ... beside it, the epoch's optimizer steps (in Ray's record of the checkpoint)
