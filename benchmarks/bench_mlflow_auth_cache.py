"""The cluster's MLflow server (`mlflow server --app-name basic-auth`, as cluster/kuberay/mlflow.yaml and
cluster/bin/vitsweep-mlflow-server run it) with and without MLflow's credential cache
(``auth_cache_ttl_seconds`` in its basic_auth.ini): the server's CPU-seconds per authenticated request.

Without the cache, every request verifies the login's password hash (werkzeug's scrypt, by design slow);
every training run's epoch metrics, step health and each node's system metrics are such requests.
Both servers run side by side in this one process's run, one after the other, the same requests each:
a run created, then ``--requests`` log-batch calls of one metric, as a run logs a step.

    .venv/bin/python benchmarks/bench_mlflow_auth_cache.py --requests 60
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

TRAINER = "vitsweep-train"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def call(uri: str, user: str, password: str, method: str, path: str, body: dict) -> dict:
    login = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"{uri}{path}", data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json", "Authorization": f"Basic {login}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read() or b"{}")


def tree_cpu_seconds(root: psutil.Process) -> float:
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def settled_cpu_seconds(root: psutil.Process, quiet_s: float = 0.02, every_s: float = 0.5) -> float:
    """The tree's CPU-seconds once it has used less than ``quiet_s`` of them over ``every_s`` (at most 60 s)."""
    previous, deadline = tree_cpu_seconds(root), time.monotonic() + 60
    while True:
        time.sleep(every_s)
        current = tree_cpu_seconds(root)
        if current - previous < quiet_s or time.monotonic() > deadline:
            return current
        previous = current


def measure(directory: Path, cache_ttl_s: int, requests: int) -> dict:
    """Server CPU-seconds and wall seconds per authenticated log-batch request."""
    directory.mkdir()
    ini = ("[mlflow]\ndefault_permission = READ\n"
           f"database_uri = sqlite:///{directory / 'basic_auth.db'}\nadmin_username = admin\n"
           "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    if cache_ttl_s:
        ini += f"auth_cache_ttl_seconds = {cache_ttl_s}\n"
    (directory / "basic_auth.ini").write_text(ini)
    admin, trainer, port = secrets.token_hex(16), secrets.token_hex(16), free_port()
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(directory / "basic_auth.ini"),
           "MLFLOW_AUTH_ADMIN_PASSWORD": admin, "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen([str(mlflow), "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
                               "--artifacts-destination", str(directory / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the MLflow server did not start") from None
                time.sleep(1)
        call(uri, "admin", admin, "POST", "/api/2.0/mlflow/users/create", {"username": TRAINER, "password": trainer})
        experiment = call(uri, TRAINER, trainer, "POST", "/api/2.0/mlflow/experiments/create", {"name": "bench"})
        run = call(uri, TRAINER, trainer, "POST", "/api/2.0/mlflow/runs/create",
                   {"experiment_id": experiment["experiment_id"]})["run"]["info"]["run_id"]
        process = psutil.Process(server.pid)
        cpu_before = settled_cpu_seconds(process)  # start-up work done: the count holds the requests alone
        started = time.perf_counter()
        for step in range(requests):
            call(uri, TRAINER, trainer, "POST", "/api/2.0/mlflow/runs/log-batch", {
                "run_id": run, "metrics": [{"key": "loss", "value": 1.0 / (step + 1), "timestamp": 0, "step": step}]})
        wall, cpu = time.perf_counter() - started, tree_cpu_seconds(process) - cpu_before
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    return {"cache_ttl_s": cache_ttl_s, "requests": requests, "server_cpu_s_per_request": round(cpu / requests, 4),
            "wall_ms_per_request": round(1000 * wall / requests, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--ttl", type=int, default=60, help="the cached server's auth_cache_ttl_seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        without = measure(Path(root) / "no-cache", 0, args.requests)
        cached = measure(Path(root) / "cache", args.ttl, args.requests)
    ratio = without["server_cpu_s_per_request"] / max(cached["server_cpu_s_per_request"], 1e-9)
    print(json.dumps({"without_cache": without, "with_cache": cached,
                      "server_cpu_ratio": round(ratio, 1),
                      "wall_ratio": round(without["wall_ms_per_request"] / cached["wall_ms_per_request"], 1)}, indent=1))


if __name__ == "__main__":
    main()
