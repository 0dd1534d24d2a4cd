"""`make test`'s two workers: modules sharing a session scenario are one group (one worker runs the
scenario once), end-to-end groups are handed out first, and a module using a shared scenario it is not
listed with is refused at collection (tests/worker_groups.py)."""
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from worker_groups import ScenarioGroupScheduling, group_of, order_by_group


@dataclass(eq=False)
class CollectedTest:
    """What ``order_by_group`` reads of a collected test: its module, its fixtures, its end-to-end mark."""
    module_name: str
    name: str
    slow: bool = False
    fixturenames: list[str] = field(default_factory=list)

    @property
    def module(self):
        return SimpleNamespace(__name__=self.module_name)

    def get_closest_marker(self, name: str):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


def test_the_modules_reading_one_scenario_are_one_group_and_any_other_module_its_own():
    assert group_of("test_distillation") == group_of("test_fault_injection")  # finished_run
    readme = {group_of(m) for m in ("test_after_training", "test_finetuning_e2e", "test_mlflow_ui", "test_job_submit")}
    assert len(readme) == 1  # readme_finetuning, and the warm Ray job_submit joins too
    assert readme.isdisjoint({group_of("test_distillation")})
    assert group_of("test_models_xcit") == "test_models_xcit"


def test_a_test_id_is_scheduled_by_its_modules_group_whatever_its_parameters_hold():
    split = ScenarioGroupScheduling._split_scope
    assert split(None, "tests/test_fault_injection.py::test_x[a::b/c.py]") == group_of("test_distillation")
    assert split(None, "tests/test_models_sot.py::test_y") == "test_models_sot"


def test_end_to_end_groups_come_first_the_most_first_and_each_keeps_its_order():
    items = [CollectedTest("test_models_xcit", "unit"),
             CollectedTest("test_distillation", "unit"),
             CollectedTest("test_training", "e2e1", slow=True),
             CollectedTest("test_distillation", "e2e", slow=True),
             CollectedTest("test_fault_injection", "e2e1", slow=True),
             CollectedTest("test_training", "e2e2", slow=True),
             CollectedTest("test_fault_injection", "e2e2", slow=True, fixturenames=["finished_run"])]
    order_by_group(items)
    assert [(t.module_name, t.name) for t in items] == [
        ("test_distillation", "unit"), ("test_distillation", "e2e"),  # 3 end-to-end tests in the group
        ("test_fault_injection", "e2e1"), ("test_fault_injection", "e2e2"),
        ("test_training", "e2e1"), ("test_training", "e2e2"),  # 2
        ("test_models_xcit", "unit")]


def test_a_module_using_a_shared_scenario_it_is_not_listed_with_is_refused_by_name():
    items = [CollectedTest("test_models_xcit", "unit"),
             CollectedTest("test_new_feature", "e2e", slow=True, fixturenames=["digits16", "finished_run"])]
    with pytest.raises(pytest.UsageError, match=r"test_new_feature uses the session's finished_run: add it to "
                                                r"SHARED_SCENARIOS\['finished_run'\]"):
        order_by_group(items)
