"""A first cluster launch, simulated on this machine: a head that takes no work (0 CPUs, as every
cluster file starts it), an MLflow server that requires a login (its basic-auth app, as
cluster/kuberay/mlflow.yaml runs it, with its settings), and the MLflow credentials only in each node's
environment (as the cluster files give them to every node's `ray start`, or pod).

The head offers the trial slots every cluster file gives it (cluster_nodes.ray_start_resources).
`vitsweep tune` starts while no worker node is up yet: it sizes its trials by what the cluster's
autoscaler says it can grow to and announces that they wait for nodes. Their trial functions start on
the head at once, but no worker does: with a short start timeout no node comes in time and the sweep
ends, saying why and how to resume; resumed, it waits again, and a worker node joins (as the
autoscaler would add one). Every trial's workers then run on that node, its function and Ray Train
controller on the head; each logs its run through the login, and each run holds its node's system
metrics; no password lands in any param or tag. Token authentication is on: a
driver with another token is refused. The sweep is a TPE search whose second sample is invalid (pruned
as its trial starts, recorded on the parent), trained under ZeRO-0 (plain data parallelism), whose
final weights score the runs' own metrics; its trials distil from a teacher given as a model source, which
the sweep saved once where the worker node reads it."""
import base64
import json
import os
import secrets
import threading
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_model

from conftest import VITSWEEP, RunningVitsweep, assert_scores_the_runs_metrics, mlflow_server, vitsweep_env
from pipeline.components.modeling import build_model
from pipeline.config.loading import load_config
from pipeline.data.staging import CACHE_DIR_ENV
from pipeline.sweeps.resources import START_TIMEOUT_ENV
from cluster_nodes import kuberay_mlflow_auth_config, ray_start_resources
from simulated_cluster import actor_nodes, driver_joins, run_cluster_process, stop_with_the_test
from test_cluster_multinode import assert_staged_once_from_source

WORKER_CPUS = 2  # two trials at once: each one 1-CPU worker (its trial function takes a head slot)
FIRST_START_TIMEOUT_S = 5  # the first attempt's: no node joins in that time
SWEEP_TIMEOUT_S = 900
TRAINER = "vitsweep-train"  # the MLflow user of the cluster files' Secrets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(SWEEP_TIMEOUT_S + 600)]


def report_autoscaler_maximum(gcs_address: str, node_resources: dict[str, float], max_nodes: int) -> None:
    """What an autoscaler reports to the GCS: its node group and how many of it the cluster may grow to."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add(name="worker", max_count=max_nodes)
    group.resources.update({name: int(amount) for name, amount in node_resources.items()})
    GcsClient(address=gcs_address).report_cluster_config(config.SerializeToString())


def _sweep_on_a_growing_cluster(plan: dict, results) -> None:
    """In the cluster's own process: a 0-CPU head, the sweep, then the worker node it waits for."""
    report: dict = {}
    try:
        from ray.cluster_utils import Cluster

        credentials, caches = plan["credentials"], plan["caches"]
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "resources": plan["head_resources"], "include_dashboard": False,
            "env_vars": {**credentials, CACHE_DIR_ENV: caches["head"]}})
        threading.Thread(target=stop_with_the_test, args=(cluster, os.getppid()), daemon=True).start()
        try:
            report_autoscaler_maximum(cluster.address, {"CPU": WORKER_CPUS}, max_nodes=1)
            # The driver runs on the head (as `ray job submit` runs it): the head's environment.
            head_env = {**vitsweep_env(), **credentials}
            first = RunningVitsweep([*plan["command"], "--address", cluster.address],
                                    env={**head_env, START_TIMEOUT_ENV: str(FIRST_START_TIMEOUT_S)})
            report["joins_with_wrong_token"] = driver_joins(cluster.address, secrets.token_hex(32))  # meanwhile
            report["first_returncode"], report["first_output"] = first.finish(timeout=300), first.output
            resumed = RunningVitsweep([VITSWEEP, "tune", "--resume", plan["sweep_dir"], "--address", cluster.address],
                                      env=head_env)
            try:
                resumed.wait_for_line("waiting for the cluster to grow", timeout=300)
                report["before_the_worker_joined"] = resumed.output
                worker = cluster.add_node(num_cpus=WORKER_CPUS,
                                          env_vars={**credentials, CACHE_DIR_ENV: caches["worker"]})
                report["nodes"] = {"head": cluster.head_node.node_id, "worker": worker.node_id}
                report["returncode"] = resumed.finish(timeout=SWEEP_TIMEOUT_S)
                report["actor_nodes"] = actor_nodes(cluster.address)
            finally:
                if resumed.process.poll() is None:
                    resumed.process.kill()
                report["output"] = resumed.output
        finally:
            cluster.shutdown()
    except BaseException:
        report["error"] = traceback.format_exc()
    results.put(report)


