"""A Ray head's job API as a job's submitter meets it, on loopback, for a submitter built from its manifest.

Ray 2.60's dashboard (``ray/dashboard/http_server_head.py``, ``modules/job/job_head.py``) answers
``/api/gcs_healthz`` to anyone and every other route only with the cluster's token
(``Authorization: Bearer TOKEN``, else 401). ``ray job status`` of an unknown id gets 404; ``ray job
submit`` POSTs the entrypoint and runtime environment to ``/api/jobs/``; ``ray job logs --follow`` reads
the driver's output from a websocket, then the job's status. The job supervisor runs an entrypoint as
``/bin/sh -c ENTRYPOINT`` (``modules/job/job_supervisor.py``: ``Popen(entrypoint, shell=True)``) with the
runtime environment's ``env_vars``: here ``run(entrypoint, env_vars)`` starts it (on a head built from its
manifest), and its output and exit code are what the submitter reads."""
from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from aiohttp import web

from conftest import free_port

PUBLIC = ("/api/gcs_healthz",)  # of Ray's public paths, the one a submitter asks without its token


@dataclass
class Submitted:
    """One job as the head received it, and what its driver did."""

    request: dict
    process: subprocess.Popen
    output: str = ""
    returncode: int | None = None

    def details(self) -> dict:
        finished = self.returncode is not None
        return {"type": "SUBMISSION", "job_id": self.request["submission_id"],
                "submission_id": self.request["submission_id"], "entrypoint": self.request["entrypoint"],
                "status": ("SUCCEEDED" if self.returncode == 0 else "FAILED") if finished else "RUNNING",
                "message": f"Job entrypoint command failed with exit code {self.returncode}" if self.returncode else None,
                "driver_exit_code": self.returncode}


@dataclass
class JobApi:
    token: str
    run: Callable[[str, dict[str, str]], subprocess.Popen]
    jobs: dict[str, Submitted] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # the paths asked without the token

    def __enter__(self) -> JobApi:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(30):  # else a submitter would wait for its health until its own timeout
            raise RuntimeError(f"the job API stand-in did not start on port {self.port}")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        for job in self.jobs.values():
            if job.process.poll() is None:
                job.process.kill()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._token_required])
        app.add_routes([web.get("/api/gcs_healthz", self._healthz), web.get("/api/version", self._version),
                        web.post("/api/jobs/", self._submit), web.get("/api/jobs/{id}", self._details),
                        web.get("/api/jobs/{id}/logs/tail", self._tail)])
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    @web.middleware
    async def _token_required(self, request: web.Request, handler):
        if request.path in PUBLIC or request.headers.get("Authorization") == f"Bearer {self.token}":
            return await handler(request)
        self.refused.append(request.path)
        return web.Response(status=401, text="Unauthorized: Missing authentication token")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="success")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "4", "ray_version": ray.__version__, "ray_commit": ray.__commit__,
                                  "session_name": "job-api-stand-in"})

    async def _submit(self, request: web.Request) -> web.Response:
        body = await request.json()
        env = {k: str(v) for k, v in (body.get("runtime_env") or {}).get("env_vars", {}).items()}
        self.jobs[body["submission_id"]] = Submitted(body, self.run(body["entrypoint"], env))
        return web.json_response({"job_id": body["submission_id"], "submission_id": body["submission_id"]})

    async def _details(self, request: web.Request) -> web.Response:
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            return web.Response(status=404, text=f"Job {request.match_info['id']} does not exist")
        return web.json_response(job.details())

    async def _tail(self, request: web.Request) -> web.WebSocketResponse:
        job = self.jobs[request.match_info["id"]]
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        stdout, stderr = await asyncio.get_running_loop().run_in_executor(None, job.process.communicate)
        job.output, job.returncode = stdout + stderr, job.process.returncode
        await socket.send_str(job.output)
        await socket.close()
        return socket
