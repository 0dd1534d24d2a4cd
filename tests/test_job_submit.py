"""`ray job submit … -- vitsweep train` against a real `ray start --head` cluster on loopback,
with Ray's token authentication on."""
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import psutil
import pytest

from conftest import train_command, vitsweep_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6391  # this cluster's own ports, apart from a default `ray start` (6379, 8265, 52365, 10001)


@pytest.fixture
def head_node():
    """A one-node Ray cluster of its own (own ports and temp dir), stopped afterwards."""
    # As a user with the venv activated: the cluster (and so each job's driver) finds `vitsweep`.
    env = {**vitsweep_env(), "RAY_AUTH_MODE": "token", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    ray_dir = tempfile.mkdtemp(prefix="vsray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    start = subprocess.run(
        [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={GCS_PORT}", "--dashboard-host=127.0.0.1",
         "--dashboard-port=8266", "--dashboard-agent-listen-port=52366", "--ray-client-server-port=6392",
         "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={ray_dir}"],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield "http://127.0.0.1:8266", env
    finally:
        _stop_cluster_under(ray_dir)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _stop_cluster_under(ray_dir: str) -> None:
    """Stop only the processes of the cluster with this temp dir and GCS port (and their children):
    `ray stop` would stop every Ray cluster on the machine, a user's own included."""
    own = re.compile(rf"{re.escape(ray_dir)}|--address=\S+:{GCS_PORT}\b")  # the client server names only the GCS
    roots = [p for p in psutil.process_iter(["cmdline"]) if own.search(" ".join(p.info["cmdline"] or []))]
    processes = {p.pid: p for root in roots for p in [root, *_children(root)]}.values()
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=30)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=30)


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_ray_job_submit_runs_a_training_to_completion(head_node, tmp_path, digits16):
    address, env = head_node
    storage = tmp_path / "runs"
    entrypoint = train_command(storage, digits16, "run.name=submitted")
    entrypoint[0] = "vitsweep"  # as a user types it; the job runs on the cluster's environment
    result = subprocess.run(
        [RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--", *entrypoint],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout + result.stderr
    assert "finished submitted" in result.stdout
    assert (storage / "mlflow.db").is_file()
