"""A multi-node cluster on this machine: Ray's own test cluster (`ray.cluster_utils.Cluster`), each
node with its own raylet, resources (1 CPU) and node-local disk, token authentication on.

As on a real cluster, a node's local disk is given to its processes by its environment
(`VITSWEEP_CACHE_DIR`, see cluster/), the dataset is a URI (`file://`) so every node stages it, and
`run.storage_path` is the filesystem all nodes share (here: this machine's)."""
import json
import os
import threading
import time
import traceback
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.data.sidecar import read_sidecar
from pipeline.data.staging import CACHE_DIR_ENV
from pipeline.training.runs import CHECKPOINT_SNAPSHOT
from simulated_cluster import run_cluster_process, stop_with_the_test

NODE_CPUS = 1  # one training worker per simulated node on this 2-core machine
TRAINING_TIMEOUT_S = 1200  # the cluster process gives up and reports before the test's own limits
CHILD_TIMEOUT_S = TRAINING_TIMEOUT_S + 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(CHILD_TIMEOUT_S + 300)]


def node_args(cache: Path) -> dict:
    return {"num_cpus": NODE_CPUS, "env_vars": {CACHE_DIR_ENV: str(cache)}}


def staged(cache: Path) -> dict[str, tuple[int, int]]:
    """The datasets staged in a node's cache: {file name: (inode, mtime in ns)}."""
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in cache.rglob("*.beton")}


def registered_checkpoints(run_dir: Path) -> list[str]:
    """The checkpoints Ray Train has registered (its snapshot lists them): a worker group restarted now
    resumes from the latest. A checkpoint's directory appears before its report is registered, and a
    group restarted in between starts from none."""
    try:
        snapshot = json.loads((run_dir / CHECKPOINT_SNAPSHOT).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or read mid-write
        return []
    return [result["checkpoint_dir_name"] for result in snapshot["checkpoint_results"]]


def _replace_node_after_first_checkpoint(cluster, node, run_dir: Path, plan: dict, report: dict,
                                         training: threading.Thread) -> None:
    deadline = time.monotonic() + 900
    while not registered_checkpoints(run_dir):
        if not training.is_alive():  # it failed (its error is in the report) or ended without a checkpoint
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint registered in {run_dir} after 900 s")
        time.sleep(0.5)
    report["head_cache_before_removal"] = staged(Path(plan["caches"]["head"]))
    report["checkpoints_at_removal"] = registered_checkpoints(run_dir)
    cluster.remove_node(node)  # its raylet, object store and training worker die with it
    report["removed_node"] = node.node_id
    report["replacement_node"] = cluster.add_node(**node_args(Path(plan["caches"]["replacement"]))).node_id


def _train(cfg, address: str, report: dict) -> None:
    from pipeline.training.driver import train

    try:
        outcome = train(cfg, address=address)
        report["outcome"] = {"tracking_uri": outcome.tracking_uri, "run_id": outcome.mlflow_run_id}
    except BaseException:
        report["training_error"] = traceback.format_exc()


def _on_two_nodes(plan: dict, results) -> None:
    """In a fresh process, where Ray reads the token mode once: two nodes, then the plan, then a report."""
    report: dict = {}
    try:
        import ray
        from ray.cluster_utils import Cluster

        from pipeline.config.loading import load_config

        caches = {name: Path(path) for name, path in plan["caches"].items()}
        cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **node_args(caches["head"])})
        threading.Thread(target=stop_with_the_test, args=(cluster, os.getppid()), daemon=True).start()
        try:
            worker = cluster.add_node(**node_args(caches["worker"]))
            cluster.wait_for_nodes()
            report["nodes"] = [cluster.head_node.node_id, worker.node_id]
            if plan.get("overrides"):
                # The driver trains in a thread: Ray starts nodes (add_node) from the main thread only.
                cfg = load_config("smoke", plan["overrides"])
                training = threading.Thread(target=_train, args=(cfg, cluster.address, report), daemon=True)
                training.start()
                if plan.get("replace_worker"):
                    _replace_node_after_first_checkpoint(cluster, worker, Path(cfg.run.storage_path) / cfg.run.name,
                                                         plan, report, training)
                training.join(timeout=TRAINING_TIMEOUT_S)
                if training.is_alive():
                    report["training_error"] = f"training still running after {TRAINING_TIMEOUT_S} s"
        finally:
            ray.shutdown()
            cluster.shutdown()
    except BaseException:
        report["error"] = traceback.format_exc()
    results.put(report)


