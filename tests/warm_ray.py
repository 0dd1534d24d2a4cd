"""A warm local Ray: `ray start --head` once, set up as README "`ray job submit`" and "A warm local Ray" have
a user set it up (a token generated once, the venv's `vitsweep` on the cluster's PATH), for jobs submitted to
it and commands that join it (`--address auto`). Its own token, ports and Ray temp dir: a user's cluster and
~/.ray stay untouched, and `auto` finds this cluster only. Stopped through its own processes: `ray stop`
would stop every Ray on the machine."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
README_SECTION = "### A warm local Ray"  # its `ray start --head` starts this cluster; its `export`s join it
RAYLET = str(Path(importlib.util.find_spec("ray").origin).parent / "core" / "src" / "ray" / "raylet" / "raylet")
# What the raylet keeps running with nothing scheduled: its two agents, workers it started ahead and has not
# leased, and the actor Ray Train's first run creates for good (Ray Data's AutoscalingCoordinator: detached,
# num_cpus=0). Any other worker is a task's or an actor's, holding the CPUs it asked for.
IDLE_RAYLET_CHILDREN = {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE", "ray::_AutoscalingCoordinatorActor"}


@dataclass
class WarmRay:
    ray_dir: str  # RAY_TMPDIR: the cluster's files are under it, and `--address auto` looks there
    gcs_port: int
    dashboard: str  # http://127.0.0.1:PORT: the Jobs API
    shell: dict[str, str]  # the environment `ray start` ran in: a user's shell after the README's setup
    started: str  # `ray start`'s output

    @property
    def finding(self) -> dict[str, str]:
        """What a command's environment needs for `--address auto` to find this cluster, as a user's shell
        finds theirs: the Ray temp dir `auto` reads the address from, and the token."""
        return {"RAY_TMPDIR": self.ray_dir, "RAY_AUTH_TOKEN_PATH": self.shell["RAY_AUTH_TOKEN_PATH"]}

    @property
    def joining(self) -> dict[str, str]:
        """A command's environment additions in a shell that then ran README "A warm local Ray"'s `export`
        lines (RAY_ADDRESS=auto): its commands join this cluster without --address."""
        from conftest import readme_block  # here: conftest imports this module

        exports = [line.split("#")[0].removeprefix("export ").strip() for line in readme_block(README_SECTION)
                   if line.startswith("export ")]
        return {**self.finding, **dict(export.split("=", 1) for export in exports)}

    def processes(self) -> list[psutil.Process]:
        """The cluster's processes: those naming its temp dir or GCS port, and everything they started."""
        own = re.compile(rf"{re.escape(self.ray_dir)}|--address=\S+:{self.gcs_port}\b")  # the client server names only the GCS
        roots = [p for p in psutil.process_iter(["cmdline"])
                 if own.search(" ".join(p.info["cmdline"] or [])) and p.pid != os.getpid()]
        return list({p.pid: p for root in roots for p in [root, *_children(root)]}.values())

    def busy_workers(self) -> list[str]:
        """Ray worker processes of this cluster holding resources (a task's or an actor's), by process title."""
        titles = []
        for raylet in [p for p in self.processes() if _command(p).startswith(RAYLET)]:
            for child in _children(raylet):
                with contextlib.suppress(psutil.NoSuchProcess):
                    title = " ".join(child.cmdline()).strip()
                    if title.split(" ")[0] not in IDLE_RAYLET_CHILDREN:
                        titles.append(title)
        return titles

    def wait_until_idle(self, timeout: float = 120) -> None:
        """Until every CPU of the cluster is free again: the last command's workers and actors gone, so the
        next one gets the whole machine. Read from the processes, not from Ray's resource report, which the
        autoscaler refreshes every 5 s: on one node a CPU is held only by a worker the raylet leased."""
        deadline = time.monotonic() + timeout
        while busy := self.busy_workers():
            if time.monotonic() > deadline:
                raise AssertionError(f"the warm Ray's CPUs are still held after {timeout:.0f} s by: {busy}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the cluster's own processes (SIGTERM, then SIGKILL for those that outlast it) and remove its files."""
        processes = self.processes()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=3)  # some of Ray's processes outlast a SIGTERM for good
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=30)
        shutil.rmtree(self.ray_dir, ignore_errors=True)


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def start_warm_ray(home: Path) -> WarmRay:
    """The README's lines run as written, their ports aside: README "`ray job submit`"'s token line under
    ``home`` as HOME, then README "A warm local Ray"'s `ray start --head` with ports of its own (other
    clusters on this machine may hold the defaults, 6379 and 8265 on) and token auth on, as `ray start`
    turns it on where a token exists (RAY_AUTH_MODE unset)."""
    from conftest import free_port, readme_block, vitsweep_env  # here: conftest imports this module

    (generate_token,) = [line for line in readme_block("### `ray job submit`") if line.startswith("ray get-auth-token")]
    (start_head,) = [line for line in readme_block(README_SECTION) if line.startswith("ray start --head")]
    env = {**vitsweep_env(), "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    token = subprocess.run(["bash", "-c", generate_token], capture_output=True, text=True,
                           env={**env, "HOME": str(home)}, timeout=120)
    assert token.returncode == 0, token.stderr
    env["RAY_AUTH_TOKEN_PATH"] = str(home / ".ray" / "auth_token")
    # Ray's socket paths must stay under 107 bytes: a short directory of /tmp's.
    env["RAY_TMPDIR"] = ray_dir = tempfile.mkdtemp(prefix="vsray-", dir="/tmp")
    gcs, dashboard, agent, client = (free_port() for _ in range(4))
    warm = WarmRay(ray_dir, gcs, f"http://127.0.0.1:{dashboard}", env, started="")
    own_ports = (f" --node-ip-address=127.0.0.1 --port={gcs} --dashboard-host=127.0.0.1 --dashboard-port={dashboard}"
                 f" --dashboard-agent-listen-port={agent} --ray-client-server-port={client} --disable-usage-stats")
    try:
        start = subprocess.run(["bash", "-c", re.sub(r"\s+#.*$", "", start_head) + own_ports],
                               capture_output=True, text=True, env=env, timeout=180)
        assert start.returncode == 0, start.stdout + start.stderr
    except BaseException:
        warm.stop()
        raise
    warm.started = start.stdout + start.stderr
    return warm
