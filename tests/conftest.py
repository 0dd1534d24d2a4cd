"""Shared test setup: keep the 2-core machine usable and runs isolated from the user's stores."""
import os

# DeepSpeed must pick its CPU accelerator in tests even where a GPU happens to be visible.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Tests never write into a user's MLflow server.
os.environ.pop("MLFLOW_TRACKING_URI", None)

import socket
import subprocess
import sys
from pathlib import Path

import pytest

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")


@pytest.fixture(scope="session")
def digits16(tmp_path_factory) -> dict[str, Path]:
    """The offline digits dataset at 16 px, written once per test session (train and val .beton)."""
    from pipeline.config import DataConfig
    from pipeline.data.prepare import prepare_digits

    root = tmp_path_factory.mktemp("digits16")
    data = DataConfig(train=str(root / "train.beton"), val=str(root / "val.beton"))
    train, val = prepare_digits(data, img_size=16)
    return {"train": train, "val": val}


def free_port() -> int:
    """A loopback port free now: servers of the tests' own never collide with a user's on the defaults."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vitsweep_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MLFLOW_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def train_command(storage: Path, data: dict[str, Path], *overrides: str, config: str = "smoke") -> list[str]:
    """`vitsweep train` on the smoke preset, writing only under ``storage``."""
    args = [VITSWEEP, "train", "--config", config,
            "--set", f"run.storage_path={storage}",
            "--set", f"data.train={data['train']}", "--set", f"data.val={data['val']}",
            "--set", "data.prepare=null"]
    for override in overrides:
        args += ["--set", override]
    return args


def run_vitsweep(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=vitsweep_env(), timeout=timeout)
