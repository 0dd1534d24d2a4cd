"""Every cluster file pairs an NVIDIA driver with the torch build the image installs: CUDA wheels need
a driver of their CUDA major's branch or newer (torch 2.15: CUDA 13.2, R580+), and a node with an
older one must stop before any worker starts, naming both versions."""
import re
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.components.accelerator import minimum_driver
from pipeline.config.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
LAUNCHERS = ("aws-p4d.yaml", "gcp-a2.yaml")
KUBERAY = ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml")


def image_cuda() -> str:
    """The CUDA of the torch the images install: constraints.txt's CUDA runtime wheel (major.minor)."""
    version = re.search(r"^nvidia-cuda-runtime==(\d+\.\d+)\.", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    return version.group(1)


def required_branch() -> int:
    return minimum_driver(image_cuda())[0]


def gpu_worker_pods(path: str) -> list[dict]:
    spec = yaml.safe_load((CLUSTER / path).read_text())["spec"]
    spec = spec.get("rayClusterSpec", spec)
    return [group["template"]["spec"] for group in spec["workerGroupSpecs"]]


def test_the_images_torch_is_the_cuda_build_installed_here():
    assert torch.version.cuda == image_cuda()  # constraints.txt is the set tested together
    assert required_branch() == 580


def test_the_image_refuses_to_start_on_a_driver_older_than_its_torchs_cuda_needs():
    requirement = re.search(r'^ENV NVIDIA_REQUIRE_DRIVER="driver>=(\d+)"$', (CLUSTER / "Dockerfile").read_text(),
                            re.MULTILINE)
    assert requirement and int(requirement.group(1)) >= required_branch()


def test_the_gcp_gpu_nodes_boot_an_image_family_with_a_new_enough_driver():
    config = yaml.safe_load((CLUSTER / "gcp-a2.yaml").read_text())
    for name, node in config["available_node_types"].items():
        for disk in node["node_config"]["disks"]:
            image = disk.get("initializeParams", {}).get("sourceImage")
            if image:
                branch = re.search(r"-nvidia-(\d+)$", image)
                assert branch and int(branch.group(1)) >= required_branch(), (name, image)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_gpu_workers_check_the_driver_first_through_the_paired_gpu_jobs_doctor(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    first = config["worker_setup_commands"][0]
    assert first.startswith("vitsweep doctor --node gpu-worker --config cluster/jobs/")  # the GPUs are required
    assert load_config(str(ROOT / first.split("--config ")[1])).scaling.use_gpu


@pytest.mark.parametrize("path", KUBERAY)
def test_kuberay_gpu_pods_check_the_driver_before_ray_starts(path):
    for pod in gpu_worker_pods(path):
        (check,) = pod["initContainers"]
        (worker,) = pod["containers"]
        assert check["image"] == worker["image"]  # the torch that will train is the one checked
        assert check["command"] == ["vitsweep", "doctor", "--node", "gpu-driver"]  # the driver, whatever the job
        assert check["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"]


def test_the_readme_says_kubernetes_does_not_enforce_the_images_driver_requirement():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`NVIDIA_REQUIRE_DRIVER` is not enforced on Kubernetes" in readme
