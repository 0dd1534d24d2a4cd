"""Shared test setup: keep the 2-core machine usable and runs isolated from the user's stores."""
import os

# DeepSpeed must pick its CPU accelerator in tests even where a GPU happens to be visible.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Tests never write into a user's MLflow server.
os.environ.pop("MLFLOW_TRACKING_URI", None)
