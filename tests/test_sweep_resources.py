"""How many trials a sweep runs at once (pipeline/sweeps/resources.py): a local Ray holds what it has;
a cluster may grow, so its trials wait for nodes, announced and bounded."""
import pickle
import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import refused_in_process, tune_command, wait_for
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.sweeps.resources import (TRIAL_SLOT, ClusterDidNotGrow, ClusterGrowthDeadline, TrialResources,
                                      concurrent_trials, growth_notice, train_workers_alive)

ROOT = Path(__file__).resolve().parents[1]
# One 8-GPU trial of README step 4 on the A100 clusters of cluster/: 8 workers of 10 CPUs and 1 GPU.
A100_TRIAL = ["scaling.num_workers=8", "scaling.use_gpu=true", "scaling.gpus_per_worker=1", "scaling.cpus_per_worker=10",
              "tune.trial_cpus=0.25"]
EIGHT_A100_NODES = {"CPU": 8 * 96.0, "GPU": 64.0}


def test_two_cores_run_one_trial_of_one_worker_at_a_time():
    cfg = load_config("smoke", ["scaling.num_workers=1"])
    assert concurrent_trials(cfg, {"CPU": 2.0}, local=True) == 1


def test_a_full_node_runs_as_many_trials_as_fit():
    cfg = load_config("smoke", ["scaling.num_workers=2"])
    assert concurrent_trials(cfg, {"CPU": 16.0}, local=True) == 5  # 3 CPUs each: trial function + 2 workers


def test_gpus_bound_concurrency_on_a_gpu_cluster():
    cfg = load_config("smoke", ["scaling.num_workers=2", "scaling.use_gpu=true", "scaling.gpus_per_worker=1",
                                "tune.trial_cpus=0.5"])
    assert concurrent_trials(cfg, {"CPU": 64.0, "GPU": 8.0}, local=False) == 4


def test_a_trial_that_cannot_fit_a_local_ray_is_bad_input():
    cfg = load_config("smoke", ["scaling.num_workers=4"])
    with pytest.raises(InvalidInputError, match="one trial needs 5 CPUs .* this machine's local Ray has 4 CPUs"):
        concurrent_trials(cfg, {"CPU": 4.0}, local=True)


def test_a_sweep_whose_trial_cannot_fit_the_local_ray_is_refused_before_ray_starts(digits16, tmp_path, capsys):
    """A local Ray is known before it starts (the CPUs vitsweep gives it, the GPUs it will see): a trial of 64
    one-GPU workers exits 2 with no Ray process started and nothing written."""
    storage = tmp_path / "runs"
    err = refused_in_process(tune_command(storage, digits16, "smoke_lr_wd", "scaling.use_gpu=true",
                                          "scaling.gpus_per_worker=1", "scaling.num_workers=64")[1:], capsys)
    # CPUs: the trial function's 0.5 + 64 workers x 0.5; a local Ray advertises at least that many
    assert re.search(r"one trial needs 32.5 CPUs, 64 GPUs = trial function 0.5 CPU \+ 64 workers x \(0.5 CPU, 1 GPU\), "
                     r"but this machine's local Ray has \d+ CPUs and \d+ GPUs", err), err
    assert not storage.exists()


def test_more_trials_than_a_local_ray_fits_are_not_started_at_once(capsys):
    # Their functions would hold the CPUs the other trials' workers wait for.
    cfg = load_config("smoke", ["scaling.num_workers=1", "tune.max_concurrent_trials=4"])
    assert concurrent_trials(cfg, {"CPU": 4.0}, local=True) == 2
    assert "tune.max_concurrent_trials=4, but this machine's local Ray fits 2 trial(s)" in capsys.readouterr().out


