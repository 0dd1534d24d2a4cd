"""Every container and node the cluster files declare, built from those files, and run here.

A ``Container`` is what a file says one place gets: the KubeRay heads, worker containers and init
containers of ``cluster/kuberay/`` (the pod's user from its ``securityContext``, its volumes from its
``volumeMounts``, its environment from the image's ``ENV`` and its ``env``), a RayJob's submitter as
KubeRay builds it from the RayJob (``rayjob_submitters``, ``submit_script``), and the launchers' head and
GPU worker nodes of ``cluster/*.yaml`` (the image's user, the ``-v`` and ``-e`` of their ``docker``
run options), with the ``vitsweep`` commands each file runs there. A new container or volume in
``cluster/`` is built without a new fixture.

``node_process`` runs a command in such a container on this machine, in a private mount namespace
(``unshare``) with its own process table, so this machine's own /mnt and /tmp and its processes are never
touched: /mnt is the image's, root-owned
and read-only, holding only the mount points of the container's volumes (each writable, as an
``emptyDir`` or the launchers' ``chmod 1777`` leaves it, but a claim as a new share comes: root-owned, and
writable through the pod's ``fsGroup`` where its pod sets one); /tmp is the container's own; HOME is the image
user's; the environment is the container's alone, with the image's ``cluster/bin`` programs on its PATH;
and the command runs as the container's user (this Python made reachable to it, ``interpreter_reachable``).
The image keeps this repository at its ``WORKDIR``: absolute paths into it are this checkout here. Given an
address, the node also gets a network of its own (its ports are its own, and Ray names it by that address).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHERS = ("aws-p4d.yaml", "gcp-a2.yaml")
KUBERAY = ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml")
IMAGE_USER = ("1000", "100")  # rayproject/ray's `ray` user and `users` group (cluster/Dockerfile: USER ray)
GPU = "nvidia.com/gpu"
# Mounted by every container runtime itself (Docker, containerd): a volume there changes only its size.
RUNTIME_MOUNTS = ("/dev/shm",)
# The environment of a value that comes from a Secret or a ConfigMap: a stand-in naming it.
FROM_STORE = "<{kind} {name}/{key}>"


@dataclass(frozen=True)
class Container:
    """One place a cluster file runs code: where it is declared, its node role (``vitsweep doctor --node``),
    its GPUs, its writable volumes, its environment and user, and the ``vitsweep`` commands the file runs in
    it (a launcher's setup commands through a shell, a Kubernetes ``command`` exec'd as words)."""

    where: str
    role: str
    gpus: int
    volumes: tuple[str, ...]
    env: dict[str, str] = field(hash=False)
    user: tuple[str, str]
    commands: tuple[str, ...] = ()
    shell: bool = False
    runs_job_drivers: bool = False  # a head: `ray job submit` and a RayJob run their drivers here
    # Its claims (PersistentVolumeClaims), by mount path, as a new share comes to it: root-owned, mode 755,
    # and where its pod sets fsGroup, group-owned by it, group-writable and setgid, as the kubelet leaves
    # it for a CSI driver whose fsGroupPolicy is File (GKE's Filestore driver; EFS's applies none).
    claims: tuple[tuple[str, str | None], ...] = ()

    def __repr__(self) -> str:
        return self.where


def dockerfile_workdir() -> str:
    return re.findall(r"^WORKDIR (\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)[-1]


def image_environment() -> dict[str, str]:
    """The `ENV` of the vitsweep image (its last stage)."""
    text = (CLUSTER / "Dockerfile").read_text()
    stage = text[text.rindex("\nFROM "):]
    return dict(re.findall(r'^ENV (\w+)="?([^"\n]*)"?$', stage, re.MULTILINE))


def _kubernetes_env(container: dict) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ((kind, ref),) = item["valueFrom"].items()
            if ref.get("optional"):
                continue  # an optional key may be absent: the command must say what it needs
            env[item["name"]] = FROM_STORE.format(kind=kind, name=ref["name"], key=ref["key"])
    return env


def _pod_user(pod: dict, container: dict) -> tuple[str, str]:
    context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    return str(context.get("runAsUser", IMAGE_USER[0])), str(context.get("runAsGroup", IMAGE_USER[1]))


def _gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get(GPU, 0))


def kuberay_containers() -> list[Container]:
    built = []
    for path in KUBERAY:
        doc = yaml.safe_load((CLUSTER / path).read_text())
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        groups = [("head", "head", spec["headGroupSpec"])] + [
            (group["groupName"], "gpu-worker", group) for group in spec["workerGroupSpecs"]]
        for group_name, role, group in groups:
            pod = group["template"]["spec"]
            claims = {volume["name"] for volume in pod.get("volumes", []) if "persistentVolumeClaim" in volume}
            fs_group = pod.get("securityContext", {}).get("fsGroup")

            def built_from(container: dict, where: str, role: str, commands: tuple[str, ...] = (),
                           drivers: bool = False) -> Container:
                return Container(
                    where, role, _gpus(container), _volumes(container),
                    {**image_environment(), **_kubernetes_env(container)}, _pod_user(pod, container), commands,
                    runs_job_drivers=drivers,
                    claims=tuple((mount["mountPath"], None if fs_group is None else str(fs_group))
                                 for mount in container.get("volumeMounts", []) if mount["name"] in claims))

            for init in pod.get("initContainers", []):
                command = shlex.join(init["command"])
                built.append(built_from(init, f"{path} {group_name} init container {init['name']}",
                                        _doctor_role(command) or role,
                                        (command,) if init["command"][0] == "vitsweep" else ()))
            for container in pod["containers"]:
                built.append(built_from(container, f"{path} {group_name} container {container['name']}", role,
                                        drivers=role == "head"))
    return built


# What KubeRay 1.7 gives a RayJob's submitter (ray-operator/controllers/ray: common/job.go
# GetSubmitterTemplate, GetDefaultSubmitterContainer and BuildJobSubmitCommand; rayjob_controller.go
# configureSubmitterContainer; common/pod.go SetContainerTokenAuthEnvVars): the RayJob's
# submitterPodTemplate, else a pod of one container of the head's image with no securityContext and no
# volume; PYTHONUNBUFFERED; under token auth RAY_AUTH_MODE and the token from key `auth_token` of
# authOptions.secretName; and, where the template gives no command, the job's submission in `bash -ce`.
SUBMITTER_TOKEN_KEY = "auth_token"
DASHBOARD_HEALTH = ("python -c \"import urllib.request; r=urllib.request.urlopen('{address}/api/gcs_healthz', "
                    "timeout=10); exit(0 if b'success' in r.read() else 1)\"")


def rayjob_submitters() -> list[Container]:
    """The submitter of each RayJob of ``cluster/kuberay/`` as KubeRay builds it (its command: ``submit_script``)."""
    built = []
    for path in KUBERAY:
        doc = yaml.safe_load((CLUSTER / path).read_text())
        if doc["kind"] != "RayJob":
            continue
        template = doc["spec"].get("submitterPodTemplate", {}).get("spec")
        pod = template or {}
        container = template["containers"][0] if template else {}
        env = {**image_environment(), **_kubernetes_env(container), "PYTHONUNBUFFERED": "1"}
        auth = doc["spec"]["rayClusterSpec"].get("authOptions", {})
        if auth.get("mode") == "token":
            env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": FROM_STORE.format(
                kind="secretKeyRef", name=auth["secretName"], key=SUBMITTER_TOKEN_KEY)}
        built.append(Container(f"{path} submitter", "submitter", _gpus(container), _volumes(container), env,
                               _pod_user(pod, container), tuple(container.get("command", ()))))
    return built


def submit_script(rayjob: dict, address: str, job_id: str) -> str:
    """The script KubeRay 1.7's submitter Job runs (K8sJobMode): wait for the dashboard's health, submit
    unless ``job_id`` already is (``--no-wait``), then follow the job's logs. Its words joined by spaces,
    the runtime environment as JSON in Go's quoting (``strconv.Quote``: JSON's, for this ASCII text)."""
    spec, url = rayjob["spec"], f"http://{address}"
    runtime_env = json.dumps(json.dumps(yaml.safe_load(spec["runtimeEnvYAML"]), separators=(",", ":"), sort_keys=True))
    words = ["until", DASHBOARD_HEALTH.format(address=url), ">/dev/null", "2>&1", ";", "do", "echo",
             json.dumps(f"Waiting for Ray Dashboard GCS to become healthy at {url} ..."), ";", "sleep", "2", ";",
             "done", ";", "if", "!", "ray", "job", "status", "--address", url, job_id, ">/dev/null", "2>&1", ";",
             "then", "ray", "job", "submit", "--address", url, "--no-wait", "--runtime-env-json", runtime_env,
             "--submission-id", job_id, "--", spec["entrypoint"].strip(), ";", "fi", ";",
             "ray", "job", "logs", "--address", url, "--follow", job_id]
    return " ".join(words)


def _volumes(container: dict) -> tuple[str, ...]:
    return tuple(mount["mountPath"] for mount in container.get("volumeMounts", [])
                 if mount["mountPath"] not in RUNTIME_MOUNTS)


def _doctor_role(command: str) -> str | None:
    found = re.search(r"vitsweep doctor --node (\S+)", command)
    return found and found.group(1)


def launcher_nodes() -> list[Container]:
    built = []
    for name in LAUNCHERS:
        config = yaml.safe_load((CLUSTER / name).read_text())
        assert not config["setup_commands"]  # each command belongs to one kind of node
        options = shlex.split(" ".join(config["docker"]["run_options"]))
        volumes = tuple(options[i + 1].split(":")[1] for i, word in enumerate(options) if word == "-v")
        env = dict(options[i + 1].split("=", 1) for i, word in enumerate(options) if word == "-e")
        for key, role, gpus in (("head_setup_commands", "head", 0), ("worker_setup_commands", "gpu-worker", 8)):
            built.append(Container(
                f"{name} {role} node", role, gpus, volumes, {**image_environment(), **env}, IMAGE_USER,
                tuple(command for command in config[key] if command.split()[0] == "vitsweep"), shell=True,
                runs_job_drivers=role == "head"))
    return built


def ray_start_resources() -> dict[str, dict[str, dict[str, float]]]:
    """The custom resources each cluster file's `ray start` gives each kind of node, {file: {role: resources}}:
    a KubeRay group's ``rayStartParams.resources`` (JSON inside a string, as KubeRay requires it), a
    launcher's ``ray start --resources``."""
    declared: dict[str, dict[str, dict[str, float]]] = {}
    for path in KUBERAY:
        doc = yaml.safe_load((CLUSTER / path).read_text())
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        groups = [("head", spec["headGroupSpec"])] + [(group["groupName"], group) for group in spec["workerGroupSpecs"]]
        declared[path] = {name: json.loads(json.loads(group["rayStartParams"].get("resources", '"{}"')))
                          for name, group in groups}
    for name in LAUNCHERS:
        config = yaml.safe_load((CLUSTER / name).read_text())
        declared[name] = {}
        for key, role in (("head_start_ray_commands", "head"), ("worker_start_ray_commands", "gpu-worker")):
            (start,) = [command for command in config[key] if "ray start" in command]
            words = shlex.split(start.split("ray start", 1)[1])
            given = [word.split("=", 1)[1] for word in words if word.startswith("--resources=")]
            declared[name][role] = json.loads(given[0]) if given else {}
    return declared


