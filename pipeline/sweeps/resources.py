"""How many trials of a sweep run at once, and how long a sweep waits for a cluster to grow.

A trial is its trial function (``tune.trial_cpus``, waiting on ``fit()``) plus its
``scaling.num_workers`` workers (``cpus_per_worker``, ``gpus_per_worker``), which its
``TorchTrainer`` requests from Ray itself, outside Tune's accounting. So Tune is capped at the
trials whose function *and* workers fit; more would start trial functions that hold CPUs while their
workers wait.

- A local Ray holds what it has: a trial that does not fit is bad input. One started by
  ``vitsweep tune`` advertises at least one trial's CPUs (``local_ray_cpus``), so e.g. 1 trial
  function + 2 workers still run on a 2-core machine.
- A cluster may grow (its autoscaler adds nodes for pending trials): it is sized by
  ``tune.max_concurrent_trials``, else by what its autoscaler can grow it to where Ray reports that
  (the cluster config an autoscaler reports to the GCS, which Ray Train and Ray Data read too), else
  by what it has now, at least one trial. Trials that do not fit yet wait for nodes: announced, and
  bounded by ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` as ``vitsweep train``'s wait is
  (``ClusterGrowthDeadline`` ends a sweep none of whose trials started, resumable; a trial whose
  workers do not start in that time fails in Ray Train).
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


@dataclass(frozen=True)
class TrialResources:
    cpus: float  # trial function + workers
    gpus: float

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> TrialResources:
        workers = cfg.scaling.num_workers
        return cls(cpus=cfg.tune.trial_cpus + workers * cfg.scaling.cpus_per_worker,
                   gpus=workers * cfg.scaling.gpus_per_worker if cfg.scaling.use_gpu else 0.0)

    def describe(self, cfg: ExperimentConfig) -> str:
        s = cfg.scaling
        gpus = f", {counted(self.gpus, 'GPU')}" if self.gpus else ""
        return (f"{counted(self.cpus, 'CPU')}{gpus} = trial function {cfg.tune.trial_cpus:g} CPU + "
                f"{counted(s.num_workers, 'worker')} x "
                f"({s.cpus_per_worker:g} CPU{f', {s.gpus_per_worker:g} GPU' if s.use_gpu else ''})")

    def fitting(self, resources: dict[str, float]) -> int:
        """How many such trials ``resources`` hold at once."""
        fits = math.floor(resources.get("CPU", 0) / self.cpus + 1e-9)
        if self.gpus:
            fits = min(fits, math.floor(resources.get("GPU", 0) / self.gpus + 1e-9))
        return fits


def _has(resources: dict[str, float]) -> str:
    return f"{resources.get('CPU', 0):g} CPUs and {resources.get('GPU', 0):g} GPUs"


def concurrent_trials(cfg: ExperimentConfig, cluster: dict[str, float], local: bool,
                      ceiling: dict[str, float] | None = None) -> int:
    """How many trials run at once on a Ray that has ``cluster`` now: a ``local`` Ray, or a cluster whose
    autoscaler can grow it to ``ceiling`` (None where Ray does not report it)."""
    need = TrialResources.of(cfg)
    wanted = cfg.tune.max_concurrent_trials
    if local:
        fits = need.fitting(cluster)
        if fits < 1:
            raise InvalidInputError(
                f"one trial needs {need.describe(cfg)}, but this machine's local Ray has {_has(cluster)}; lower "
                "scaling.num_workers / cpus_per_worker or tune.trial_cpus, or join a cluster with --address")
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
        return min(wanted or most, most)
    return wanted or max(need.fitting(cluster), 1)


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
    need = TrialResources.of(cfg)
    fits = need.fitting(cluster)
    hint = ("" if ceiling_known or cfg.tune.max_concurrent_trials else
            "; Ray reports no autoscaler maximum here: set tune.max_concurrent_trials to run more trials at once "
            "as the cluster grows")
    if fits >= trials:
        return f"vitsweep tune: {trials} trial(s) at a time, as the cluster has now{hint}" if hint else None
    timeout = start_timeout_s()
    return (f"waiting for the cluster to grow: {trials} trial(s) at a time of {need.describe(cfg)}, and the "
            f"cluster has {_has(cluster)} now. The sweep stops if no trial has started after {timeout:g} s, and a "
            f"trial whose workers do not start within {timeout:g} s fails ({START_TIMEOUT_ENV}){hint}")


class ClusterDidNotGrow(RunFailed):
    """No trial of the sweep started in time: the cluster never grew to fit one."""


class ClusterGrowthDeadline(Callback):
    """Ends the sweep when no trial has started ``timeout_s`` after Tune's first step: Tune itself would
    wait forever for a cluster that never grows to fit one trial function (Ray Train bounds the wait
    for a started trial's workers). Tune has saved the waiting trials, so ``--resume`` runs them."""

    def __init__(self, timeout_s: float, trial: str):
        """``trial``: what one trial needs, for the message."""
        self.timeout_s, self.trial = timeout_s, trial
        self.started = False
        self.since: float | None = None  # this process's clock: not saved with Tune's experiment state

    def __getstate__(self) -> dict:
        return {"trial": self.trial}

    def __setstate__(self, state: dict) -> None:  # a resumed sweep waits as long as its own environment says
        self.__init__(start_timeout_s(), state["trial"])

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        self.started = True

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        if self.started:
            return
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since > self.timeout_s:
            raise ClusterDidNotGrow(f"no trial started within {self.timeout_s:g} s ({START_TIMEOUT_ENV}): the cluster "
                                    f"did not grow to fit one trial ({self.trial})")