def test_a_cluster_scaled_to_zero_runs_the_trials_asked_for_and_they_wait_for_nodes():
    cfg = load_config("smoke", [*A100_TRIAL, "tune.max_concurrent_trials=8"])
    assert concurrent_trials(cfg, {"CPU": 0.0}, local=False) == 8  # the 0-CPU head, no GPU node up yet
    notice = growth_notice(cfg, {"CPU": 0.0}, 8, ceiling_known=False)
    assert notice.startswith("waiting for the cluster to grow: 8 trial(s) at a time of 80.25 CPUs, 8 GPUs")
    assert "stops if no trial's workers have started after" in notice and "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S" in notice


def test_a_cluster_is_sized_by_what_its_autoscaler_can_grow_it_to():
    cfg = load_config("smoke", A100_TRIAL)
    assert concurrent_trials(cfg, {"CPU": 0.0}, local=False, ceiling=EIGHT_A100_NODES) == 8
    assert concurrent_trials(cfg, {"CPU": 96.0, "GPU": 8.0}, local=False, ceiling=EIGHT_A100_NODES) == 8  # 1 node up
    capped = load_config("smoke", [*A100_TRIAL, "tune.max_concurrent_trials=20"])
    assert concurrent_trials(capped, {"CPU": 0.0}, local=False, ceiling=EIGHT_A100_NODES) == 8


def test_a_trial_the_grown_cluster_cannot_hold_is_bad_input():
    cfg = load_config("smoke", [*A100_TRIAL, "scaling.num_workers=16"])  # 16 GPUs on one trial, PACKed
    with pytest.raises(InvalidInputError, match="16 GPUs .* can grow it to at most 96 CPUs and 8 GPUs"):
        concurrent_trials(cfg, {"CPU": 0.0}, local=False, ceiling={"CPU": 96.0, "GPU": 8.0})


def test_without_a_reported_maximum_a_cluster_runs_what_fits_now_and_says_how_to_run_more():
    cfg = load_config("smoke", A100_TRIAL)
    assert concurrent_trials(cfg, {"CPU": 0.0}, local=False) == 1  # it still starts, and waits for a node
    assert concurrent_trials(cfg, {"CPU": 192.0, "GPU": 16.0}, local=False) == 2
    for cluster, trials in (({"CPU": 0.0}, 1), ({"CPU": 192.0, "GPU": 16.0}, 2)):
        assert "set tune.max_concurrent_trials to run more trials at once" in growth_notice(cfg, cluster, trials,
                                                                                            ceiling_known=False)


def test_a_cluster_that_holds_every_trial_now_waits_for_nothing():
    cfg = load_config("smoke", [*A100_TRIAL, "tune.max_concurrent_trials=2"])
    assert growth_notice(cfg, {"CPU": 192.0, "GPU": 16.0}, 2, ceiling_known=False) is None