def _post_as(uri: str, user: str, password: str, path: str, body: dict) -> int:
    request = urllib.request.Request(f"{uri}{path}", data=json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json",
        "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status


@pytest.fixture(scope="module")
def login_mlflow(tmp_path_factory):
    """MLflow's basic-auth server on loopback, its settings those cluster/kuberay/mlflow.yaml's server writes
    (its users in SQLite here), with the training user the README's step 2 creates."""
    directory = tmp_path_factory.mktemp("mlflow-basic-auth")
    admin_password, trainer_password = secrets.token_hex(16), secrets.token_hex(16)
    (directory / "basic_auth.ini").write_text(kuberay_mlflow_auth_config(f"sqlite:///{directory / 'basic_auth.db'}"))
    env = {**vitsweep_env(), "MLFLOW_AUTH_CONFIG_PATH": str(directory / "basic_auth.ini"),
           "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password, "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
    with mlflow_server(directory / "server.log", "--app-name", "basic-auth",
                       "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
                       "--artifacts-destination", (directory / "artifacts").as_uri(), env=env) as uri:
        _post_as(uri, "admin", admin_password, "/api/2.0/mlflow/users/create",
                 {"username": TRAINER, "password": trainer_password})
        yield uri, trainer_password


@pytest.fixture(scope="module")
def growing_cluster_sweep(tmp_path_factory, login_mlflow, digits16, teacher_source):
    uri, password = login_mlflow
    storage = tmp_path_factory.mktemp("growing-cluster")
    space = storage / "heads.yaml"
    # 6 heads do not divide 128 channels: that one combination of four is invalid. TPE's seed 0 draws
    # (128, 4), (128, 6), (96, 4) (Optuna's TPESampler, random for its first samples).
    space.write_text("params:\n  model.args.embed_dim: {values: [96, 128]}\n  model.args.num_heads: {values: [4, 6]}\n")
    caches = {name: str(storage / f"node-{name}" / "nvme") for name in ("head", "worker")}
    command = [VITSWEEP, "tune", "--space", str(space), "--config", "smoke",
               *[word for override in (
                   f"run.storage_path={storage / 'shared'}", f"tracking.mlflow_uri={uri}", "tune.name=growing",
                   f"data.train=file://{digits16['train']}", f"data.val=file://{digits16['val']}", "data.prepare=null",
                   "optim.epochs=1", "tune.searcher=tpe", "tune.num_samples=3", "tune.seed=0", "tune.scheduler=fifo",
                   "deepspeed.zero_stage=0", "scaling.num_workers=1", "scaling.cpus_per_worker=1",
                   f"distill.teacher_from={teacher_source}")
                for word in ("--set", override)]]
    plan = {"command": command, "caches": caches, "sweep_dir": str(storage / "shared" / "growing"),
            "head_resources": ray_start_resources()["kuberay/raycluster.yaml"]["head"],
            "credentials": {"MLFLOW_TRACKING_USERNAME": TRAINER, "MLFLOW_TRACKING_PASSWORD": password}}
    with pytest.MonkeyPatch.context() as patch:
        report = run_cluster_process(patch, _sweep_on_a_growing_cluster, plan, SWEEP_TIMEOUT_S + 300)
    assert "error" not in report, report["error"]
    return report, caches, uri, password


@pytest.fixture
def trainer_client(login_mlflow, monkeypatch):
    """An MLflow client logged in as the training user (this test process has no credentials otherwise)."""
    uri, password = login_mlflow
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", TRAINER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    return MlflowClient(uri)


def test_the_mlflow_server_refuses_a_client_without_a_login(login_mlflow):
    uri, _ = login_mlflow
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
    assert refused.value.code == 401


def test_only_a_driver_holding_the_clusters_token_joins_it(growing_cluster_sweep):
    report, _, _, _ = growing_cluster_sweep
    assert report["joins_with_wrong_token"] is False
    assert "sweep growing:" in report["first_output"]  # the sweep's driver, with the cluster's token, joined


def test_a_sweep_whose_cluster_does_not_grow_in_time_ends_saying_why_and_how_to_resume(growing_cluster_sweep):
    report, _, _, _ = growing_cluster_sweep
    first = report["first_output"]
    assert "2 at a time" in first  # what the autoscaler can grow the cluster to, not the 0 CPUs it has
    assert f"The sweep stops if no trial's workers have started after {FIRST_START_TIMEOUT_S} s" in first
    assert report["first_returncode"] == 1, first[-5000:]
    assert (f"no trial's workers started within {FIRST_START_TIMEOUT_S} s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S): "
            "the cluster did not grow to fit one trial") in first
    assert "vitsweep tune --resume" in first and "Traceback" not in first


def test_a_resumed_sweep_waits_for_the_worker_node_then_finishes(growing_cluster_sweep):
    report, _, _, _ = growing_cluster_sweep
    waiting = report["before_the_worker_joined"]
    assert "2 at a time" in waiting and "waiting for the cluster to grow" in waiting
    assert report["returncode"] == 0, report["output"][-5000:]
    assert "sweep growing (finished)" in report["output"]


def test_every_trials_function_and_controller_ran_on_the_head_and_its_workers_on_the_worker_node(
        growing_cluster_sweep):
    report, _, _, _ = growing_cluster_sweep
    nodes = {}
    for name, node in report["actor_nodes"]:
        nodes.setdefault(name, set()).add(node)
    assert nodes["ImplicitFunc"] == nodes["TrainController"] == {report["nodes"]["head"]}
    assert nodes["RayTrainWorker"] == {report["nodes"]["worker"]}


def test_every_trial_trained_on_the_worker_node_and_is_logged_through_the_login(growing_cluster_sweep, trainer_client,
                                                                               digits16):
    _, caches, _, _ = growing_cluster_sweep
    assert_staged_once_from_source(Path(caches["worker"]), digits16)  # the trials' workers read it there
    assert not list(Path(caches["head"]).rglob("*.beton"))
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    runs = trainer_client.search_runs([experiment.experiment_id])
    trials = [run for run in runs if run.data.tags.get("vitsweep.role") == "trial"]
    (parent,) = [run for run in runs if run.data.tags.get("vitsweep.role") == "sweep"]
    assert len(trials) == 2 and parent.info.status == "FINISHED"
    for trial in trials:
        assert trial.info.status == "FINISHED" and trial.data.tags["stop_reason"] == "completed"
        assert [m.step for m in trainer_client.get_metric_history(trial.info.run_id, "val_top1")] == [1]
        assert "model.safetensors" in {a.path for a in trainer_client.list_artifacts(trial.info.run_id)}


def test_the_trials_distil_from_the_teacher_the_sweep_resolved_and_saved_once(growing_cluster_sweep, trainer_client,
                                                                             teacher_source):
    from safetensors.torch import load_file

    _, caches, _, _ = growing_cluster_sweep
    (saved,) = (Path(caches["head"]).parents[1] / "shared" / "growing" / "init_sources").glob("*.safetensors")
    given, kept = load_file(teacher_source), load_file(saved)  # what the worker node's trials read
    assert kept.keys() == given.keys() and all(torch.equal(kept[key], given[key]) for key in kept)
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    trials = trainer_client.search_runs([experiment.experiment_id], "tags.`vitsweep.role` = 'trial'")
    assert len(trials) == 2 and {trial.data.params["distill.teacher_from"] for trial in trials} == {str(teacher_source)}


def test_each_trials_run_holds_its_nodes_system_metrics(growing_cluster_sweep, trainer_client):
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    trials = trainer_client.search_runs([experiment.experiment_id], "tags.`vitsweep.role` = 'trial'")
    for trial in trials:  # 1-epoch trials: shorter than MLflow's 10 s sampling interval
        assert trainer_client.get_metric_history(trial.info.run_id, "system/node0/cpu_utilization_percentage")


def test_no_run_carries_the_password(growing_cluster_sweep, trainer_client):
    _, _, _, password = growing_cluster_sweep
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    for run in trainer_client.search_runs([experiment.experiment_id]):
        assert not [key for key, value in {**run.data.params, **run.data.tags}.items() if password in value]


INVALID = {"model.args.embed_dim": 128, "model.args.num_heads": 6}


def test_a_tpe_sweep_trains_only_valid_samples_and_records_the_pruned_ones(growing_cluster_sweep, trainer_client,
                                                                          tmp_path):
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    runs = trainer_client.search_runs([experiment.experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("vitsweep.role") == "sweep"]
    trials = [run for run in runs if run.data.tags.get("vitsweep.role") == "trial"]
    assert parent.data.params["tune.searcher"] == "tpe"
    pruned = json.loads(Path(trainer_client.download_artifacts(parent.info.run_id, "pruned.json", str(tmp_path)))
                        .read_text())
    assert [p["knobs"] for p in pruned] == [INVALID]  # seed 0's second sample
    assert "forward pass fails" in pruned[0]["reason"]
    assert sorted(tuple(json.loads(run.data.tags["knobs"]).values()) for run in trials) == [(96, 4), (128, 4)]


def test_zero0_trials_final_weights_score_their_val_top1(growing_cluster_sweep, trainer_client, tmp_path, digits16):
    experiment = trainer_client.get_experiment_by_name("vitsweep")
    for run in trainer_client.search_runs([experiment.experiment_id], "tags.`vitsweep.role` = 'trial'"):
        directory = tmp_path / run.info.run_id
        directory.mkdir()
        cfg = load_config(trainer_client.download_artifacts(run.info.run_id, "config.yaml", str(directory)))
        assert cfg.deepspeed.zero_stage == 0
        model = build_model(cfg.model, num_classes=10)
        load_model(model, trainer_client.download_artifacts(run.info.run_id, "model.safetensors", str(directory)))
        assert_scores_the_runs_metrics(model, cfg, digits16["val"], run.data.metrics)