def on_two_nodes(monkeypatch, plan: dict) -> dict:
    """Runs `_on_two_nodes` with Ray's token authentication on and returns its report."""
    report = run_cluster_process(monkeypatch, _on_two_nodes, plan, CHILD_TIMEOUT_S)
    problems = [report[key] for key in ("error", "training_error") if key in report]
    assert not problems, "\n".join(problems)
    return report


def caches(tmp_path: Path) -> dict[str, str]:
    return {name: str(tmp_path / f"node-{name}" / "nvme") for name in ("head", "worker", "replacement")}


def training_overrides(storage: Path, digits16, *more: str) -> list[str]:
    return [f"run.storage_path={storage}", f"data.train=file://{digits16['train']}",
            f"data.val=file://{digits16['val']}", "data.prepare=null",
            "scaling.num_workers=2", "scaling.placement_strategy=SPREAD", *more]


def only_mlflow_run(storage: Path):
    client = MlflowClient(f"sqlite:///{storage}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("vitsweep").experiment_id])
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return client, runs[0]


def assert_staged_once_from_source(cache: Path, digits16) -> None:
    copies = sorted(cache.rglob("*.beton"))
    assert sorted(path.name for path in copies) == sorted(Path(digits16[s]).name for s in ("train", "val")), copies
    for copy in copies:
        source = next(Path(digits16[s]) for s in ("train", "val") if Path(digits16[s]).name == copy.name)
        assert read_sidecar(copy) == read_sidecar(source)  # same bytes: the sidecar records their SHA-256


@pytest.fixture(scope="module")
def node_lost_run(tmp_path_factory, digits16):
    """A 3-epoch run spread over two nodes; once its first checkpoint is registered the worker node is removed and
    another joins. Both tests below read it: one run where there were two (~1–2 min each on 2 cores)."""
    root = tmp_path_factory.mktemp("two-nodes")
    storage, node_caches = root / "shared", caches(root)
    with pytest.MonkeyPatch.context() as monkeypatch:
        report = on_two_nodes(monkeypatch, {
            "caches": node_caches, "replace_worker": True,
            "overrides": training_overrides(storage, digits16, "run.name=node-lost", "optim.epochs=3",
                                            "run.checkpoint_every=1", "run.max_failures=2"),
        })
    return storage, {name: Path(path) for name, path in node_caches.items()}, report


def test_training_spreads_over_both_nodes_each_staging_the_dataset_once_into_its_own_cache(node_lost_run, digits16):
    storage, node_caches, _ = node_lost_run

    # Each node's one worker staged into that node's own disk, and only there.
    assert_staged_once_from_source(node_caches["head"], digits16)
    assert_staged_once_from_source(node_caches["worker"], digits16)
    assert not (storage / "data-cache").exists()

    client, run = only_mlflow_run(storage)
    assert run.data.tags["world_size"] == "2"
    # The node's system metrics (Ray Train numbers nodes by IP: both simulated nodes are this one machine, node0).
    assert "system/node0/cpu_utilization_percentage" in run.data.metrics


def test_losing_a_node_mid_run_restarts_the_group_on_a_new_node_and_the_mlflow_run_continues(node_lost_run, digits16):
    storage, node_caches, report = node_lost_run
    assert report["removed_node"] == report["nodes"][1] and report["replacement_node"] not in report["nodes"]
    assert report["checkpoints_at_removal"]

    # The group restarted with a worker on the new node, which staged the dataset into its own disk;
    # the head's worker restarted too and found its node's copy in place (not copied again).
    assert_staged_once_from_source(node_caches["replacement"], digits16)
    assert staged(node_caches["head"]) == report["head_cache_before_removal"]

    client, run = only_mlflow_run(storage)
    assert run.info.status == "FINISHED"
    epochs = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_top1"))
    assert epochs == [1, 2, 3]  # each epoch trained (and logged) once: none repeated after the restart
    # The new group went on from the checkpoint there at the removal (epoch 1 or later), not from the start.
    (resumed,) = client.get_metric_history(run.info.run_id, "resumed_at_epoch")
    assert resumed.step == resumed.value >= 2
