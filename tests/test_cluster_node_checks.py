"""Every container and node the cluster files declare, built from those files (``tests/cluster_nodes.py``:
the KubeRay heads, GPU workers and init containers, the launchers' head and GPU worker nodes, each with
its manifest's user, volumes and environment), runs vitsweep's part there on this machine: the doctor of
its role passes on a healthy node, and a check that cannot apply there is skipped with its reason instead
of failing the node; on every head, where job drivers run, a job's driver (a train of the 8x8 A100 job,
its dataset a URI; on the KubeRay head also its sweep and an evaluation) passes every check it makes
before Ray and stops only at joining the cluster, which is not there.

This machine has no GPU, so there a GPU node's own check fails (exactly as `check_gpu_node()` says) and
every other check must pass or be skipped."""
import dataclasses
import json
import re
import shlex
import shutil

import pytest
import yaml
from mlflow.tracking import MlflowClient

from carded_models import carded_smoke_model, log_carded
from cluster_nodes import (CLUSTER, FROM_STORE, KUBERAY, LAUNCHERS, ROOT, SUBMITTER_TOKEN_KEY, Container,
                           built_containers, dockerfile_workdir, node_process, rayjob_submitters,
                           submit_script)
from conftest import mlflow_server, nvml_problem_here
from job_api import JobApi
from pipeline.components.accelerator import GpuUnavailableError, check_gpu_node
from pipeline.data.sidecar import read_sidecar, write_sidecar
from pipeline.trained.registry import register_run
from range_server import RangeServer

pytestmark = pytest.mark.slow  # each command imports torch, DeepSpeed and FFCV (~10 s)

JOB = "cluster/jobs/a100_8x8.yaml"  # the job the cluster files are sized for
RAYJOB_FILE = yaml.safe_load((CLUSTER / "kuberay" / "rayjob.yaml").read_text())
RAYJOB = RAYJOB_FILE["spec"]
# What vitsweep reads of a container's environment: containers that differ only elsewhere (NCCL's
# settings, a cloud SDK's region) run its commands alike, so each distinct one runs once.
READ_BY_VITSWEEP = ("VITSWEEP_", "MLFLOW_", "RAY_")
NO_CLUSTER = "--address auto: Could not find any running Ray instance"
KUBERNETES_SERVICE = re.compile(r"https?://[\w.-]+\.svc\.cluster\.local(:\d+)?")


def _conditions(container: Container) -> tuple:
    env = tuple(sorted((k, v) for k, v in container.env.items() if k.startswith(READ_BY_VITSWEEP)))
    return (container.role, container.gpus, container.volumes, container.user, container.shell, env,
            container.claims)


def distinct(pairs: list[tuple[Container, str]]) -> dict[tuple[Container, str], list[str]]:
    """Each (container, command) whose conditions differ, with the places that run it alike."""
    found: dict[tuple, tuple[Container, str]] = {}
    places: dict[tuple[Container, str], list[str]] = {}
    for container, command in pairs:
        key = found.setdefault((_conditions(container), command), (container, command))
        places.setdefault(key, []).append(container.where)
    return places


def doctor_command(container: Container) -> str:
    """The doctor its file runs there, else the doctor of its role for the job its cluster is sized for
    (a KubeRay head or Ray container), as the launchers' nodes run it."""
    declared = [command for command in container.commands if command.startswith("vitsweep doctor ")]
    return declared[0] if declared else f"vitsweep doctor --node {container.role} --config {JOB}"


def verb(command: str) -> str:
    return re.search(r"exec vitsweep (\w+)", command).group(1)


CONTAINERS = built_containers()
DOCTORS = distinct([(container, doctor_command(container)) for container in CONTAINERS])
# A train and a sweep of the RayJob's job, as its entrypoint writes them, on every kind of head.
TRAIN = RAYJOB["entrypoint"]
TUNE = TRAIN.replace("exec vitsweep train ", "exec vitsweep tune --space lr_wd ")
# The job's model, registered, evaluated on the job's 64 workers on its validation data (the registry's
# name: what `vitsweep register` and `tune --register` write, served here by the loopback MLflow server).
REGISTERED = "models:/imagenet-classifier@champion"
EVALUATE = re.sub(r"exec vitsweep train (.*) --set \"data.train=[^\"]*\" --set \"data.val=([^\"]*)\"",
                  rf'exec vitsweep evaluate {REGISTERED} --workers 64 \1 --data "\2"', TRAIN)
(KUBERAY_HEAD, *_) = [container for container in CONTAINERS
                      if container.where.startswith("kuberay/") and container.runs_job_drivers]
