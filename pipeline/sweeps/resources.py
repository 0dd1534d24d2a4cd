"""How many trials of a sweep run at once, where their trial functions run, and how long a sweep waits
for a cluster to grow.

A trial is its trial function (waiting on ``fit()``) plus its ``scaling.num_workers`` workers
(``cpus_per_worker``, ``gpus_per_worker``), which its ``TorchTrainer`` requests from Ray itself,
outside Tune's accounting. Ray Train starts the trial's controller on the trial function's node.

- On a cluster whose head advertises trial slots (``TRIAL_SLOT``: every cluster file in cluster/),
  each trial function takes one and runs on the head, its controller with it: the head lives as long
  as the cluster, so a GPU node lost mid-run costs the trial a restart of its worker group from the
  latest checkpoint (``run.max_failures``), not the trial. The head's slots cap the trials at once.
- Elsewhere (a local Ray, a cluster of your own) the function holds ``tune.trial_cpus`` next to
  the workers, and Tune is capped at the trials whose function *and* workers fit; more would start
  trial functions that hold CPUs while their workers wait.

- A local Ray holds what it has: a trial that does not fit is bad input. One started by
  ``vitsweep tune`` advertises at least one trial's CPUs (``local_ray_cpus``), so e.g. 1 trial
  function + 2 workers still run on a 2-core machine.
- A cluster may grow (its autoscaler adds nodes for pending trials): it is sized by
  ``tune.max_concurrent_trials``, else by what its autoscaler can grow it to where Ray reports that
  (the cluster config an autoscaler reports to the GCS, which Ray Train and Ray Data read too), else
  by what it has now, at least one trial. Trials that do not fit yet wait for nodes: announced, and
  bounded by ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` as ``vitsweep train``'s wait is
  (``ClusterGrowthDeadline`` ends a sweep none of whose trials' workers started, resumable).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from ray.tune import Callback

from pipeline.config.schema import ExperimentConfig
from pipeline.console import active_console, counted
from pipeline.errors import InvalidInputError, RunFailed

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
TRIAL_SLOT = "vitsweep_trial_slot"  # the custom resource a cluster's head advertises for trial functions


@dataclass(frozen=True)
class TrialResources:
    cpus: float  # on the nodes that train: the workers', and the trial function's unless it takes a head slot
    gpus: float
    on_head: bool = False  # the trial function takes one of the head's trial slots

    @classmethod
    def of(cls, cfg: ExperimentConfig, cluster: dict[str, float] | None = None) -> TrialResources:
        """One trial of ``cfg`` on a Ray that has ``cluster`` (None: one without trial slots)."""
        on_head = (cluster or {}).get(TRIAL_SLOT, 0) >= 1
        workers = cfg.scaling.num_workers
        return cls(cpus=(0.0 if on_head else cfg.tune.trial_cpus) + workers * cfg.scaling.cpus_per_worker,
                   gpus=workers * cfg.scaling.gpus_per_worker if cfg.scaling.use_gpu else 0.0, on_head=on_head)

    def function_request(self, cfg: ExperimentConfig) -> dict[str, float]:
        """What Tune reserves for the trial function (``tune.with_resources``)."""
        return {"cpu": 0, TRIAL_SLOT: 1} if self.on_head else {"cpu": cfg.tune.trial_cpus}

    def describe(self, cfg: ExperimentConfig) -> str:
        s = cfg.scaling
        gpus = f", {counted(self.gpus, 'GPU')}" if self.gpus else ""
        function = "trial function on the head" if self.on_head else f"trial function {cfg.tune.trial_cpus:g} CPU"
        return (f"{counted(self.cpus, 'CPU')}{gpus} = {function} + "
                f"{counted(s.num_workers, 'worker')} x "
                f"({s.cpus_per_worker:g} CPU{f', {s.gpus_per_worker:g} GPU' if s.use_gpu else ''})")

    def fitting(self, resources: dict[str, float]) -> int:
        """How many such trials the CPUs and GPUs of ``resources`` hold at once."""
        fits = math.floor(resources.get("CPU", 0) / self.cpus + 1e-9)
        if self.gpus:
            fits = min(fits, math.floor(resources.get("GPU", 0) / self.gpus + 1e-9))
        return fits


def _has(resources: dict[str, float]) -> str:
    return f"{resources.get('CPU', 0):g} CPUs and {resources.get('GPU', 0):g} GPUs"


def local_trials_fitting(cfg: ExperimentConfig, local: dict[str, float]) -> int:
    """How many trials a local Ray with the ``local`` resources holds at once; InvalidInputError if not one
    (checked before the local Ray starts too, on what it will advertise: ``local_ray_resources``)."""
    need = TrialResources.of(cfg, local)
    fits = need.fitting(local)
    if fits < 1:
        raise InvalidInputError(
            f"one trial needs {need.describe(cfg)}, but this machine's local Ray has {_has(local)}; lower "
            "scaling.num_workers / cpus_per_worker or tune.trial_cpus, or join a cluster with --address")
    return fits


def concurrent_trials(cfg: ExperimentConfig, cluster: dict[str, float], local: bool,
                      ceiling: dict[str, float] | None = None) -> int:
    """How many trials run at once on a Ray that has ``cluster`` now: a ``local`` Ray, or a cluster whose
    autoscaler can grow it to ``ceiling`` (None where Ray does not report it)."""
    need = TrialResources.of(cfg, cluster)
    wanted = cfg.tune.max_concurrent_trials
    if local:
        fits = local_trials_fitting(cfg, cluster)
        if wanted and wanted > fits:
            active_console().line(f"vitsweep tune: tune.max_concurrent_trials={wanted}, but this machine's local Ray "
                                  f"fits {fits} trial(s) of {need.describe(cfg)}: {fits} at a time")
        return min(wanted or fits, fits)
    if ceiling is not None:
        most = need.fitting(ceiling)
        if most < 1:
            raise InvalidInputError(
                f"one trial needs {need.describe(cfg)}, but the cluster's autoscaler can grow it to at most "
                f"{_has(ceiling)}; lower scaling.num_workers / cpus_per_worker or tune.trial_cpus")
        trials = min(wanted or most, most)
    else:
        trials = wanted or max(need.fitting(cluster), 1)
    # the head is up from the start and never grows: its slots are all the trial functions there will be
    return min(trials, int(cluster[TRIAL_SLOT])) if need.on_head else trials


def local_ray_cpus(cfg: ExperimentConfig) -> int:
    """A local Ray advertises at least one trial's CPUs, so a trial function + its workers run even on 2 cores."""
    return max(os.cpu_count() or 1, math.ceil(TrialResources.of(cfg).cpus))


