"""Sweeps: Ray Tune over many `vitsweep train` runs, each trial a nested MLflow run.

One concern per module:

- ``spaces``: declarative YAML search spaces over dotted config keys, checked against the schema.
- ``planning``: which trials a sweep runs: every sampled config resolved, built on the meta device,
  invalid ones pruned before any trial starts.
- ``resources``: how many trials run at once, and the wait for a growing cluster.
- ``trial``: the Tune trainable: one training run (``pipeline.training.runs``) under a child MLflow run.
- ``tune_callback``: what a trial's Ray Train run reports to Tune (light: Ray Train's controller imports it).
- ``tracking``: the sweep's MLflow parent run, each trial's child run and its stopping reason.
- ``progress``: the console's table of trials while the sweep runs.
- ``report``: the results table (CSV, terminal); ``plots``, ``importance``, ``view`` and ``summary``:
  the plots, which knob mattered, the MLflow UI's saved view and the summary page.
- ``best_trial``: a finished sweep as one run: its directory from a name, and its best trial.
- ``runner``: resources, the Tuner (ASHA or FIFO; grid, random or Optuna TPE), resume.
"""