# The train on every kind of head (what differs between heads: volumes, user, where MLflow's address comes
# from, all checked before any verb's own); the sweep and the evaluation, whose own checks (the space, the
# registered model) read the same environment, on the KubeRay head.
DRIVERS = distinct([(container, command) for container in CONTAINERS if container.runs_job_drivers
                    for command in (TRAIN, TUNE, EVALUATE) if command == TRAIN or container == KUBERAY_HEAD])
(RAYJOB_HEAD,) = [container for container in CONTAINERS
                  if container.where.startswith("kuberay/rayjob.yaml") and container.runs_job_drivers]
(SUBMITTER,) = rayjob_submitters()
RAY_TOKEN = "0123456789abcdef" * 4  # the Secret's value, as `openssl rand -hex 32` makes it (README)
JOB_ID = "vitsweep-a100-8x8-x7k2p"  # KubeRay's: the RayJob's name and a random suffix
HEAD_WITHOUT_FSGROUP = dataclasses.replace(KUBERAY_HEAD, where=f"{KUBERAY_HEAD.where} without its pod's fsGroup",
                                           claims=tuple((path, None) for path, _ in KUBERAY_HEAD.claims))
HEAD_WITHOUT_CACHE = dataclasses.replace(
    KUBERAY_HEAD, where=f"{KUBERAY_HEAD.where} without its cache volume",
    volumes=tuple(path for path in KUBERAY_HEAD.volumes
                  if not KUBERAY_HEAD.env["VITSWEEP_CACHE_DIR"].startswith(path + "/")))


def publish_as_the_jobs_dataset(digits16, root):
    """The digits dataset under the file names the job reads (``imagenet_{split}.beton``), its sidecars
    naming them, in ``root`` (what ``VITSWEEP_DATA_URI`` points to)."""
    for split in ("train", "val"):
        published = root / f"imagenet_{split}.beton"
        shutil.copyfile(digits16[split], published)
        write_sidecar(published, read_sidecar(digits16[split]).model_copy(update={"file": published.name}))


def served_here(container: Container, mlflow_uri: str) -> dict[str, str]:
    """The container's variables that name a Kubernetes Service (MLflow's), pointed at ``mlflow_uri``:
    this machine resolves no cluster DNS name."""
    return {name: KUBERNETES_SERVICE.sub(mlflow_uri, value) for name, value in container.env.items()
            if KUBERNETES_SERVICE.search(value)}


def ray_started(container: Container, mlflow_uri: str) -> dict[str, str]:
    """What a launcher node's `ray start` adds to the environment of the Ray processes it starts (a job's
    driver among them): its head's MLflow server, served here by ``mlflow_uri`` (the start command itself
    runs in ``test_a_launcher_heads_start_command_serves_mlflow_behind_a_login_to_every_node``)."""
    return {"MLFLOW_TRACKING_URI": mlflow_uri} if container.where.startswith(LAUNCHERS) else {}


@dataclasses.dataclass(frozen=True)
class Services:
    """What the cluster's nodes reach, served here: the job's dataset (``VITSWEEP_DATA_URI``) over loopback
    HTTP, and MLflow (the in-cluster Service, a launcher head's server) by a loopback server holding the
    registered model ``REGISTERED``."""

    data: dict[str, str]
    mlflow_uri: str

    def for_driver(self, container: Container) -> dict[str, str]:
        return {**self.data, **served_here(container, self.mlflow_uri), **ray_started(container, self.mlflow_uri)}


@pytest.fixture(scope="module")
def services(digits16, tmp_path_factory):
    root = tmp_path_factory.mktemp("job-dataset")
    publish_as_the_jobs_dataset(digits16, root)
    with RangeServer(root) as server, mlflow_server(root / "mlflow.log", "--backend-store-uri",
                                                    f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
                                                    str(root / "artifacts")) as mlflow_uri:
        logged = log_carded(mlflow_uri, root, carded_smoke_model(10, seed=0), [str(digit) for digit in range(10)])
        model = MlflowClient(mlflow_uri).get_logged_model(logged.removeprefix("models:/"))
        register_run(mlflow_uri, model.source_run_id, *REGISTERED.removeprefix("models:/").split("@"))  # as `register`
        yield Services({"VITSWEEP_DATA_URI": server.url("imagenet_train.beton").rsplit("/", 1)[0]}, mlflow_uri)


