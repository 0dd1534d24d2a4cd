"""Security by default across cluster/: no secret in a config, an image reference or an MLflow param;
every credential comes from the platform's secret store; every Ray node runs the one image."""
import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from pipeline.config.loading import load_config

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
    assert not [value for value in env.values() if "@" in urlsplit(value).netloc]


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


README = ROOT / "README.md"
AWS_WORKER_POLICY = CLUSTER / "iam" / "aws-gpu-worker-policy.json"


def launcher(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def gpu_node_config(name: str) -> dict:
    (node,) = [node for node in launcher(name)["available_node_types"].values() if node["resources"].get("GPU")]
    return node["node_config"]


def test_aws_gpu_workers_have_a_role_of_their_own_not_the_heads():
    config = launcher("aws-p4d.yaml")
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert head["IamInstanceProfile"] == {"Name": "vitsweep-head"}  # the README's, not Ray's ray-autoscaler-v1
    assert gpu_node_config("aws-p4d.yaml")["IamInstanceProfile"] == {"Name": "vitsweep-gpu-worker"}


def test_the_aws_gpu_worker_role_reads_the_data_two_secrets_and_the_image_and_writes_checkpoints_only():
    statements = json.loads(AWS_WORKER_POLICY.read_text())["Statement"]
    granted = {action: statement["Resource"] for statement in statements for action in statement["Action"]}
    assert set(granted) == {"s3:ListBucket", "s3:GetObject", "secretsmanager:GetSecretValue",
                            "elasticfilesystem:DescribeFileSystems", "elasticfilesystem:ClientMount",
                            "elasticfilesystem:ClientWrite", "ecr:GetAuthorizationToken", "ecr:BatchGetImage",
                            "ecr:GetDownloadUrlForLayer"}
    assert granted["ecr:BatchGetImage"] == "arn:aws:ecr:us-east-1:*:repository/vitsweep"  # the image, no other
    assert all(statement["Effect"] == "Allow" and "*" not in "".join(statement["Action"]) for statement in statements)
    assert granted["s3:GetObject"] == "arn:aws:s3:::your-bucket/*" and granted["s3:ListBucket"] == "arn:aws:s3:::your-bucket"
    secrets = granted["secretsmanager:GetSecretValue"]
    assert sorted(arn.split(":secret:")[1] for arn in secrets) == ["vitsweep-mlflow-password-*", "vitsweep-ray-auth-token-*"]
    (mount,) = [statement for statement in statements if "elasticfilesystem:ClientWrite" in statement["Action"]]
    assert mount["Condition"] == {"StringEquals": {"aws:ResourceTag/Name": "vitsweep-shared"}}
    (applied,) = [line for line in README.read_text().splitlines()
                  if "--policy-document" in line and str(AWS_WORKER_POLICY.relative_to(ROOT)) in line]
    assert "s/your-bucket/$BUCKET/" in applied  # the README's setup applies it to your bucket


def test_gcp_gpu_workers_run_as_an_account_of_their_own_granted_only_what_they_need():
    (account,) = gpu_node_config("gcp-a2.yaml")["serviceAccounts"]
    assert account["email"] == "vitsweep-gpu-worker@PROJECT_ID.iam.gserviceaccount.com"  # not the default account
    grants = [line for line in README.read_text().splitlines() if "--member=serviceAccount:$SA" in line]
    roles = sorted(re.search(r"--role=([\w./]+)", line).group(1) for line in grants)
    assert roles == ["roles/artifactregistry.reader", "roles/file.viewer", "roles/secretmanager.secretAccessor",
                     "roles/storage.objectViewer"]
    (secret_grant,) = [line for line in grants if "secretAccessor" in line]
    assert "for s in vitsweep-ray-auth-token vitsweep-mlflow-password;" in secret_grant  # the two secrets only


def test_no_container_runs_as_root_or_escalates():
    """Pods run as the image's user; no container or init container overrides it to root, and none may
    gain privileges (a new share's ownership is the kubelet's, through the pod's fsGroup)."""
    for path in sorted((CLUSTER / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for pod in [node for node in _walk(doc) if isinstance(node, dict) and "containers" in node]:
                for container in [*pod["containers"], *pod.get("initContainers", [])]:
                    security = container.get("securityContext", {})
                    assert security.get("runAsUser") != 0 and security.get("runAsNonRoot") is not False, container["name"]
                    assert security.get("allowPrivilegeEscalation") is False, (path.name, container["name"])


def _walk(tree):
    yield tree
    children = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else []
    for child in children:
        yield from _walk(child)
