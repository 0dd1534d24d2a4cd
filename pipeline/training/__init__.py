"""How a config becomes a training run: the driver's start-up, the run's lifecycle, the worker's recipe,
where its files go, and the callback that records each epoch."""