@pytest.fixture(scope="module")
def ran_on_their_nodes(services) -> dict[tuple[Container, str], tuple[int, str, str]]:
    """Every distinct (container, command), run side by side (each mostly imports):
    {(container, command): (exit code, stdout, stderr)}."""
    running = {key: node_process(*key, served_here(key[0], services.mlflow_uri)) for key in DOCTORS}
    running |= {key: node_process(*key, services.for_driver(key[0]))
                for key in [*DRIVERS, (HEAD_WITHOUT_CACHE, TRAIN), (HEAD_WITHOUT_FSGROUP, TRAIN)]}
    outputs = {key: process.communicate(timeout=600) for key, process in running.items()}
    return {key: (running[key].returncode, *outputs[key]) for key in running}


@dataclasses.dataclass(frozen=True)
class Submission:
    returncode: int
    output: str  # the submitter's, as `kubectl logs` shows it
    api: JobApi


@pytest.fixture(scope="module")
def submitted_rayjob(services) -> Submission:
    """The RayJob's submitter, built and run as KubeRay 1.7 runs it, its Secret's token the stand-in's,
    against the head's job API on loopback (the head Service's address), which runs what arrives on the
    RayJob's head as Ray's job supervisor runs an entrypoint."""
    def as_the_job_supervisor(entrypoint: str, env_vars: dict[str, str]):
        return node_process(RAYJOB_HEAD, shlex.join(["/bin/sh", "-c", entrypoint]),
                            {**services.for_driver(RAYJOB_HEAD), **env_vars})

    with JobApi(RAY_TOKEN, as_the_job_supervisor) as api:
        script = submit_script(RAYJOB_FILE, api.address, JOB_ID)
        submitter = node_process(SUBMITTER, shlex.join(["/bin/bash", "-ce", "--", script]), {"RAY_AUTH_TOKEN": RAY_TOKEN})
        stdout, stderr = submitter.communicate(timeout=600)
    return Submission(submitter.returncode, stdout + stderr, api)


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


def test_every_cluster_file_is_built_and_checks_its_nodes_with_vitsweep_doctor():
    containers = CONTAINERS
    assert {container.where.split()[0] for container in containers} == {*LAUNCHERS, *KUBERAY}
    declared = [command for container in containers for command in container.commands]
    assert declared and all(command.startswith("vitsweep doctor ") for command in declared)
    assert {container.where.split()[0] for container in containers if container.commands} == {*LAUNCHERS, *KUBERAY}
    heads = [container.where for container in containers if container.runs_job_drivers]
    assert len(heads) == len(LAUNCHERS) + len(KUBERAY), heads


@pytest.mark.parametrize("container,command", list(DOCTORS), ids=lambda v: v if isinstance(v, str) else v.where)
def test_a_node_passes_its_own_check_and_skips_what_does_not_apply_there(ran_on_their_nodes, container, command):
    returncode, stdout, stderr = ran_on_their_nodes[(container, command)]
    lines = doctor_lines(stdout)
    where = f"{DOCTORS[(container, command)]}\n{stdout}\n{stderr[-3000:]}"
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
        elif not container.gpus or problem is None:  # a CPU node is healthy without GPUs
            assert status == "ok", (name, where)
        else:  # a GPU node whose GPUs this machine does not have: that is its only failure
            assert status == "FAIL" and problem in detail, (name, where)
    if "MLFLOW_TRACKING_URI" in container.env:  # its file names the server: the node reaches it
        assert lines["mlflow"][0] == "ok", where
    failed = any(lines[name][0] == "FAIL" for name in problems)
    assert returncode == (1 if failed else 0), where


def test_an_init_container_checks_the_driver_only_and_says_why_it_skips_the_rest(ran_on_their_nodes):
    (key,) = [key for key in DOCTORS if key[0].role == "gpu-driver"]
    lines = doctor_lines(ran_on_their_nodes[key][1])
    assert lines["mlflow"][0] == "skip" and "no tracking URI" in lines["mlflow"][1]
    assert lines["disk"][0] == "skip" and "no volume" in lines["disk"][1]
    assert lines["gpu"][0] != "skip"


@pytest.mark.parametrize("container,command", list(DRIVERS),
                         ids=lambda v: verb(v) if isinstance(v, str) else v.where)
def test_a_jobs_driver_on_a_head_passes_every_check_and_stops_only_at_joining_the_cluster(
        ran_on_their_nodes, container, command):
    """The RayJob's entrypoint (and the same job as a sweep), its dataset a URI: the config, the paths it
    writes (the staging cache of the image's VITSWEEP_CACHE_DIR, the run storage on the shared volume),
    the remote dataset's verification, the model on the meta device and the MLflow store (the head's
    tracking URI: KubeRay's Service, or the launcher head's own server, served here on loopback) all pass;
    the only failure left is the cluster itself."""
    returncode, stdout, stderr = ran_on_their_nodes[(container, command)]
    where = f"{DRIVERS[(container, command)]}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert returncode == 2 and stderr.strip().splitlines()[-1].startswith(f"vitsweep {verb(command)}: {NO_CLUSTER}"), where


