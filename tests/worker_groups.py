"""How `make test` shares the suite between its two pytest-xdist workers (``-n 2``).

A group is what one worker runs whole: a test module, or the modules that read one of the session's
end-to-end scenarios (``SHARED_SCENARIOS``), which a second worker would run again. Groups holding
end-to-end tests go first, the most of those first, so that each worker starts on a long one and the
unit-test modules fill in at the end. On 2 cores the two workers overlap one end-to-end run's idle
moments (single-threaded start-up, Ray's waits) with another's work (benchmarks/RESULTS.md, "Two test
workers"). xdist's own ``--dist loadgroup`` cannot do this with pytest 9 (it renames a test through an
attribute pytest 9 no longer reads), so the groups are xdist scopes (``ScenarioGroupScheduling``)."""
from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath

import pytest
from xdist.scheduler import LoadScopeScheduling

# Session-scoped fixtures that run commands (a run several tests read, the warm Ray), and the test
# modules that use each, directly or through another fixture: they share a worker. Checked at every collection (``order_by_group``).
SHARED_SCENARIOS = {
    "finished_run": ("test_distillation", "test_fault_injection"),
    "readme_finetuning": ("test_after_training", "test_finetuning_e2e", "test_mlflow_ui"),
    "readme_store_server": ("test_finetuning_e2e", "test_mlflow_ui"),
    "warm_rays": ("test_after_training", "test_finetuning_e2e", "test_job_submit", "test_mlflow_ui"),
}


def _groups() -> dict[str, str]:
    """Each module that shares a scenario, by its group's name (the group's first module by name)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for modules in SHARED_SCENARIOS.values():
        for module in modules:
            parent[root(module)] = root(modules[0])
    members: dict[str, list[str]] = {}
    for module in parent:
        members.setdefault(root(module), []).append(module)
    return {module: min(group) for group in members.values() for module in group}


GROUPS = _groups()


def group_of(module: str) -> str:
    return GROUPS.get(module, module)


def order_by_group(items: list[pytest.Item]) -> None:
    """Orders ``items`` group by group, end-to-end groups first (within a group, the collection's
    order); refuses a collection where a module uses a shared scenario it is not listed with."""
    for item in items:
        module = item.module.__name__
        for scenario, modules in SHARED_SCENARIOS.items():
            if scenario in item.fixturenames and module not in modules:
                raise pytest.UsageError(f"{module} uses the session's {scenario}: add it to SHARED_SCENARIOS"
                                        f"[{scenario!r}] in tests/worker_groups.py, so that it shares a test worker")
    group = {item: group_of(item.module.__name__) for item in items}
    first_seen = {name: index for index, name in reversed(list(enumerate(group.values())))}
    end_to_end = Counter(group[item] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (-end_to_end[group[item]], first_seen[group[item]]))


class ScenarioGroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a group (``group_of`` the test's module) as the scope, in the
    collection's order (``order_by_group``), each worker taking the next group as it runs out."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection's order is the plan

    def _split_scope(self, nodeid: str) -> str:
        return group_of(PurePosixPath(nodeid.split("::", 1)[0]).stem)
