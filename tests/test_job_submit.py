"""README's `ray job submit` command, read from README.md and run as written (its address aside) against
a real `ray start --head` set up as the README says (the session's warm Ray: token auth from a token
generated once, the venv's `vitsweep` on the cluster's PATH). README "A warm local Ray"'s commands that
join it are README "Fine-tuning"'s and "After training"'s (``test_after_training``)."""
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import readme_block
from warm_ray import WarmRay
from pipeline.training.jobs import git_provenance

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README_DASHBOARD = "http://127.0.0.1:8265"


def readme_command(starting: str) -> str:
    matches = [line for line in readme_block("### `ray job submit`")
               if re.match(rf"(\S+=\S+\s+)*{re.escape(starting)}", line)]
    assert len(matches) == 1, f"README's `ray job submit` block should have one `{starting}` line: {matches}"
    return matches[0]


@dataclass(frozen=True)
class Submitted:
    """A user's checkout after the README's `ray job submit` command ran in it against ``cluster``."""

    checkout: Path
    cluster: WarmRay
    result: subprocess.CompletedProcess

    @property
    def store(self) -> MlflowClient:
        return MlflowClient(f"sqlite:///{self.checkout / 'vitsweep-runs' / 'mlflow.db'}")


@pytest.fixture(scope="module")
def submitted(tmp_path_factory, warm_rays) -> Submitted:
    """This checkout as a user has it (code and .git; without its venv or run outputs: the README's
    `$PWD/vitsweep-runs` then lies in a temp dir), the README's command run in it. The warm Ray stays up for
    the MLflow UI check's commands after it (``pytest_runtest_teardown`` stops it after its last user)."""
    checkout = tmp_path_factory.mktemp("job-submit") / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(
        ".venv", "vitsweep-runs", "__pycache__", "*.beton", ".pytest_cache", "*.egg-info", "mlruns"))
    cluster = warm_rays.running()
    command = readme_command("ray job submit")
    assert README_DASHBOARD in command
    result = subprocess.run(["bash", "-c", command.replace(README_DASHBOARD, cluster.dashboard)],
                            cwd=checkout, capture_output=True, text=True, env=cluster.shell, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return Submitted(checkout, cluster, result)


def test_the_readme_ray_job_submit_command_trains_a_run_with_its_data_and_provenance_in_storage(submitted):
    assert "succeeded" in submitted.result.stdout + submitted.result.stderr
    assert "Token authentication is enabled" in submitted.cluster.started  # `ray start` found the README's token
    storage = submitted.checkout / "vitsweep-runs"
    client = submitted.store
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments)
    assert run.info.status == "FINISHED"
    assert run.data.tags["git_commit"] == git_provenance(REPO)["git_commit"] != "unknown"
    assert run.data.tags["git_dirty"] == git_provenance(REPO)["git_dirty"]
    train = storage / "data" / "digits_16_train.beton"
    assert run.data.params["data.train"] == str(train) and train.is_file()