def test_the_rayjobs_submitter_sends_the_entrypoint_with_the_clusters_token_and_the_head_runs_it_to_joining_the_cluster(
        submitted_rayjob):
    """KubeRay's submitter: the head's image, its user, no volume, the token from the Secret the README
    creates (key ``auth_token``, what KubeRay reads). It waits for the head's health (asked without the
    token, as Ray allows), finds the job not yet submitted, submits the entrypoint and the runtime
    environment as written, and follows the driver's output. What arrives runs on the RayJob's head through
    Ray's shell: every check passes and it stops at joining the cluster, and the submitter's log says so."""
    api, output = submitted_rayjob.api, submitted_rayjob.output
    assert api.refused == [], output  # every request but the health check carried the token
    assert SUBMITTER.user == ("1000", "100") and not SUBMITTER.volumes
    assert SUBMITTER.env.get("RAY_AUTH_TOKEN") == FROM_STORE.format(kind="secretKeyRef", name="vitsweep-ray-auth",
                                                                     key=SUBMITTER_TOKEN_KEY)
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"create secret generic vitsweep-ray-auth \\\n\s*--from-literal={SUBMITTER_TOKEN_KEY}=", readme)
    (job,) = api.jobs.values()
    assert job.request["submission_id"] == JOB_ID
    assert job.request["runtime_env"]["env_vars"] == yaml.safe_load(RAYJOB["runtimeEnvYAML"])["env_vars"]
    # as written (the image's code at its WORKDIR: this checkout here)
    assert shlex.split(job.request["entrypoint"]) == shlex.split(TRAIN.replace(dockerfile_workdir(), str(ROOT)))
    last = job.output.strip().splitlines()[-1]
    assert job.returncode == 2 and last.startswith(f"vitsweep train: {NO_CLUSTER}"), job.output[-3000:]
    # the driver's reason in the submitter's log; `ray job logs` itself ends 0 whatever the job did: the
    # RayJob's status is the job's as the head reports it (KubeRay asks the head, not the submitter's exit)
    assert job.details()["status"] == "FAILED"
    assert submitted_rayjob.returncode == 0 and last in output and f"Job '{JOB_ID}' failed" in output, output[-3000:]


def test_a_kuberay_head_without_its_cache_volume_refuses_the_job_naming_the_cache(ran_on_their_nodes):
    """What the built head catches: without a volume at the image's VITSWEEP_CACHE_DIR (as the KubeRay heads
    were), /mnt is the image's, root-owned, and the job's driver exits 2 before Ray, naming the directory."""
    returncode, _, stderr = ran_on_their_nodes[(HEAD_WITHOUT_CACHE, TRAIN)]
    cache = HEAD_WITHOUT_CACHE.env["VITSWEEP_CACHE_DIR"]
    assert returncode == 2 and f"$VITSWEEP_CACHE_DIR: {cache!r} cannot be created" in stderr, stderr[-3000:]


def test_a_kuberay_head_on_a_new_share_without_its_pods_fsgroup_refuses_the_job_naming_the_run_storage(
        ran_on_their_nodes):
    """What the built head catches: a new share is root-owned; the pod's fsGroup (which GKE's Filestore
    driver lets the kubelet apply: its CSIDriver's fsGroupPolicy is File) is what lets the pods' user write
    there. Without it the job's driver exits 2 before Ray, naming the run storage it cannot create."""
    assert KUBERAY_HEAD.claims and all(group == "100" for _, group in KUBERAY_HEAD.claims)
    returncode, _, stderr = ran_on_their_nodes[(HEAD_WITHOUT_FSGROUP, TRAIN)]
    assert returncode == 2 and "run.storage_path: '/mnt/shared/vitsweep-runs' cannot be created" in stderr, stderr[-3000:]


# A launcher head's `ray start` command, as its file writes it, on a node with a private address of its own
# (as the cloud's network gives it; MLflow's server answers such hosts), the secret store a stand-in and
# Ray's command one that logs an MLflow run from the environment it was given (what every Ray process
# on that node inherits). Run twice on the head (`ray up` again), then the worker's, as Ray's updater
# runs each command: in a shell of its own.
HEAD_ADDRESS = "10.0.0.5"
STAND_IN_SECRETS = {"vitsweep-ray-auth-token": "a" * 64, "vitsweep-mlflow-password": "trainer-" + "b" * 40,
                    "vitsweep-mlflow-admin-password": "admin-" + "c" * 42}
