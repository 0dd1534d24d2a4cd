"""What a finished run becomes: a model source, the start of another run, an evaluation, predictions,
a served MLflow model and a registered version."""
