"""`python -m pipeline` is the `vitsweep` command."""
import sys

from pipeline.cli import main

sys.exit(main())
