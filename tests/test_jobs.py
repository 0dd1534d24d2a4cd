"""A `ray job submit` driver: relative paths that would land in the job's temporary copy are refused;
the code's provenance (commit, dirty flag) is read from git."""
import json
import subprocess

import pytest

from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.training.jobs import RAY_JOB_ENV, check_paths_outlive_job, git_provenance, ray_job_id

JOB_CONFIG = json.dumps({"runtime_env": {}, "metadata": {"job_submission_id": "raysubmit_abc"}})


@pytest.fixture
def in_ray_job(monkeypatch):
    monkeypatch.setenv(RAY_JOB_ENV, JOB_CONFIG)
    monkeypatch.delenv("VITSWEEP_CACHE_DIR", raising=False)


def absolute_smoke(tmp_path, *overrides: str):
    return load_config("smoke", [f"run.storage_path={tmp_path}/runs", f"data.train={tmp_path}/train.beton",
                                 f"data.val={tmp_path}/val.beton", *overrides])


def test_a_process_outside_a_ray_job_is_not_a_job_driver(monkeypatch):
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    assert ray_job_id() is None


def test_a_ray_job_driver_knows_its_submission_id(in_ray_job):
    assert ray_job_id() == "raysubmit_abc"


def test_a_relative_storage_path_in_a_ray_job_is_refused_naming_key_value_and_remedy(in_ray_job, tmp_path):
    cfg = absolute_smoke(tmp_path, "run.storage_path=vitsweep-runs")
    with pytest.raises(InvalidInputError) as err:
        check_paths_outlive_job(cfg)
    message = str(err.value)
    assert "raysubmit_abc" in message and "run.storage_path='vitsweep-runs'" in message
    assert "absolute path" in message


def test_relative_dataset_and_cache_paths_in_a_ray_job_are_refused(in_ray_job, tmp_path):
    cfg = absolute_smoke(tmp_path, "data.train=data/train.beton", "data.cache_dir=cache")
    with pytest.raises(InvalidInputError) as err:
        check_paths_outlive_job(cfg)
    assert "data.train='data/train.beton'" in str(err.value) and "data.cache_dir='cache'" in str(err.value)
    assert "data.val" not in str(err.value)  # only the offending keys are named


def test_a_relative_node_cache_dir_from_the_environment_in_a_ray_job_is_refused(in_ray_job, tmp_path, monkeypatch):
    monkeypatch.setenv("VITSWEEP_CACHE_DIR", "cache")
    with pytest.raises(InvalidInputError, match=r"\$VITSWEEP_CACHE_DIR='cache'"):
        check_paths_outlive_job(absolute_smoke(tmp_path))


def test_absolute_paths_and_uris_in_a_ray_job_pass(in_ray_job, tmp_path):
    check_paths_outlive_job(absolute_smoke(tmp_path, "data.val=s3://bucket/val.beton", "tune.storage_path=~/sweeps"))


def test_relative_paths_outside_a_ray_job_pass(monkeypatch):
    monkeypatch.delenv(RAY_JOB_ENV, raising=False)
    check_paths_outlive_job(load_config("smoke"))  # a local run resolves them against the user's directory


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("a\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "a")
    return tmp_path


def test_git_provenance_of_a_clean_checkout_names_its_commit(repo):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_provenance(repo) == {"git_commit": head, "git_dirty": "false", "mlflow.source.git.commit": head}


def test_git_provenance_marks_a_changed_tracked_file_dirty(repo):
    (repo / "a.txt").write_text("changed\n")
    assert git_provenance(repo)["git_dirty"] == "true"


def test_git_provenance_outside_a_checkout_is_unknown(tmp_path):
    assert git_provenance(tmp_path) == {"git_commit": "unknown", "git_dirty": "unknown",
                                        "mlflow.source.git.commit": "unknown"}
