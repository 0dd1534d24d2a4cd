"""The KubeRay manifests (cluster/kuberay/*.yaml): each object parses and has what its kind needs,
the A100 worker pods add up to the paired job's DeepSpeed world size, and the RayJob, the
runtime environment and the MLflow server agree with each other."""
import ast
import importlib.util
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import ray
import yaml

from cluster_nodes import kuberay_mlflow_auth_config
from pipeline.config.loading import load_config
from pipeline.components.engine import deepspeed_config

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
KUBERAY = CLUSTER / "kuberay"
JOB = CLUSTER / "jobs" / "a100_8x8.yaml"  # the job config raycluster.yaml and rayjob.yaml are sized for
GPU = "nvidia.com/gpu"

API_VERSION = {"Namespace": "v1", "ServiceAccount": "v1", "PersistentVolumeClaim": "v1", "Service": "v1",
               "Deployment": "apps/v1", "StatefulSet": "apps/v1", "RayCluster": "ray.io/v1", "RayJob": "ray.io/v1"}
REQUIRED = {
    "Namespace": [],
    "ServiceAccount": [],
    "PersistentVolumeClaim": ["spec.accessModes", "spec.resources.requests.storage"],
    "Service": ["spec.selector", "spec.ports"],
    "Deployment": ["spec.selector.matchLabels", "spec.template.metadata.labels", "spec.template.spec.containers"],
    "StatefulSet": ["spec.serviceName", "spec.selector.matchLabels", "spec.template.metadata.labels",
                    "spec.template.spec.containers"],
    "RayCluster": ["spec.rayVersion", "spec.headGroupSpec.rayStartParams", "spec.headGroupSpec.template.spec.containers",
                   "spec.workerGroupSpecs"],
    "RayJob": ["spec.entrypoint", "spec.rayClusterSpec.rayVersion", "spec.rayClusterSpec.headGroupSpec",
               "spec.rayClusterSpec.workerGroupSpecs"],
}


