"""`python -m pipeline` is the `vitsweep` command."""
from pipeline.cli import entry_point

entry_point()