def built_containers() -> list[Container]:
    return kuberay_containers() + launcher_nodes()


def as_user(uid: str, gid: str) -> tuple[str, ...]:
    """setpriv to ``uid``:``gid`` (in a namespace that ``interpreter_reachable`` set up), or nothing where this
    process is not root (a user namespace's root is this machine's user)."""
    if os.geteuid() != 0:
        return ()
    return ("setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups")


def interpreter_reachable() -> list[str]:
    """Shell lines that let any user reach this Python inside the namespace: where a directory on its real
    path is closed to others (pyenv under root's 0700 home), a tmpfs takes that directory's place there,
    holding the one entry on the path, bind-mounted. This machine's directories keep their modes."""
    path = Path(os.path.realpath(sys.executable))
    closed = next((parent for parent in reversed(path.parents) if not os.stat(parent).st_mode & 0o001), None)
    if closed is None or os.geteuid() != 0:
        return []
    entry = path.relative_to(closed).parts[0]
    staging = "/home"  # replaced by the node's own home right after
    return [f"mount --bind {shlex.quote(str(closed / entry))} {staging}",
            f"mount -t tmpfs -o mode=755 reachable {shlex.quote(str(closed))}",
            f"mkdir {shlex.quote(str(closed / entry))}",
            f"mount --move {staging} {shlex.quote(str(closed / entry))}"]


