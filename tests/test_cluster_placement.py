"""Where a multi-node run's pieces land: each node stages onto its own disk, workers spread or pack, trial
functions take the head's slots."""
import pytest
import yaml

from pipeline.config.schema import DataConfig
from pipeline.config.loading import load_config
from pipeline.data.staging import CACHE_DIR_ENV, cache_dir_for


def test_a_nodes_cache_dir_comes_from_its_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "nvme"))
    assert cache_dir_for(DataConfig(), str(tmp_path / "shared-runs")) == tmp_path / "nvme"


def test_a_configured_cache_dir_wins_over_the_nodes_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "nvme"))
    assert cache_dir_for(DataConfig(cache_dir=str(tmp_path / "mine")), "runs") == tmp_path / "mine"


def test_without_a_node_cache_dir_staging_falls_back_under_run_storage(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert cache_dir_for(DataConfig(), str(tmp_path / "runs")) == tmp_path / "runs" / "data-cache"


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_the_placement_strategy_reaches_rays_scaling_config(strategy, tmp_path):
    from pipeline.training.cost import RunCost
    from pipeline.training.runs import CheckedRun, ModelFacts, ResolvedData, build_trainer
    from pipeline.tracking.store import MlflowRun

    cfg = load_config("smoke", [f"scaling.placement_strategy={strategy}"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = CheckedRun(cfg, ResolvedData("train.beton", "val.beton", 10), ModelFacts.measure(cfg.model, 10), "placed",
                     str(tmp_path), uri)
    trainer = build_trainer(run, MlflowRun(uri, "run-id"), 0.0, RunCost.begin(cfg, {}))
    assert trainer.scaling_config.placement_strategy == strategy


def test_an_unknown_placement_strategy_is_rejected_naming_the_valid_ones():
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="scaling.placement_strategy.*'PACK'.*'SPREAD'"):
        load_config("smoke", ["scaling.placement_strategy=SCATTER"])


def test_every_cluster_files_head_and_only_its_head_offers_the_trial_slots():
    """A sweep's trial functions (and the Ray Train controllers Ray starts beside them) take the head's
    trial slots, so that a lost GPU node never takes a trial's controller with it."""
    from cluster_nodes import CLUSTER, LAUNCHERS, ray_start_resources
    from pipeline.sweeps.resources import TRIAL_SLOT

    declared = ray_start_resources()
    assert set(declared) == {"kuberay/raycluster.yaml", "kuberay/rayjob.yaml", *LAUNCHERS}
    for where, roles in declared.items():
        assert roles["head"].get(TRIAL_SLOT, 0) >= 1, where
        assert [role for role, given in roles.items() if role != "head" and TRIAL_SLOT in given] == [], where
    for name in LAUNCHERS:  # the autoscaler plans with the node type's resources: the same as `ray start` gives
        config = yaml.safe_load((CLUSTER / name).read_text())
        head = config["available_node_types"][config["head_node_type"]]
        assert head["resources"] == {"CPU": 0, **declared[name]["head"]}, name


@pytest.mark.parametrize("action", [None, "observe"])
def test_a_gpu_runs_trainer_has_ray_fail_a_hung_nccl_collective_unless_told_otherwise(tmp_path, monkeypatch, action):
    from ray.train.v2._internal.callbacks.nccl_ras import NCCLRASCallback

    from pipeline.tracking.store import MlflowRun
    from pipeline.training.cost import RunCost
    from pipeline.training.runs import CheckedRun, ModelFacts, ResolvedData, build_trainer

    for name in ("RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR", "RAY_TRAIN_NCCL_RAS_ACTION"):
        monkeypatch.delenv(name, raising=False)
    if action:
        monkeypatch.setenv("RAY_TRAIN_NCCL_RAS_ACTION", action)
    cfg = load_config("smoke", ["scaling.use_gpu=true", "scaling.gpus_per_worker=1", "deepspeed.precision=bf16"])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = CheckedRun(cfg, ResolvedData("train.beton", "val.beton", 10), ModelFacts.measure(cfg.model, 10), "gpu",
                     str(tmp_path), uri)
    trainer = build_trainer(run, MlflowRun(uri, "run-id"), 0.0, RunCost.begin(cfg, {}))
    # Ray Train's own callbacks for this trainer, as its fit would make them
    (detector,) = [c for c in trainer._create_default_callbacks() if isinstance(c, NCCLRASCallback)]
    assert detector._action == (action or "fail")
