"""A Ray cluster of several nodes on this machine, owned by a fresh process: Ray's own test cluster
(`ray.cluster_utils.Cluster`), each node with its own raylet, resources and environment, token
authentication on. The process runs a test's plan against it and hands back a report."""
import json
import multiprocessing
import os
import queue
import secrets
import subprocess
import sys
import time

STOP_GRACE_S = 120


def stop_with_the_test(cluster, test_pid: int) -> None:
    """Never leave a cluster behind: if the test process dies, stop every node and exit."""
    while os.getppid() == test_pid:
        time.sleep(2)
    try:
        cluster.shutdown()
    finally:
        os._exit(1)


def driver_joins(address: str, token: str) -> bool:
    """Whether a driver holding `token` can join the cluster (a fresh process: the token is read at start)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    probe = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); print(len(ray.nodes()))"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    return result.returncode == 0


def actor_nodes(address: str) -> list[tuple[str, str]]:
    """(class name, node id) of every actor the cluster has held, alive or ended (the GCS keeps the ended
    ones' records), read by a driver holding this process's token."""
    probe = ("import json, ray; from ray._private.state import actors; "
             f"ray.init(address={address!r}, logging_level='ERROR'); "
             "print(json.dumps([[a['ActorClassName'], a['Address']['NodeID']] for a in actors().values()]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(pair) for pair in json.loads(result.stdout.strip().splitlines()[-1])]


def run_cluster_process(monkeypatch, target, plan: dict, timeout_s: float) -> dict:
    """``target(plan, results)`` in a fresh process, where Ray reads the token mode once, with token
    authentication on (a fresh random token); returns the report it put on ``results``."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=target, args=(plan, results))
    child.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                report = results.get(timeout=5)
                break
            except queue.Empty:
                if not child.is_alive():
                    raise AssertionError(f"the cluster process died with exit code {child.exitcode} and no report")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no report from the cluster process after {timeout_s:.0f} s")
        child.join(timeout=STOP_GRACE_S)
    finally:
        if child.is_alive():  # SIGTERM: Ray's handler stops the nodes before the process exits
            child.terminate()
            child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return report
