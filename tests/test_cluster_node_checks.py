"""Every `vitsweep` command a cluster file runs on a node before Ray starts there (the launchers' head
and worker setup commands, the KubeRay GPU pods' init containers), run here under that node's
conditions: it passes on a healthy node, and a check that cannot apply on that node is skipped with
its reason instead of failing the node.

A node's conditions are built in a private mount namespace (`unshare`), so this machine's own /mnt
is never touched: /mnt is read-only with nothing under it but what the node mounts (a launcher node:
the shared filesystem at /mnt/shared, writable by everyone as the launchers' `chmod 1777` leaves it;
an init container: no volume at all), HOME is the image user's own, the environment holds the image's
variables and no MLflow URI, and the command runs as the image's user (uid 1000) where this checkout
is readable by it. This machine has no GPU, so there a GPU node's own check fails (exactly as
`check_gpu_node()` says) and every other check must pass or be skipped."""
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import nvml_problem_here, vitsweep_env
from pipeline.components.accelerator import GpuUnavailableError, check_gpu_node

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHERS = ("aws-p4d.yaml", "gcp-a2.yaml")
KUBERAY = ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml")
IMAGE_USER = ("1000", "100")  # rayproject/ray's `ray` user and `users` group (cluster/Dockerfile: USER ray)

pytestmark = pytest.mark.slow  # each command imports torch, DeepSpeed and FFCV (~10 s)


@dataclass(frozen=True)
class Node:
    """Where a command runs: whether the node has GPUs, what is mounted under /mnt, and whether a shell
    runs the command (launcher setup commands) or it is exec'd as words (a Kubernetes `command`)."""

    kind: str
    has_gpus: bool
    mounts_shared_filesystem: bool
    # the launchers' `-v ...:/mnt/local-nvme` on every node (head included), mode 1777 from their initialization_commands
    mounts_node_cache: bool
    shell: bool


LAUNCHER_HEAD = Node("launcher head", has_gpus=False, mounts_shared_filesystem=True, mounts_node_cache=True, shell=True)
LAUNCHER_GPU_WORKER = Node("launcher GPU worker", has_gpus=True, mounts_shared_filesystem=True, mounts_node_cache=True,
                           shell=True)
INIT_CONTAINER = Node("KubeRay init container", has_gpus=True, mounts_shared_filesystem=False, mounts_node_cache=False,
                      shell=False)
LAUNCHER_NODES = {"head_setup_commands": LAUNCHER_HEAD, "worker_setup_commands": LAUNCHER_GPU_WORKER}