def manifests() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(KUBERAY.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(kind: str, name: str | None = None) -> dict:
    (found,) = [doc for _, doc in manifests() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    return found


def dig(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def cluster_specs() -> dict[str, dict]:
    return {"RayCluster": one("RayCluster")["spec"], "RayJob": one("RayJob")["spec"]["rayClusterSpec"]}


def pod_specs() -> list[tuple[str, dict, set[str]]]:
    """Every pod template: (where, pod spec, names of the volumes it gets besides its own)."""
    specs = []
    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            claims = {claim["metadata"]["name"] for claim in doc["spec"].get("volumeClaimTemplates", [])}
            specs.append((doc["metadata"]["name"], doc["spec"]["template"]["spec"], claims))
    for kind, spec in cluster_specs().items():
        specs.append((f"{kind} head", spec["headGroupSpec"]["template"]["spec"], set()))
        specs += [(f"{kind} {group['groupName']}", group["template"]["spec"], set())
                  for group in spec["workerGroupSpecs"]]
    return specs


def quantity(value) -> float:
    """A Kubernetes quantity (`88`, `500m`, `560Gi`) as a number."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


def world_size() -> int:
    cfg = load_config(str(JOB))
    ds = deepspeed_config(cfg, cfg.scaling.num_workers)
    return ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])


def dockerfile_cache_dir() -> str:
    return re.search(r"^ENV VITSWEEP_CACHE_DIR=(\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE).group(1)


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


@pytest.mark.parametrize("where,doc", manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_has_the_fields_its_kind_requires(where, doc):
    assert doc["apiVersion"] == API_VERSION[doc["kind"]], where
    assert doc["metadata"]["name"]
    if doc["kind"] != "Namespace":
        assert doc["metadata"]["namespace"] == "vitsweep", where
    for dotted in REQUIRED[doc["kind"]]:
        assert dig(doc, dotted) not in (None, [], {}, ""), f"{where} {doc['kind']}: {dotted}"


@pytest.mark.parametrize("name,pod,claims", pod_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_pod_mounts_only_volumes_it_declares_and_refers_to_secrets_by_name_and_key(name, pod, claims):
    volumes = {volume["name"] for volume in pod.get("volumes", [])} | claims
    for container in pod["containers"]:
        assert container["name"] and container["image"], name
        assert {mount["name"] for mount in container.get("volumeMounts", [])} <= volumes, name
        for port in container.get("ports", []):
            assert len(port["name"]) <= 15, port  # Kubernetes port names are IANA service names
        for item in container.get("env", []):
            if "secretKeyRef" in item.get("valueFrom", {}):
                assert set(item["valueFrom"]["secretKeyRef"]) == {"name", "key"}, item
            if "configMapKeyRef" in item.get("valueFrom", {}):
                assert set(item["valueFrom"]["configMapKeyRef"]) == {"name", "key", "optional"}, item


def test_workload_selectors_match_their_pod_labels_and_services_find_them():
    for kind in ("Deployment", "StatefulSet"):
        for _, doc in manifests():
            if doc["kind"] == kind:
                labels = doc["spec"]["template"]["metadata"]["labels"]
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
                service = one("Service", doc["spec"].get("serviceName", doc["metadata"]["name"]))
                assert service["spec"]["selector"].items() <= labels.items()
                ports = {p["name"] for c in doc["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_ray_cluster_runs_this_ray_version_with_token_auth_from_a_secret(kind):
    spec = cluster_specs()[kind]
    assert spec["rayVersion"] == ray.__version__
    assert spec["authOptions"] == {"mode": "token", "secretName": "vitsweep-ray-auth"}


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_ray_head_is_reachable_inside_the_cluster_only_and_takes_no_training_workers(kind):
    head = cluster_specs()[kind]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["num-cpus"] == "0"


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_ray_start_params_are_strings_as_kuberays_crd_requires(kind):
    spec = cluster_specs()[kind]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(value, str) for value in group["rayStartParams"].values()), group["rayStartParams"]


@pytest.mark.parametrize("kind,count", [("RayCluster", "maxReplicas"), ("RayJob", "replicas")])
def test_a100_worker_pods_add_up_to_the_paired_jobs_world_size(kind, count):
    cfg = load_config(str(JOB))
    workers = 0
    for group in cluster_specs()[kind]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        gpus = quantity(container["resources"]["limits"][GPU])
        assert quantity(container["resources"]["requests"][GPU]) == gpus
        workers += group[count] * gpus / cfg.scaling.gpus_per_worker
    assert workers == world_size()


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_a100_worker_pod_runs_one_worker_per_gpu_and_their_cpus_fit(kind):
    cfg = load_config(str(JOB))
    for group in cluster_specs()[kind]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        workers_per_pod = quantity(limits[GPU]) / cfg.scaling.gpus_per_worker
        assert workers_per_pod == quantity(limits[GPU])
        assert workers_per_pod * cfg.scaling.cpus_per_worker <= quantity(limits["cpu"])  # KubeRay's num-cpus


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_a100_worker_pods_land_on_a100_nodes_and_tolerate_the_gpu_taint(kind):
    for group in cluster_specs()[kind]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        for term in terms:
            (expression,) = term["matchExpressions"]
            assert expression["operator"] == "In" and all("a100" in value.lower() or value.startswith("p4d")
                                                          for value in expression["values"])
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_a100_worker_pods_stage_onto_local_ssd_and_share_run_storage(kind):
    cfg, cache_dir = load_config(str(JOB)), dockerfile_cache_dir()
    claim = one("PersistentVolumeClaim", "vitsweep-shared")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for group in cluster_specs()[kind]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        local = [volume for path, volume in mounts.items() if cache_dir.startswith(path + "/")]
        assert local and "emptyDir" in local[0] and "medium" not in local[0]["emptyDir"]  # disk, not RAM
        assert quantity(container["resources"]["requests"]["ephemeral-storage"]) >= quantity(
            local[0]["emptyDir"]["sizeLimit"])
        shared = [volume for path, volume in mounts.items() if cfg.run.storage_path.startswith(path + "/")]
        assert shared and shared[0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"


def test_rayjob_runs_the_same_pods_as_the_raycluster():
    raycluster, rayjob = cluster_specs()["RayCluster"], cluster_specs()["RayJob"]
    assert [g["template"] for g in rayjob["workerGroupSpecs"]] == [g["template"] for g in raycluster["workerGroupSpecs"]]
    job_head = rayjob["headGroupSpec"]["template"]
    cluster_head = raycluster["headGroupSpec"]["template"]
    (job_container,), (cluster_container,) = job_head["spec"]["containers"], cluster_head["spec"]["containers"]
    assert {k: v for k, v in job_container.items() if k != "env"} == {k: v for k, v in cluster_container.items() if k != "env"}
    assert env_of(cluster_container).items() <= env_of(job_container).items()
    assert set(env_of(job_container)) - set(env_of(cluster_container)) == {"VITSWEEP_DATA_URI"}


def test_rayjob_runtime_environment_matches_cluster_runtime_env_yaml():
    runtime_env = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    job_env = yaml.safe_load(one("RayJob")["spec"]["runtimeEnvYAML"])
    assert job_env["env_vars"] == {k: v for k, v in runtime_env["env_vars"].items() if k != "PYTHONUNBUFFERED"}


@pytest.fixture
def vitsweep_recorder(tmp_path) -> Path:
    """A `vitsweep` first on PATH that writes the arguments it was given (as the head's shell passes them)."""
    recorder = tmp_path / "bin" / "vitsweep"
    recorder.parent.mkdir()
    recorder.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {tmp_path / 'argv'}\n")
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def run_entrypoint(directory: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The RayJob's entrypoint as the head pod runs it: the submitter passes its words to
    `ray job submit`, which quotes them (shlex.join) for the head's shell."""
    words = shlex.split(one("RayJob")["spec"]["entrypoint"])
    return subprocess.run(shlex.join(words), shell=True, capture_output=True, text=True,
                          env={"PATH": f"{directory / 'bin'}:{os.environ['PATH']}", **env})


def test_rayjob_entrypoint_trains_the_paired_job_on_the_data_uri_from_its_configmap(vitsweep_recorder):
    result = run_entrypoint(vitsweep_recorder, {"VITSWEEP_DATA_URI": "s3://bucket/imagenet"})
    assert result.returncode == 0, result.stderr
    command, *options = (vitsweep_recorder / "argv").read_text().split("\0")[:-1]
    flags = list(zip(options[::2], options[1::2]))
    assert command == "train"
    assert ("--address", "auto") in flags  # the cluster the job runs on (RAY_ADDRESS), not a Ray of its own
    (config,) = [value for flag, value in flags if flag == "--config"]
    overrides = [value for flag, value in flags if flag == "--set"]
    assert overrides == ["data.train=s3://bucket/imagenet/imagenet_train.beton",
                         "data.val=s3://bucket/imagenet/imagenet_val.beton"]
    image_root = re.findall(r"^WORKDIR (\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)[-1]
    in_checkout = CLUSTER.parent / Path(config).relative_to(image_root)
    cfg = load_config(str(in_checkout), overrides)
    assert in_checkout == JOB and cfg.data.train.startswith("s3://")


def test_rayjob_entrypoint_without_its_configmap_stops_naming_it(vitsweep_recorder):
    result = run_entrypoint(vitsweep_recorder, {})
    assert result.returncode != 0
    assert "no data-uri in ConfigMap vitsweep-data" in result.stderr
    assert not (vitsweep_recorder / "argv").exists()


def test_rayjob_head_gets_the_data_uri_from_the_configmap_its_entrypoint_names():
    (head,) = one("RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert env_of(head)["VITSWEEP_DATA_URI"]["valueFrom"] == {
        "configMapKeyRef": {"name": "vitsweep-data", "key": "data-uri", "optional": True}}


def containers_of(tree) -> list[dict]:
    """Every container (and init container) under a manifest."""
    if isinstance(tree, list):
        return [container for value in tree for container in containers_of(value)]
    if not isinstance(tree, dict):
        return []
    own = [c for key in ("containers", "initContainers") if isinstance(tree.get(key), list) for c in tree[key]]
    return own + [container for value in tree.values() for container in containers_of(value)]


def configmap_variables() -> list[tuple[str, dict, str]]:
    """(where, env item, what its container runs) for every variable taken from a ConfigMap."""
    found = []
    for _, doc in manifests():
        for container in containers_of(doc):
            runs = doc.get("spec", {}).get("entrypoint", "") + " ".join(container.get("command", []) + container.get("args", []))
            found += [(f"{doc['kind']}/{doc['metadata']['name']} {item['name']}", item, runs)
                      for item in container.get("env", []) if "configMapKeyRef" in item.get("valueFrom", {})]
    return found


@pytest.mark.parametrize("where,item,runs", configmap_variables(), ids=[where for where, _, _ in configmap_variables()])
def test_a_missing_configmap_fails_its_user_at_once_naming_it(where, item, runs):
    # A required ConfigMap that is missing holds the pod in CreateContainerConfigError (a RayJob waits in
    # Initializing with its GPU nodes booked); optional, the variable is unset and its user says so.
    ref = item["valueFrom"]["configMapKeyRef"]
    assert ref["optional"] is True
    assert re.search(rf"\$\{{{item['name']}:\?[^}}]*ConfigMap {ref['name']}\b", runs), runs


def test_a_rayjob_gives_its_gpus_back_as_soon_as_the_run_ends():
    # The run's logs and checkpoints are on the shared volume: nothing is gained by keeping 64 A100.
    spec = one("RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 0


def test_a_rayjob_retried_on_a_new_cluster_continues_its_run_from_the_shared_volume():
    """A retry (a lost head ends the Ray job with its cluster) runs the same entrypoint on a new cluster:
    it resumes only if the job names its run and keeps it where every cluster mounts it."""
    spec = one("RayJob")["spec"]
    assert spec["backoffLimit"] == 1  # one: every failure is retried alike, bad input included
    cfg = load_config(str(JOB))
    assert cfg.run.name and "--set run.name" not in spec["entrypoint"]  # the same name on every try
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in head["volumes"]}
    (container,) = [c for c in head["containers"] if c["name"].startswith("ray-head")]
    shared = [mount["mountPath"] for mount in container["volumeMounts"]
              if "persistentVolumeClaim" in volumes[mount["name"]]]
    assert any(cfg.run.storage_path.startswith(path + "/") for path in shared), (cfg.run.storage_path, shared)


def test_the_mlflow_server_spools_uploads_on_disk_and_keeps_its_auth_settings_in_memory():
    # Proxied artifact uploads are written whole to the server's temp dir before they go to the bucket.
    pod = one("Deployment", "mlflow")["spec"]["template"]["spec"]
    container = mlflow_container()
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
    env = {item["name"]: item.get("value") for item in container["env"]}
    scratch = mounts[env.get("TMPDIR") or "/tmp"]["emptyDir"]
    assert "medium" not in scratch and quantity(scratch["sizeLimit"]) >= 4 * 2**30  # disk, a few Gi
    assert quantity(container["resources"]["requests"]["ephemeral-storage"]) >= quantity(scratch["sizeLimit"])
    settings = mounts[str(Path(env["MLFLOW_AUTH_CONFIG_PATH"]).parent)]["emptyDir"]
    assert settings["medium"] == "Memory"  # it holds the database URI with its password


def mlflow_container() -> dict:
    (container,) = one("Deployment", "mlflow")["spec"]["template"]["spec"]["containers"]
    return container


def test_mlflow_server_runs_behind_basic_auth_with_postgres_and_an_object_store():
    container = mlflow_container()
    script, env = container["args"][0], env_of(container)
    assert "exec mlflow server --app-name basic-auth" in script
    assert "--serve-artifacts --artifacts-destination \"$MLFLOW_ARTIFACTS_DESTINATION\"" in script
    assert env["MLFLOW_BACKEND_STORE_URI"]["value"].startswith("postgresql://")
    assert env["MLFLOW_ARTIFACTS_DESTINATION"]["valueFrom"]["configMapKeyRef"]["name"] == "vitsweep-mlflow"
    assert "--backend-store-uri" not in script  # read from the environment: the password stays out of argv
    postgres = one("StatefulSet", "mlflow-postgres")
    assert urlsplit(env["MLFLOW_BACKEND_STORE_URI"]["value"]).hostname == postgres["spec"]["serviceName"]


def test_mlflow_servers_login_settings_trust_a_verified_login_for_a_minute_as_mlflow_reads_them(tmp_path, monkeypatch):
    """Without MLflow's credential cache every request re-hashes the password (werkzeug's scrypt, ~0.5 CPU-s
    on 2 cores: benchmarks/bench_mlflow_auth_cache.py), and every run's metrics and every node's system
    metrics are requests. The settings file the server writes, read by MLflow's own reader."""
    from mlflow.server.auth.config import read_auth_config

    (tmp_path / "basic_auth.ini").write_text(kuberay_mlflow_auth_config("postgresql://mlflow@mlflow-postgres/mlflow"))
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "basic_auth.ini"))
    settings = read_auth_config()
    assert settings.auth_cache_ttl_seconds == 60
    assert settings.authorization_function == "mlflow.server.auth:authenticate_request_basic_auth"
    assert settings.database_uri == "postgresql://mlflow@mlflow-postgres/mlflow" and settings.default_permission == "READ"


def test_mlflow_credentials_come_from_secrets_and_expand_only_inside_the_pod():
    names = list(env_of(mlflow_container()))
    env = env_of(mlflow_container())
    for name, item in env.items():
        if re.search(r"PASSWORD|SECRET|TOKEN", name):
            assert "secretKeyRef" in item["valueFrom"], name
    uri = env["MLFLOW_BACKEND_STORE_URI"]["value"]
    for variable in re.findall(r"\$\((\w+)\)", uri):  # Kubernetes expands only variables defined earlier
        assert names.index(variable) < names.index("MLFLOW_BACKEND_STORE_URI")
        assert "secretKeyRef" in env[variable]["valueFrom"]


def ray_containers() -> list[dict]:
    """Every Ray container of the RayCluster and the RayJob (heads and workers; not the init containers)."""
    return [container for spec in cluster_specs().values()
            for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for container in group["template"]["spec"]["containers"]]


def test_every_ray_pod_logs_to_the_same_mlflow_uri():
    uris = {env_of(container)["MLFLOW_TRACKING_URI"]["value"] for container in ray_containers()}
    assert len(uris) == 1 and len(ray_containers()) == 4, uris


def test_the_runs_mlflow_uri_is_the_mlflow_service_and_one_of_its_allowed_hosts():
    uri = urlsplit(env_of(ray_containers()[0])["MLFLOW_TRACKING_URI"]["value"])
    service = one("Service", "mlflow")
    assert uri.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert uri.port in {port["port"] for port in service["spec"]["ports"]}
    assert service["spec"]["type"] == "ClusterIP"
    allowed = re.search(r'--allowed-hosts "([^"]+)"', mlflow_container()["args"][0]).group(1).split(",")
    assert uri.netloc in allowed and "*" not in allowed


def basic_auth_open_routes() -> tuple[str, ...]:
    """The path prefixes MLflow's basic-auth app serves without credentials, read from its source
    (importing it needs Flask-WTF, which the server image has and this environment need not)."""
    package = Path(importlib.util.find_spec("mlflow").origin).parent
    source = (package / "server" / "auth" / "__init__.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_UNPROTECTED_PATH_PREFIXES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("mlflow.server.auth no longer defines _UNPROTECTED_PATH_PREFIXES")


def test_mlflow_health_probes_use_a_route_basic_auth_leaves_open_and_the_api_is_not_one():
    open_routes, container = basic_auth_open_routes(), mlflow_container()
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"].startswith(open_routes)
    assert not "/api/2.0/mlflow/runs/search".startswith(open_routes)


def mounts_claim(pod: dict, claims: set[str]) -> set[str]:
    """The claims a pod mounts: its PersistentVolumeClaim volumes and its StatefulSet's claim templates."""
    return claims | {volume["persistentVolumeClaim"]["claimName"] for volume in pod.get("volumes", [])
                     if "persistentVolumeClaim" in volume}


@pytest.mark.parametrize("name,pod,claims", pod_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_pods_that_run_as_a_user_write_their_root_owned_volumes_through_their_group(name, pod, claims):
    if not mounts_claim(pod, claims):
        return
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, name
    assert security["fsGroup"] == security["runAsGroup" if "runAsGroup" in security else "runAsUser"], name
    if "vitsweep-shared" in mounts_claim(pod, claims):  # 1 Ti shared by every pod: no recursive chown per start
        assert security["fsGroupChangePolicy"] == "OnRootMismatch", name


def test_ray_pods_run_as_the_images_user():
    user = re.findall(r"^USER (\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)[-1]
    assert user == "ray"  # rayproject/ray's user: uid 1000, group users (100)
    for name, pod, _ in pod_specs():
        if name.startswith(("RayCluster", "RayJob")):
            assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (1000, 100), name


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_gpu_worker_pods_run_as_an_account_that_holds_no_kubernetes_permissions(kind):
    # The head's account carries the autoscaler's pod permissions (KubeRay binds them to it); a GPU
    # worker reads data with its cloud identity, gets its two secrets from the kubelet and writes
    # checkpoints to the shared volume: it needs no Kubernetes API token at all.
    spec = cluster_specs()[kind]
    head_account = spec["headGroupSpec"]["template"]["spec"]["serviceAccountName"]
    account = one("ServiceAccount", "vitsweep-gpu-worker")
    assert account["automountServiceAccountToken"] is False
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert pod["serviceAccountName"] == "vitsweep-gpu-worker" != head_account
        assert pod["automountServiceAccountToken"] is False