def autoscaler_ceiling() -> dict[str, float] | None:
    """What the connected cluster's autoscaler can grow it to, where an autoscaler reported its config
    to Ray (Ray 2.60's own launcher and KubeRay autoscalers do not); None otherwise."""
    from ray._private.state import state  # where Ray Train's and Ray Data's own feasibility checks read it

    return state.get_max_resources_from_cluster_config()


def start_timeout_s() -> float:
    return float(os.environ.get(START_TIMEOUT_ENV, "60"))


def growth_notice(cfg: ExperimentConfig, cluster: dict[str, float], trials: int, ceiling_known: bool) -> str | None:
    """The console's line when trials will wait for the cluster to grow, else None."""
    need = TrialResources.of(cfg, cluster)
    fits = need.fitting(cluster)
    hint = ("" if ceiling_known or cfg.tune.max_concurrent_trials else
            "; Ray reports no autoscaler maximum here: set tune.max_concurrent_trials to run more trials at once "
            "as the cluster grows")
    if fits >= trials:
        return f"vitsweep tune: {trials} trial(s) at a time, as the cluster has now{hint}" if hint else None
    timeout = start_timeout_s()
    return (f"waiting for the cluster to grow: {trials} trial(s) at a time of {need.describe(cfg)}, and the "
            f"cluster has {_has(cluster)} now. The sweep stops if no trial's workers have started after {timeout:g} s "
            f"({START_TIMEOUT_ENV}){hint}")


class ClusterDidNotGrow(RunFailed):
    """No trial's workers of the sweep started in time: the cluster never grew to fit one trial."""


def train_workers_alive() -> bool:
    """Whether a Ray Train worker of this driver's job is alive: some trial's worker group got its nodes.
    Read from the GCS's actor table (Ray's state API would need the dashboard, which a head may not run)."""
    import ray
    from ray._private.state import actors

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return any(actor["ActorClassName"] == "RayTrainWorker" for actor in actors(job_id=job, actor_state_name="ALIVE").values())


class ClusterGrowthDeadline(Callback):
    """Ends the sweep when no trial's workers have started ``timeout_s`` after Tune's first step. A trial
    function may start long before (on the head's slots at once), and Tune and Ray Train would wait on,
    or retry, a worker group the cluster never grows to fit. Tune has saved the waiting trials, so
    ``--resume`` runs them. A trial's own wait for its workers begins after its function started, so
    this deadline, counted from the first step, comes first."""

    POLL_S = 1.0  # the actor table is read at most this often, and never again once workers started

    def __init__(self, timeout_s: float, trial: str, workers_started=train_workers_alive):
        """``trial``: what one trial needs, for the message; ``workers_started``: asks Ray."""
        self.timeout_s, self.trial, self.workers_started = timeout_s, trial, workers_started
        self.started = False
        self.since: float | None = None  # this process's clock: not saved with Tune's experiment state
        self.checked = -math.inf

    def __getstate__(self) -> dict:
        return {"trial": self.trial}

    def __setstate__(self, state: dict) -> None:  # a resumed sweep waits as long as its own environment says
        self.__init__(start_timeout_s(), state["trial"])

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        if self.started:
            return
        now = time.monotonic()
        self.since = self.since or now
        if now - self.checked >= self.POLL_S:
            self.checked = now
            self.started = self.workers_started()
        if not self.started and now - self.since > self.timeout_s:
            raise ClusterDidNotGrow(f"no trial's workers started within {self.timeout_s:g} s ({START_TIMEOUT_ENV}): "
                                    f"the cluster did not grow to fit one trial ({self.trial})")