def test_one_trials_resources_read_in_the_singular_where_there_is_one():
    cfg = load_config("smoke", ["scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "tune.trial_cpus=0.5"])
    assert TrialResources.of(cfg).describe(cfg) == "1 CPU = trial function 0.5 CPU + 1 worker x (0.5 CPU)"


def test_a_sweep_whose_cluster_never_fits_a_trial_ends_at_the_deadline_saying_why():
    deadline = ClusterGrowthDeadline(0.0, "2 CPUs", workers_started=lambda: False)

    def ended() -> ClusterDidNotGrow | None:
        try:
            deadline.on_step_end(iteration=1, trials=[])
        except ClusterDidNotGrow as err:
            return err
        return None

    message = str(wait_for(ended, 10, "the growth deadline to pass"))
    assert message == ("no trial's workers started within 0 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S): the cluster "
                       "did not grow to fit one trial (2 CPUs)")


def test_a_sweep_whose_first_trials_workers_started_is_never_ended_by_the_deadline():
    asked = []
    deadline = ClusterGrowthDeadline(0.0, "2 CPUs", workers_started=lambda: asked.append(1) or True)
    for iteration in range(3):
        deadline.on_step_end(iteration=iteration, trials=[])  # raises nothing
    assert asked == [1]  # and Ray is not asked again


def test_a_trial_function_started_on_the_head_does_not_count_as_the_cluster_grown():
    deadline = ClusterGrowthDeadline(0.0, "2 CPUs", workers_started=lambda: False)
    deadline.on_trial_start(iteration=1, trials=[], trial=None)  # its function took a head slot at once
    with pytest.raises(ClusterDidNotGrow):
        wait_for(lambda: deadline.on_step_end(iteration=2, trials=[]), 10, "the growth deadline to pass")


def test_a_resumed_sweep_waits_the_whole_deadline_its_own_environment_sets(monkeypatch):
    deadline = ClusterGrowthDeadline(5.0, "2 CPUs")
    deadline.on_step_end(iteration=1, trials=[])  # its clock started in this process
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "600")
    restored = pickle.loads(pickle.dumps(deadline))  # as Tune saves the experiment and `--resume` restores it
    assert (restored.timeout_s, restored.trial, restored.since, restored.started) == (600.0, "2 CPUs", None, False)
    assert restored.workers_started is train_workers_alive


def readme_cluster_sweep() -> list[str]:
    """The `vitsweep tune` words of README step 4 ("A sweep" on the A100 cluster), as the shell splits them."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("**4. A sweep**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    return words[words.index("vitsweep"):]


def test_the_readmes_cluster_sweep_runs_one_trial_per_node_of_the_grown_cluster_starting_from_none():
    words = readme_cluster_sweep()
    overrides = [value.replace("$VITSWEEP_DATA_URI", "s3://bucket/vitsweep")
                 for flag, value in zip(words, words[1:]) if flag == "--set"]
    cfg = load_config(str(ROOT / words[words.index("--config") + 1]), overrides)
    launcher = yaml.safe_load((ROOT / "cluster" / "aws-p4d.yaml").read_text())
    (gpu_node,) = [node for node in launcher["available_node_types"].values() if node["resources"].get("GPU")]
    assert TrialResources.of(cfg).fitting(gpu_node["resources"]) == 1  # one trial per 8-GPU node
    assert concurrent_trials(cfg, {"CPU": 0.0}, local=False) == gpu_node["max_workers"]  # scaled to zero: all wait


HEAD_SLOTS = {"CPU": 0.0, TRIAL_SLOT: 16.0}  # the head every cluster file starts (test_cluster_placement)


def test_on_a_head_with_trial_slots_a_trials_function_takes_a_slot_and_no_cpu_beside_its_workers():
    cfg = load_config("smoke", A100_TRIAL)
    need = TrialResources.of(cfg, HEAD_SLOTS)
    assert need.function_request(cfg) == {"cpu": 0, TRIAL_SLOT: 1}
    assert (need.cpus, need.gpus) == (8 * 10, 8)  # the workers' alone: tune.trial_cpus=0.25 is not spent there
    assert need.describe(cfg) == "80 CPUs, 8 GPUs = trial function on the head + 8 workers x (10 CPU, 1 GPU)"
    elsewhere = TrialResources.of(cfg, {"CPU": 96.0, "GPU": 8.0})
    assert elsewhere.function_request(cfg) == {"cpu": 0.25} and elsewhere.cpus == 80.25


def test_the_heads_trial_slots_cap_the_trials_at_once():
    cfg = load_config("smoke", ["scaling.num_workers=1", "scaling.use_gpu=true", "scaling.gpus_per_worker=1",
                                "scaling.cpus_per_worker=10"])
    sixty_four_a100 = {"CPU": 8 * 96.0, "GPU": 64.0}
    assert concurrent_trials(cfg, {"CPU": 0.0}, local=False, ceiling=sixty_four_a100) == 64
    assert concurrent_trials(cfg, HEAD_SLOTS, local=False, ceiling=sixty_four_a100) == 16
    assert concurrent_trials(cfg, {**HEAD_SLOTS, TRIAL_SLOT: 4.0}, local=False) == 1  # what fits now, under the cap
