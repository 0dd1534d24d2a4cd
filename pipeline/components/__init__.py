"""The pieces a training worker composes: the model, its engine, optimiser and schedule, the loss,
metrics, checkpoints and the accelerator's facts, each in a module of its own."""
