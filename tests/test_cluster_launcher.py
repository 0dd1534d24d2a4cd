"""The Ray cluster launcher configs (cluster/aws-p4d.yaml, cluster/gcp-a2.yaml) are valid for Ray's
own `ray up` checks and hold exactly the 8 x 8 A100 that their paired job config asks for."""
import json
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray.autoscaler
from cluster_nodes import dockerfile_workdir
from pipeline.config.loading import load_config
from pipeline.components.engine import deepspeed_config

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
# Each launcher config and the job config it is sized for.
PAIRED_JOB = {"aws-p4d.yaml": "jobs/a100_8x8.yaml", "gcp-a2.yaml": "jobs/a100_8x8.yaml"}
LAUNCHERS = sorted(PAIRED_JOB)
SECRET_READER = {"aws": "vitsweep-secret aws", "gcp": "vitsweep-secret gcp"}


def launcher(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def world_size(job: str) -> int:
    """DeepSpeed's world size for the job, as the engine derives it (train batch / micro / accum)."""
    cfg = load_config(str(CLUSTER / job))
    ds = deepspeed_config(cfg, cfg.scaling.num_workers)
    return ds["train_batch_size"] // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])


def gpu_node_types(config: dict) -> dict:
    return {name: node for name, node in config["available_node_types"].items() if node["resources"].get("GPU", 0)}


def dockerfile_cache_dir() -> str:
    match = re.search(r"^ENV VITSWEEP_CACHE_DIR=(\S+)$", (CLUSTER / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "cluster/Dockerfile sets no VITSWEEP_CACHE_DIR"
    return match.group(1)


def volume_mounts(run_options: list[str]) -> dict[str, str]:
    """Docker's `-v HOST:CONTAINER` options as {container path: host path}."""
    mounts = {}
    for option in run_options:
        words = shlex.split(option)
        if words[0] == "-v":
            host, container = words[1].split(":")[:2]
            mounts[container] = host
    return mounts


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_config_passes_rays_cluster_config_schema(name):
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher(name), schema)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_config_passes_ray_ups_own_validation_after_filling_defaults(name):
    # What `ray up` does before it talks to the cloud: merge the provider's defaults, then validate.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(launcher(name)))


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_gpu_nodes_hold_exactly_the_paired_jobs_world_size(name):
    config, cfg = launcher(name), load_config(str(CLUSTER / PAIRED_JOB[name]))
    workers = sum(node["max_workers"] * node["resources"]["GPU"] / cfg.scaling.gpus_per_worker
                  for node in gpu_node_types(config).values())
    assert workers == world_size(PAIRED_JOB[name])
    assert config["max_workers"] == sum(node["max_workers"] for node in gpu_node_types(config).values())


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_runs_one_worker_per_gpu_and_their_cpus_fit_the_node(name):
    cfg = load_config(str(CLUSTER / PAIRED_JOB[name]))
    for node in gpu_node_types(launcher(name)).values():
        workers_per_node = node["resources"]["GPU"] / cfg.scaling.gpus_per_worker
        assert workers_per_node == node["resources"]["GPU"]  # workers per node = GPUs per node
        assert workers_per_node * cfg.scaling.cpus_per_worker <= node["resources"]["CPU"]
        assert workers_per_node * cfg.data.num_workers <= node["resources"]["CPU"]  # FFCV decoding threads


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_head_node_takes_no_training_workers(name):
    config = launcher(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["CPU"] == 0 and "GPU" not in head["resources"]
    assert all("--num-cpus=0" in command for command in config["head_start_ray_commands"] if "ray start" in command)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_dashboard_and_job_api_listen_on_loopback_only(name):
    config = launcher(name)
    (start,) = [command for command in config["head_start_ray_commands"] if "ray start" in command]
    assert "--dashboard-host=127.0.0.1" in start
    assert "0.0.0.0" not in yaml.safe_dump(config)
    assert "security_group" not in config["provider"]  # Ray's default group: SSH in, nothing else


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_starts_every_node_with_token_auth_read_from_the_secret_store(name):
    config = launcher(name)
    reader = SECRET_READER[config["provider"]["type"]]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [command for command in config[key] if "ray start" in command]
        assert f"token=$({reader} vitsweep-ray-auth-token) &&" in start
        assert re.search(r'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN="\$token"', start)
        assert start.index("RAY_AUTH_TOKEN") < start.index("ray start")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_gives_every_node_mlflow_credentials_from_the_secret_store_as_ray_starts(name):
    # Trial functions, Ray Train's controllers and each node's system-metrics monitor log from the GPU
    # nodes too: every Ray process inherits its node's `ray start` environment, and nothing else has them.
    config = launcher(name)
    reader = SECRET_READER[config["provider"]["type"]]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [command for command in config[key] if "ray start" in command]
        assert f"mlflow_password=$({reader} vitsweep-mlflow-password) &&" in start, key
        assert 'MLFLOW_TRACKING_USERNAME=vitsweep-train MLFLOW_TRACKING_PASSWORD="$mlflow_password" &&' in start, key
        assert start.index("MLFLOW_TRACKING_PASSWORD") < start.index("ray start"), key
    elsewhere = {key: value for key, value in config.items() if key not in ("head_start_ray_commands",
                                                                          "worker_start_ray_commands")}
    assert "MLFLOW_TRACKING_PASSWORD" not in yaml.safe_dump(elsewhere)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_mounts_node_local_nvme_where_the_image_stages_datasets(name):
    config, cache_dir = launcher(name), dockerfile_cache_dir()
    mounts = volume_mounts(config["docker"]["run_options"])
    assert any(cache_dir.startswith(container + "/") for container in mounts), (cache_dir, mounts)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_mounts_the_shared_filesystem_holding_the_jobs_run_storage(name):
    config, cfg = launcher(name), load_config(str(CLUSTER / PAIRED_JOB[name]))
    mounts = volume_mounts(config["docker"]["run_options"])
    assert any(cfg.run.storage_path.startswith(container + "/") for container in mounts), cfg.run.storage_path
    assert any("mountpoint -q /mnt/shared ||" in command for command in config["initialization_commands"])


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_gives_gpu_workers_all_gpus_and_a_large_dev_shm(name):
    options = " ".join(launcher(name)["docker"]["worker_run_options"])
    assert "--gpus all" in options
    size = re.search(r"--shm-size=(\d+)g", options)
    assert size and int(size.group(1)) >= 64  # Docker's default is 64 MB; NCCL and Ray's object store need GBs


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_sets_nccl_for_tcp_between_nodes(name):
    options = launcher(name)["docker"]["run_options"]
    env = dict(shlex.split(option)[1].split("=", 1) for option in options if option.startswith("-e "))
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"  # every interface but loopback and docker's bridge
    assert int(env["NCCL_SOCKET_NTHREADS"]) * int(env["NCCL_NSOCKS_PERTHREAD"]) <= 64  # NCCL's limit


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_keeps_every_node_in_its_one_zone_and_region(name):
    config = launcher(name)
    provider, text = config["provider"], (CLUSTER / name).read_text()
    assert "," not in provider["availability_zone"]
    if provider["type"] == "aws":
        regions = set(re.findall(r"(?:--region |AWS_DEFAULT_REGION=|\.efs\.)([a-z]+-[a-z]+-\d)", text))
        assert regions == {provider["region"]}
    else:
        zones = set(re.findall(r"(?:zones/|--location=)([a-z]+-[a-z]+\d-[a-z])", text))
        assert zones == {provider["availability_zone"]}
        assert provider["availability_zone"].startswith(provider["region"] + "-")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_shell_commands_are_valid_bash(name):
    config = launcher(name)
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    for command in (command for key in keys for command in config[key]):
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_file_mounts_exist_in_this_checkout(name):
    root = CLUSTER.parent
    for remote, local in launcher(name)["file_mounts"].items():
        assert (root / local).is_dir(), local  # `ray up` runs from the repository root
        assert remote == f"{dockerfile_workdir()}/{local.removeprefix('./')}"  # over the image's copy


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_refuses_a_gpu_node_that_does_not_see_all_its_gpus(name):
    config = launcher(name)
    (check,) = [command for command in config["worker_setup_commands"] if "nvidia-smi" in command]
    (node,) = gpu_node_types(config).values()
    assert check.endswith(f"-eq {node['resources']['GPU']}")


def test_the_readmes_gcp_setup_line_sets_the_project_and_the_gpu_workers_account_together(tmp_path):
    (line,) = [line for line in (CLUSTER.parent / "README.md").read_text().splitlines()
               if line.startswith("sed -i") and "cluster/gcp-a2.yaml" in line]
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "gcp-a2.yaml").write_text((CLUSTER / "gcp-a2.yaml").read_text())
    subprocess.run(["bash", "-c", line], cwd=tmp_path, env={"PROJECT": "my-project", "PATH": "/usr/bin:/bin"},
                   check=True)
    config = yaml.safe_load((tmp_path / "cluster" / "gcp-a2.yaml").read_text())
    (account,) = [node for node in gpu_node_types(config).values()][0]["node_config"]["serviceAccounts"]
    assert config["provider"]["project_id"] == "my-project"
    assert account["email"] == "vitsweep-gpu-worker@my-project.iam.gserviceaccount.com"


@pytest.mark.parametrize("name", LAUNCHERS)
def test_gcp_nodes_use_gvnic_and_a2_gets_the_local_ssd_count_gce_allows(name):
    config = launcher(name)
    if config["provider"]["type"] != "gcp":
        return
    for node in config["available_node_types"].values():
        # Without networkInterfaces Ray's GCP provider adds one of its own, a VIRTIO_NET NIC.
        (interface,) = node["node_config"]["networkInterfaces"]
        assert interface["nicType"] == "GVNIC"
        assert interface["subnetwork"].startswith(f"regions/{config['provider']['region']}/")
        machine = node["node_config"]["machineType"]
        scratch = [disk for disk in node["node_config"]["disks"] if disk["type"] == "SCRATCH"]
        assert len(scratch) in GCE_LOCAL_SSD_COUNTS.get(machine, (0,)), (machine, len(scratch))


# Compute Engine's allowed numbers of 375 GB local SSDs per A2 Standard machine type ("Choose a valid
# number of Local SSD disks", cloud.google.com/compute/docs/disks/local-ssd): a2-highgpu-8g takes 8.
GCE_LOCAL_SSD_COUNTS = {"a2-highgpu-1g": (1, 2, 4, 8), "a2-highgpu-2g": (2, 4, 8), "a2-highgpu-4g": (4, 8),
                        "a2-highgpu-8g": (8,), "a2-megagpu-16g": (8,)}


@pytest.mark.parametrize("name", sorted(PAIRED_JOB))
def test_every_nodes_cache_directory_is_writable_by_the_containers_user_head_included(name):
    """The image's VITSWEEP_CACHE_DIR is a bind mount on every node; the driver on the head keeps its record
    of verified datasets there, so the host directory is made world-writable before any early exit of the
    command that prepares it (the head has no local disks to assemble)."""
    config = launcher(name)
    [host] = [option.split()[1].split(":")[0] for option in config["docker"]["run_options"]
              if option.startswith("-v ") and option.split()[1].endswith(":/mnt/local-nvme")]
    script = "\n".join(config["initialization_commands"])
    chmod = script.find(f"chmod 1777 {host}")
    assert chmod >= 0 and (script.find("exit 0") < 0 or chmod < script.find("exit 0")), script
