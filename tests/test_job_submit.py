"""README's `ray job submit` command, read from README.md and run as written (its address aside)
against a real `ray start --head` of the test's own, set up as the README says: token auth from a
token generated once, the venv's `vitsweep` on the cluster's PATH."""
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
from mlflow import MlflowClient

from conftest import free_port, readme_block, vitsweep_env
from pipeline.training.jobs import git_provenance

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
README_DASHBOARD = "http://127.0.0.1:8265"


def readme_command(starting: str) -> str:
    matches = [line for line in readme_block("### `ray job submit`")
               if re.match(rf"(\S+=\S+\s+)*{re.escape(starting)}", line)]
    assert len(matches) == 1, f"README's `ray job submit` block should have one `{starting}` line: {matches}"
    return matches[0]


@pytest.fixture
def head_node(tmp_path):
    """A one-node Ray cluster of its own (own ports, temp dir and auth token), stopped afterwards."""
    # As the README's setup leaves a user: the venv activated, a token generated once (here under a
    # fresh HOME, found through RAY_AUTH_TOKEN_PATH), RAY_AUTH_MODE unset for `ray start`.
    env = {**vitsweep_env(), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    env.pop("RAY_AUTH_MODE", None)
    home = tmp_path / "home"
    token = subprocess.run(["bash", "-c", readme_command("ray get-auth-token --generate")],
                           capture_output=True, text=True, env={**env, "HOME": str(home)}, timeout=120)
    assert token.returncode == 0, token.stderr
    env["RAY_AUTH_TOKEN_PATH"] = str(home / ".ray" / "auth_token")
    ray_dir = tempfile.mkdtemp(prefix="vsray-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # Free ports of its own: other Ray clusters on this machine may hold the defaults (8265 and on).
    gcs, dashboard, agent, client = (free_port() for _ in range(4))
    try:
        start = subprocess.run(
            [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
             f"--ray-client-server-port={client}", "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={ray_dir}"],
            capture_output=True, text=True, env=env, timeout=180,
        )
        assert start.returncode == 0, start.stdout + start.stderr
        assert "Token authentication is enabled" in start.stdout + start.stderr
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        _stop_cluster_under(ray_dir, gcs)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _stop_cluster_under(ray_dir: str, gcs_port: int) -> None:
    """Stop only the processes of the cluster with this temp dir and GCS port (and their children):
    `ray stop` would stop every Ray cluster on the machine, a user's own included."""
    own = re.compile(rf"{re.escape(ray_dir)}|--address=\S+:{gcs_port}\b")  # the client server names only the GCS
    roots = [p for p in psutil.process_iter(["cmdline"]) if own.search(" ".join(p.info["cmdline"] or []))]
    processes = {p.pid: p for root in roots for p in [root, *_children(root)]}.values()
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=10)  # some of Ray's processes outlast a SIGTERM for good
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=30)


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def checkout(tmp_path) -> Path:
    """This checkout as a user has it (code and .git), without its venv or run outputs: the README's
    `$PWD/vitsweep-runs` then lies in the test's temp dir."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".venv", "vitsweep-runs", "__pycache__", "*.beton", ".pytest_cache", "*.egg-info", "mlruns"))
    return copy


def test_the_readme_ray_job_submit_command_trains_a_run_with_its_data_and_provenance_in_storage(
        head_node, checkout):
    address, env = head_node
    command = readme_command("ray job submit")
    assert README_DASHBOARD in command
    result = subprocess.run(["bash", "-c", command.replace(README_DASHBOARD, address)], cwd=checkout,
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "succeeded" in result.stdout + result.stderr

    storage = checkout / "vitsweep-runs"
    client = MlflowClient(f"sqlite:///{storage / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    [run] = client.search_runs(experiments)
    assert run.info.status == "FINISHED"
    assert run.data.tags["git_commit"] == git_provenance(REPO)["git_commit"] != "unknown"
    assert run.data.tags["git_dirty"] == git_provenance(REPO)["git_dirty"]
    train = storage / "data" / "digits_16_train.beton"
    assert run.data.params["data.train"] == str(train) and train.is_file()
