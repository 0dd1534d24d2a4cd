"""Security by default across cluster/: no secret in a config, an image reference or an MLflow param;
every credential comes from the platform's secret store; every Ray node runs the one image."""
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|_KEY\b|CREDENTIAL", re.IGNORECASE)
JOB_CONFIGS = sorted((CLUSTER / "jobs").glob("*.yaml"))
CLUSTER_FILES = sorted(p for p in CLUSTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def kubernetes_containers() -> list[tuple[str, dict]]:
    def containers(tree, where):
        if isinstance(tree, dict):
            if isinstance(tree.get("containers"), list):
                yield from ((where, c) for c in tree["containers"])
            for value in tree.values():
                yield from containers(value, where)
        elif isinstance(tree, list):
            for value in tree:
                yield from containers(value, where)

    return [found for path in sorted((CLUSTER / "kuberay").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc
            for found in containers(doc, f"{path.name} {doc['kind']}/{doc['metadata']['name']}")]


def runtime_envs() -> dict[str, dict]:
    (rayjob,) = [doc for doc in yaml.safe_load_all((CLUSTER / "kuberay" / "rayjob.yaml").read_text())]
    return {"runtime_env.yaml": yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text()),
            "rayjob.yaml runtimeEnvYAML": yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])}


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_job_configs_mlflow_params_hold_no_credentials(path):
    for key, value in load_config(str(path)).flat().items():  # exactly what MLflow records as params
        assert not SECRET_NAME.search(key), key
        if isinstance(value, str) and "://" in value:
            assert not urlsplit(value).password and "@" not in urlsplit(value).netloc, (key, value)


@pytest.mark.parametrize("where", ["runtime_env.yaml", "rayjob.yaml runtimeEnvYAML"])
def test_job_runtime_environments_hold_no_credentials(where):
    # A job's runtime environment is shown by the dashboard and the job API to anyone with the token.
    env = runtime_envs()[where]["env_vars"]
    assert not [name for name in env if SECRET_NAME.search(name)]
    tracking = urlsplit(env["MLFLOW_TRACKING_URI"])
    assert tracking.scheme in ("http", "https") and "@" not in tracking.netloc


@pytest.mark.parametrize("where,container", kubernetes_containers(), ids=lambda v: v if isinstance(v, str) else v["name"])
def test_kubernetes_credentials_come_from_secrets(where, container):
    for item in container.get("env", []):
        if SECRET_NAME.search(item["name"]):
            assert set(item) == {"name", "valueFrom"} and "secretKeyRef" in item["valueFrom"], (where, item)
        if "value" in item:
            assert "@" not in urlsplit(item["value"]).netloc or "$(" in item["value"], (where, item)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: str(p.relative_to(CLUSTER)))
def test_no_file_in_cluster_holds_key_material(path):
    # AWS access keys, private keys (SSH, TLS), GCP service-account key files.
    assert not re.search(r"AKIA[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----|\"type\": \"service_account\"",
                         path.read_text())


def test_every_ray_node_runs_the_image_of_this_version_and_mlflow_its_own():
    # Images may carry your registry's prefix (README: retag after pushing); the name and tag may not change.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {image for path in CLUSTER.rglob("*.yaml") for image in re.findall(r"\bimage: (\S+)", path.read_text())}
    ray_images = {image for image in images if not re.search(r"(^|/)(postgres|vitsweep-mlflow):", image)}
    assert len(ray_images) == 1 and re.fullmatch(rf"(\S+/)?vitsweep:{re.escape(version)}", ray_images.pop())
    assert any(re.fullmatch(rf"(\S+/)?vitsweep-mlflow:{re.escape(version)}", image) for image in images)
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"-t vitsweep:{version} ." in dockerfile and f"--target mlflow-server -t vitsweep-mlflow:{version} ." in dockerfile


def ray_pods() -> list[tuple[str, dict]]:
    """(where, pod spec) of every Ray pod: heads and worker groups of the RayCluster and the RayJob."""
    pods = []
    for path in sorted((CLUSTER / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("RayCluster", "RayJob"):
                spec = doc["spec"].get("rayClusterSpec", doc["spec"])
                pods.append((f"{path.name} head", spec["headGroupSpec"]["template"]["spec"]))
                pods += [(f"{path.name} {group['groupName']}", group["template"]["spec"])
                         for group in spec["workerGroupSpecs"]]
    return pods


@pytest.mark.parametrize("where,pod", ray_pods(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_ray_node_gets_mlflow_credentials_from_the_same_secret(where, pod):
    # Trial functions, Ray Train's controllers and each node's system-metrics monitor run on GPU pods too.
    (ray_container,) = pod["containers"]
    env = {item["name"]: item.get("valueFrom") for item in ray_container["env"]}
    assert env["MLFLOW_TRACKING_USERNAME"] == {"secretKeyRef": {"name": "vitsweep-mlflow-client", "key": "username"}}
    assert env["MLFLOW_TRACKING_PASSWORD"] == {"secretKeyRef": {"name": "vitsweep-mlflow-client", "key": "password"}}
    for init in pod.get("initContainers", []):  # the driver check logs nothing
        assert not [item for item in init.get("env", []) if item["name"].startswith("MLFLOW_")], where
