"""Sweeps: Ray Tune over many `vitsweep train` runs, each trial a nested MLflow run.

One concern per module:

- ``spaces``: declarative YAML search spaces over dotted config keys, checked against the schema.
- ``planning``: which trials a sweep runs: every sampled config resolved, built on the meta device,
  invalid ones pruned before any trial starts.
- ``trial``: the Tune trainable: one Ray Train run (``pipeline.training.driver``) reporting to Tune.
- ``tracking``: the sweep's MLflow parent run, each trial's child run and its stopping reason.
- ``report``: the results table (CSV, terminal) and the plots.
- ``runner``: resources, the Tuner (ASHA or FIFO; grid, random or Optuna TPE), resume.
"""