LOG_A_RUN = """
import json, os, urllib.error, urllib.request
from mlflow import MlflowClient
uri = os.environ["MLFLOW_TRACKING_URI"]
client = MlflowClient(uri)
experiment = client.get_experiment_by_name("vitsweep")
run = client.create_run(experiment.experiment_id if experiment else client.create_experiment("vitsweep"),
                        run_name=os.environ["NODE"])
client.set_terminated(run.info.run_id)
try:
    anonymous = urllib.request.urlopen(uri + "/api/2.0/mlflow/experiments/search?max_results=1").status
except urllib.error.HTTPError as err:
    anonymous = err.code
print(json.dumps({"node": os.environ["NODE"], "uri": uri, "user": os.environ["MLFLOW_TRACKING_USERNAME"],
                  "anonymous": anonymous}))
"""
PROCESSES = """
import json, os, psutil
from mlflow.server.auth.config import read_auth_config
store = "/mnt/shared/mlflow"
os.environ["MLFLOW_AUTH_CONFIG_PATH"] = os.path.join(store, "basic_auth.ini")
print(json.dumps({"processes": [p.info for p in psutil.process_iter(["pid", "ppid", "cmdline"])],
                  "store_mode": oct(os.stat(store).st_mode & 0o777), "store": sorted(os.listdir(store)),
                  "login_cache_s": read_auth_config().auth_cache_ttl_seconds}))
"""


def secret_store(platform: str) -> str:
    """A stand-in for the image's `vitsweep-secret PLATFORM NAME` (no cloud identity or secret store here)."""
    cases = "".join(f"  '{platform} {name}') printf %s '{value}' ;;\n" for name, value in STAND_IN_SECRETS.items())
    return f'#!/bin/sh\ncase "$1 $2" in\n{cases}  *) echo "no secret $1 $2" >&2; exit 1 ;;\nesac\n'


def test_a_launcher_heads_start_command_serves_mlflow_behind_a_login_to_every_node():
    config = yaml.safe_load((CLUSTER / "aws-p4d.yaml").read_text())
    (head,) = [container for container in CONTAINERS if container.where == "aws-p4d.yaml head node"]
    each = lambda node, commands: [f"export NODE={node}", *(f"( {command}\n)" for command in commands)]  # noqa: E731
    script = "\n".join([
        'ray() { if [ "$1" = start ]; then python -c "$LOG_A_RUN"; fi; }',
        *each("head", config["head_start_ray_commands"]), *each("head-again", config["head_start_ray_commands"]),
        f"export RAY_HEAD_IP={HEAD_ADDRESS}", *each("gpu-worker", config["worker_start_ray_commands"]),
        'python -c "$PROCESSES"'])
    node = node_process(head, script, {"LOG_A_RUN": LOG_A_RUN, "PROCESSES": PROCESSES},
                        programs={"vitsweep-secret": secret_store("aws")}, address=HEAD_ADDRESS)
    stdout, stderr = node.communicate(timeout=600)
    assert node.returncode == 0, stdout[-3000:] + stderr[-3000:]
    *runs, facts = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    # every node logged a run to the head's server at the head's address, logged in as the training user,
    # where a request without a login is refused (every route but /health needs one)
    assert [run["node"] for run in runs] == ["head", "head-again", "gpu-worker"], stdout
    assert {(run["uri"], run["user"], run["anonymous"]) for run in runs} == {
        (f"http://{HEAD_ADDRESS}:5000", "vitsweep-train", 401)}
    servers = [p for p in facts["processes"] if {"server", "--app-name"} <= set(p["cmdline"] or [])]
    assert len(servers) == 1, servers  # the second `ray up` found it answering
    assert "sqlite:////mnt/shared/mlflow/mlflow.db" in servers[0]["cmdline"]  # outlives `ray down`
    assert facts["store_mode"] == "0o700" and "basic_auth.db" in facts["store"]
    assert facts["login_cache_s"] == 60  # a verified login is not re-hashed at every request (MLflow's reader)
    argv = " ".join(word for p in facts["processes"] for word in p["cmdline"] or [])
    assert not [name for name, value in STAND_IN_SECRETS.items() if value in argv]  # no password in any argv


def test_both_launchers_start_their_nodes_alike_each_with_its_own_secret_store():
    aws, gcp = (yaml.safe_load((CLUSTER / name).read_text()) for name in LAUNCHERS)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert [command.replace(" aws ", " gcp ") for command in aws[key]] == gcp[key], key