def _as_mounted(container: Container, path: str) -> str:
    """tmpfs options for a volume as the container finds it: a claim as a new share (root-owned, and
    group-owned by the pod's fsGroup where the kubelet applies it), else writable by everyone."""
    claims = dict(container.claims)
    if path not in claims:
        return "mode=1777"  # an emptyDir; the launchers' `chmod 1777` mounts
    return "mode=755" if claims[path] is None else f"mode=2775,gid={claims[path]}"


def _network(address: str) -> list[str]:
    """A network namespace's setup: loopback up, and ``address`` as this node's own address, the one a
    route to the outside leaves from (what Ray names the node's IP)."""
    return ["ip link set lo up", f"ip addr add {address}/32 dev lo", f"ip route add default dev lo src {address}"]


def node_process(container: Container, command: str, env: dict[str, str] | None = None,
                 programs: dict[str, str] | None = None, address: str | None = None) -> subprocess.Popen:
    """``command`` as ``container`` runs it (through a shell where its file runs commands so), with
    ``env`` added to its environment (what a job's runtime environment gives its driver), the image's
    ``cluster/bin`` programs on its PATH (``programs``, {name: shell script}, in front of them: a stand-in
    for one), and, given an ``address``, a network of its own where that is the node's address."""
    user = as_user(*container.user)
    passed = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "LANG")}
    stand_ins = "/tmp/node-bin"  # the node's own /tmp: readable by its user
    environment = {**passed, **container.env, **(env or {}), "HOME": "/home/ray",
                   "PATH": f"{stand_ins}:{CLUSTER / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    here = str(ROOT)
    words = command.replace(dockerfile_workdir(), here) if container.shell else [
        word.replace(dockerfile_workdir(), here) for word in shlex.split(command)]
    run = ["bash", "-c", words] if container.shell else words
    assert all(path.startswith("/mnt/") for path in container.volumes), f"{container}: a volume outside /mnt"
    setup = [
        "set -e",
        "mount -t tmpfs -o mode=755 node-mnt /mnt",
        *(f"mkdir -p {shlex.quote(path)} && mount -t tmpfs -o {_as_mounted(container, path)} volume {shlex.quote(path)}"
          for path in container.volumes),
        "mount -o remount,ro /mnt",
        "mount -t tmpfs -o mode=1777 node-tmp /tmp",
        *(_network(address) if address else []),
        f"mkdir -m 755 {stand_ins}",
        *(f"printf %s {shlex.quote(script)} > {stand_ins}/{name} && chmod 755 {stand_ins}/{name}"
          for name, script in (programs or {}).items()),
        *interpreter_reachable(),
        "mount -t tmpfs -o mode=755 node-home /home && mkdir /home/ray",
        *([f"chown {container.user[0]}:{container.user[1]} /home/ray"] if user else []),
        f"cd {shlex.quote(here)}",
        "exec " + shlex.join([*user, "env", "-i", *(f"{k}={v}" for k, v in environment.items()), *run]),
    ]
    # Its own process table too: Ray's `--address auto` looks for a GCS among the running processes.
    own = ["--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", *(["--net"] if address else [])]
    namespace = ["unshare", *own] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", *own]
    return subprocess.Popen([*namespace, "bash", "-c", "\n".join(setup)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


MLFLOW_SERVER_AUTH_CONFIG = "/run/mlflow/basic_auth.ini"  # where cluster/kuberay/mlflow.yaml's server writes it


def kuberay_mlflow_auth_config(database_uri: str) -> str:
    """The basic-auth app's settings as cluster/kuberay/mlflow.yaml's server writes them at start, for a
    store at ``database_uri``: the file's own ``printf`` line, run by ``sh`` with that URI."""
    (deployment,) = [doc for doc in yaml.safe_load_all((CLUSTER / "kuberay" / "mlflow.yaml").read_text())
                     if doc and doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (writes,) = re.findall(rf"^\s*(printf .*?> {MLFLOW_SERVER_AUTH_CONFIG})$", container["args"][0], re.M | re.S)
    return subprocess.run(["sh", "-c", writes.replace(f"> {MLFLOW_SERVER_AUTH_CONFIG}", "")], capture_output=True,
                          text=True, check=True, env={"MLFLOW_BACKEND_STORE_URI": database_uri}).stdout