def dockerfile_workdir() -> str:
    return re.findall(r"^WORKDIR (\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)[-1]


def image_environment() -> dict[str, str]:
    """The `ENV` of the vitsweep image (its last stage)."""
    text = (CLUSTER / "Dockerfile").read_text()
    stage = text[text.rindex("\nFROM "):]
    return dict(re.findall(r'^ENV (\w+)="?([^"\n]*)"?$', stage, re.MULTILINE))


def node_commands() -> dict[tuple[Node, str], list[str]]:
    """Each distinct (node, command) of the cluster files, with the places that run it."""
    found: dict[tuple[Node, str], list[str]] = {}
    for name in LAUNCHERS:
        config = yaml.safe_load((CLUSTER / name).read_text())
        assert not config["setup_commands"]  # each command belongs to one kind of node
        for key, node in LAUNCHER_NODES.items():
            for command in config[key]:
                if command.split()[0] == "vitsweep":
                    found.setdefault((node, command), []).append(f"{name} {key}")
    for path in KUBERAY:
        spec = yaml.safe_load((CLUSTER / path).read_text())["spec"]
        spec = spec.get("rayClusterSpec", spec)
        for group in spec["workerGroupSpecs"]:
            for container in group["template"]["spec"].get("initContainers", []):
                if container["command"][0] == "vitsweep":
                    found.setdefault((INIT_CONTAINER, shlex.join(container["command"])), []).append(
                        f"{path} {group['groupName']} {container['name']}")
    return found


@functools.cache
def as_image_user() -> list[str]:
    """setpriv to the image's user where this checkout and its Python are readable by it (else as is)."""
    if os.geteuid() != 0:
        return []  # not root already
    drop = ["setpriv", f"--reuid={IMAGE_USER[0]}", f"--regid={IMAGE_USER[1]}", "--clear-groups"]
    probe = subprocess.run([*drop, "env", sys.executable, "-c", "import pipeline.cli"], cwd=ROOT,
                           env=vitsweep_env(), capture_output=True)
    return drop if probe.returncode == 0 else []


def node_process(node: Node, command: str) -> subprocess.Popen:
    """`command` as the node runs it, in a private mount namespace holding the node's /mnt and HOME."""
    user = as_image_user()
    env = {**{k: v for k, v in vitsweep_env().items() if k in ("PATH", "PYTHONPATH", "LANG")},
           **image_environment(), "HOME": "/home/ray",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    words = command if node.shell else shlex.split(command)
    # The image keeps this repository at its WORKDIR: absolute paths into it are this checkout here.
    words = words.replace(dockerfile_workdir(), str(ROOT)) if node.shell else [
        word.replace(dockerfile_workdir(), str(ROOT)) for word in words]
    run = ["bash", "-c", words] if node.shell else words
    setup = [
        "set -e",
        "mount -t tmpfs -o mode=755 node-mnt /mnt",
        *(["mkdir /mnt/shared", "mount -t tmpfs -o mode=1777 shared-filesystem /mnt/shared"]
          if node.mounts_shared_filesystem else []),
        *(["mkdir /mnt/local-nvme", "mount -t tmpfs -o mode=1777 node-cache /mnt/local-nvme"]
          if node.mounts_node_cache else []),
        "mount -o remount,ro /mnt",
        "mount -t tmpfs -o mode=755 node-home /home && mkdir /home/ray",
        *([f"chown {IMAGE_USER[0]}:{IMAGE_USER[1]} /home/ray"] if user else []),
        f"cd {shlex.quote(str(ROOT))}",
        "exec " + shlex.join([*user, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *run]),
    ]
    namespace = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else [
        "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    return subprocess.Popen([*namespace, "bash", "-c", "\n".join(setup)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@functools.cache
def ran_on_their_nodes() -> dict[tuple[Node, str], tuple[int, str, str]]:
    """Every (node, command), run side by side (each mostly imports): {(node, command): (exit code, stdout, stderr)}."""
    running = {key: node_process(*key) for key in COMMANDS}
    outputs = {key: process.communicate(timeout=600) for key, process in running.items()}
    return {key: (running[key].returncode, *outputs[key]) for key in running}


def doctor_lines(stdout: str) -> dict[str, tuple[str, str]]:
    """{check: (status, detail)} from the doctor's table."""
    return {match[1]: (match[0], match[2])
            for match in re.findall(r"^\s*(ok|FAIL|skip)  (\w+)\s+(.*)$", stdout, re.MULTILINE)}


def gpu_check_here() -> str | None:
    """What `vitsweep doctor` must say of this machine's GPUs: None if usable, else the reason."""
    try:
        check_gpu_node()
    except GpuUnavailableError as err:
        return str(err)
    return None


GPU_CHECKS = ("gpu", "gpu_metrics")  # what this machine (no GPU) fails on a GPU node
COMMANDS = node_commands()


def test_every_cluster_file_checks_its_nodes_with_vitsweep_doctor():
    places = {place.split()[0] for where in COMMANDS.values() for place in where}
    assert places == {*LAUNCHERS, *KUBERAY}
    assert all(command.startswith("vitsweep doctor ") for _, command in COMMANDS)


@pytest.mark.parametrize("node,command", list(COMMANDS), ids=lambda v: v.kind if isinstance(v, Node) else v)
def test_a_node_passes_its_own_check_and_skips_what_does_not_apply_there(node, command):
    returncode, stdout, stderr = ran_on_their_nodes()[(node, command)]
    lines = doctor_lines(stdout)
    where = f"{COMMANDS[(node, command)]}\n{stdout}\n{stderr[-3000:]}"
    assert {"python", "torch", "gpu", "mlflow", "disk"} <= set(lines), where
    # Everything but the GPUs is healthy here: it passes, or it cannot apply on this node and says why.
    for name, (status, detail) in lines.items():
        if name not in GPU_CHECKS:
            assert status == "ok" or (status == "skip" and detail.startswith("not on a ")), (name, where)
    problems = {"gpu": gpu_check_here(), "gpu_metrics": nvml_problem_here()}
    for name, problem in problems.items():
        status, detail = lines[name]
        if status == "skip":
            assert detail.startswith("not on a "), (name, where)
        elif not node.has_gpus or problem is None:  # a CPU node is healthy without GPUs
            assert status == "ok", (name, where)
        else:  # a GPU node whose GPUs this machine does not have: that is its only failure
            assert status == "FAIL" and problem in detail, (name, where)
    failed = any(lines[name][0] == "FAIL" for name in problems)
    assert returncode == (1 if failed else 0), where


def test_an_init_container_checks_the_driver_only_and_says_why_it_skips_the_rest():
    (key,) = [key for key in COMMANDS if key[0] is INIT_CONTAINER]
    lines = doctor_lines(ran_on_their_nodes()[key][1])
    assert lines["mlflow"][0] == "skip" and "no tracking URI" in lines["mlflow"][1]
    assert lines["disk"][0] == "skip" and "no volume" in lines["disk"][1]
    assert lines["gpu"][0] != "skip"
