"""cluster/runtime_env.yaml is what `ray job submit --runtime-env` reads: valid for Ray, and the
working directory it uploads is this checkout's code and its git metadata (the run's provenance), never
the virtualenv or run outputs."""
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ENV = ROOT / "cluster" / "runtime_env.yaml"


def test_runtime_env_yaml_is_a_valid_ray_runtime_environment():
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    parsed = parse_runtime_env_args(runtime_env=str(RUNTIME_ENV))  # exactly what `ray job submit` does
    runtime_env = RuntimeEnv(**parsed)
    assert runtime_env["working_dir"] == "."  # the repository root `ray job submit` runs from
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())


def test_runtime_env_uploads_the_code_and_git_and_leaves_out_the_virtualenv_and_run_outputs(tmp_path):
    from ray._private.runtime_env import packaging

    excludes = yaml.safe_load(RUNTIME_ENV.read_text())["excludes"]
    package = tmp_path / "working_dir.zip"
    # Without .gitignore's help (RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 turns it off): excludes alone.
    packaging.create_package(str(ROOT), package, include_gitignore=False, excludes=excludes)
    names = zipfile.ZipFile(package).namelist()
    top = {name.split("/")[0] for name in names}
    assert {"pipeline", "models", "cluster", "pyproject.toml"} <= top
    assert ".git" in top  # a checkout's commit and dirty flag reach the job
    assert not top & {".venv", "mlruns", "vitsweep-runs"}
    assert not [name for name in names if name.endswith(".beton") or "/__pycache__/" in f"/{name}"]
    assert package.stat().st_size < packaging.GCS_STORAGE_MAX_SIZE


def test_runtime_env_names_no_kubernetes_service_for_the_launchers_that_share_it():
    """The file goes to KubeRay and launcher clusters alike: a `*.svc.cluster.local` address resolves on the
    first only (the KubeRay pods carry MLflow's address themselves)."""
    env_vars = yaml.safe_load(RUNTIME_ENV.read_text())["env_vars"]
    assert "MLFLOW_TRACKING_URI" not in env_vars
    assert not [value for value in env_vars.values() if ".svc.cluster.local" in value]
