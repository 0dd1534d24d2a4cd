"""Search spaces: shipped studies, schema checks, constraints pruned before a trial starts (no Ray)."""
import random
import re

import pytest

from conftest import readme_output
from pipeline.config.loading import load_config, with_dotted
from pipeline.sweeps.planning import plan_trials, resolve_trial
from pipeline.sweeps.spaces import (SpaceError, available_spaces, combine, load_space,
                                    load_spaces, parse_space)

SHIPPED = ["fsne_code_size", "sot_mgcrp_heads", "sot_mgcrp_repr", "svpn_alpha", "eit_channel_ratio", "lr_wd",
           "eit_vs_vit_digits", "finetune_lr_layer_decay", "smoke_lr_wd"]


def _base(space, preset="smoke"):
    return with_dotted(load_config(preset).model_dump(mode="json"), space.fixed)


def _space(text: str):
    return parse_space(text, "test", "test.yaml")


def _grid(space, preset="smoke"):
    return plan_trials(space, _base(space, preset), "grid", None, seed=0)


def test_the_papers_studies_are_shipped():
    assert set(SHIPPED) <= set(available_spaces())


def test_the_readmes_spaces_table_lists_every_shipped_space():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("**Spaces**", 1)[1].split("\n\n", 2)[1]
    listed = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert sorted(listed) == sorted(available_spaces())


@pytest.mark.parametrize("name", [name for name in SHIPPED if name not in ("svpn_alpha", "smoke_lr_wd")])
def test_every_shipped_space_plans_a_grid_of_buildable_trials(name):
    plan = _grid(load_space(name))
    assert plan.variants and not plan.pruned


def test_the_first_sweep_samples_8_distinct_buildable_configurations_of_its_own_searcher():
    # README's first sweep: knob importance needs 8 configurations (README "Which knob mattered")
    space = load_space("smoke_lr_wd")
    base = _base(space)
    tune = base["tune"]
    assert (tune["searcher"], tune["num_samples"], tune["scheduler"]) == ("random", 8, "fifo")
    plan = plan_trials(space, base, tune["searcher"], tune["num_samples"], seed=0)
    assert not plan.pruned and len({tuple(sorted(v.items())) for v in plan.variants}) == 8
    assert all(1e-4 <= v["optim.lr_per_512"] <= 1e-2 and 0.005 <= v["optim.weight_decay"] <= 0.2 for v in plan.variants)
    # README's expected output shows trials this seed samples (the run's seed, 0, is the sweep's by default)
    shown = [line.split()[2:4] for line in readme_output("## A first sweep") if re.match(r"\w+_\d{5}  completed", line)]
    sampled = {(f"{v['optim.lr_per_512']:.4g}", f"{v['optim.weight_decay']:.4g}") for v in plan.variants}
    assert shown and {tuple(pair) for pair in shown} <= sampled


def test_fsne_study_crosses_code_sizes_with_starred_variants():
    plan = _grid(load_space("fsne_code_size"))
    assert {(v["model.args.code_size"], v["model.args.match_baseline_params"]) for v in plan.variants} == {
        (c, starred) for c in (8, 16, 32, 64) for starred in (False, True)}


def test_mgcrp_heads_study_derives_table_4a_square_projections():
    space = load_space("sot_mgcrp_heads")
    sides = {h: resolve_trial(space, _base(space), {"model.args.mgcrp_heads": h})[1] for h in (1, 2, 4, 6, 8)}
    assert {h: (k["model.args.mgcrp_m"], k["model.args.mgcrp_n"]) for h, k in sides.items()} == {
        1: (32, 32), 2: (24, 24), 4: (16, 16), 6: (14, 14), 8: (12, 12)}
    assert all(k["model.args.repr_size"] == h * k["model.args.mgcrp_m"] ** 2 for h, k in sides.items())


def test_mgcrp_repr_study_grid_is_table_4b_at_six_heads():
    space = load_space("sot_mgcrp_repr")
    sides = [resolve_trial(space, _base(space), v)[1]["model.args.mgcrp_m"] for v in _grid(space).variants]
    assert sides == [9, 14, 18, 24, 32]


def test_mgcrp_repr_study_takes_the_nearest_square_for_a_sampled_size():
    space = load_space("sot_mgcrp_repr")
    cfg, knobs = resolve_trial(space, _base(space), {"model.args.repr_size": 1000.7})
    assert knobs["model.args.mgcrp_m"] == 13 and cfg.model.args["repr_size"] == 6 * 13 * 13


def test_svpn_study_mirrors_table_4c_panels():
    variants = _grid(load_space("svpn_alpha")).variants
    exact = [v for v in variants if v["model.args.mgcrp_norm"] == "svpn"]
    approx = [v for v in variants if v["model.args.mgcrp_norm"] == "svpn_approx"]
    assert sorted(v["model.args.svpn_alpha"] for v in exact) == [0.3, 0.5, 0.7]
    assert all("model.args.svpn_num_sv" not in v for v in exact)
    assert len(approx) == 9 - 2 and all("model.args.svpn_alpha" not in v for v in approx)


def test_svpn_study_prunes_several_singular_values_from_one_iteration_as_undefined():
    pruned = _grid(load_space("svpn_alpha")).pruned
    cells = sorted((p["knobs"]["model.args.svpn_num_sv"], p["knobs"]["model.args.svpn_iters"]) for p in pruned)
    assert cells == [(2, 1), (3, 1)]
    assert all("iters=1 (svpn_iters) is undefined" in p["reason"] for p in pruned)


def test_eit_study_applies_ratio_range_only_to_the_linear_schedule():
    variants = _grid(load_space("eit_channel_ratio")).variants
    named = [v for v in variants if v["model.args.channel_schedule"] != "linear"]
    linear = [v for v in variants if v["model.args.channel_schedule"] == "linear"]
    assert [v["model.args.channel_schedule"] for v in named] == ["decreasing", "increasing", "invariant"]
    assert all(len(v) == 1 for v in named) and len(linear) == 4


def test_indexed_keys_assemble_a_list_argument():
    space = load_space("eit_channel_ratio")
    sampled = {"model.args.channel_schedule": "linear", "model.args.mha_ratio_range.0": 0.3,
               "model.args.mha_ratio_range.1": 0.9}
    cfg, _ = resolve_trial(space, _base(space), sampled)
    assert cfg.model.args["mha_ratio_range"] == [0.3, 0.9]


def test_learning_rate_space_combines_with_a_study():
    plan = _grid(load_spaces(["fsne_code_size", "lr_wd"]))
    assert len(plan.variants) == 8 * 9
    assert {"optim.lr_per_512", "optim.weight_decay", "model.args.code_size"} <= set(plan.variants[0])


@pytest.mark.parametrize("preset", ["default", "smoke"])  # the default preset gives an absolute rate
def test_the_learning_rate_space_sweeps_the_per_batch_rate_so_each_trial_follows_its_batch(preset):
    from pipeline.components.lr_scaling import effective_lr

    space = load_spaces(["lr_wd"])
    cfg, knobs = resolve_trial(space, _base(space, preset), {"optim.lr_per_512": 1e-3, "optim.weight_decay": 0.05})
    assert cfg.optim.lr is None and knobs["optim.lr_per_512"] == 1e-3
    batch = cfg.optim.micro_batch_size * cfg.optim.grad_accum_steps * cfg.scaling.num_workers
    assert effective_lr(cfg.optim, cfg.scaling.num_workers) == pytest.approx(1e-3 * batch / 512)


def test_scientific_notation_in_a_space_is_a_number():
    space = _space("params:\n  optim.lr: {values: [1e-3, 5e-4]}\n")
    assert space.dims[0].values == (1e-3, 5e-4)


def test_unknown_key_is_an_error_with_a_suggestion():
    with pytest.raises(SpaceError, match=r"'optim\.lrr' is not a config key \(did you mean 'optim\.lr'\?\)"):
        _space("params:\n  optim.lrr: {values: [1.0e-3]}\n")


def test_unknown_model_argument_is_an_error_naming_it():
    space = _space("params:\n  model.args.code_sise: {values: [8, 16]}\n")
    with pytest.raises(SpaceError, match="code_sise"):
        _grid(space)


def test_empty_choice_list_is_an_error_naming_the_key():
    with pytest.raises(SpaceError, match=r"params\.model\.args\.code_size\.values = \[\]: give at least one value"):
        _space("fixed:\n  model.args.qkv: fsne\nparams:\n  model.args.code_size: {values: []}\n")


def test_alpha_outside_the_unit_interval_is_an_error_naming_it():
    space = _space("fixed:\n  model.args.head: sot\nparams:\n  model.args.svpn_alpha: {uniform: [0.3, 1.5]}\n")
    with pytest.raises(SpaceError, match=r"model\.args\.svpn_alpha = 1\.5 \(upper end of uniform \[0\.3, 1\.5\]\).*\(0, 1\]"):
        plan_trials(space, _base(space), "random", 4, seed=0)


def test_value_outside_the_schema_range_is_an_error_naming_it():
    space = _space("params:\n  optim.lr: {values: [1.0e-3, -1.0]}\n")
    with pytest.raises(SpaceError, match=r"optim\.lr = -1\.0 is invalid in every combination.*greater than 0"):
        _grid(space)


def test_space_without_a_valid_trial_is_an_error_before_the_sweep():
    space = _space("params:\n  model.args.num_heads: {values: [3, 5, 7]}\n")  # none divides 128 channels
    with pytest.raises(SpaceError, match="yields no valid trial"):
        _grid(space)


def test_constraint_violating_combinations_are_pruned_not_run():
    space = _space("params:\n  model.args.embed_dim: {values: [96, 128]}\n  model.args.num_heads: {values: [4, 6]}\n")
    plan = _grid(space)
    assert {"model.args.embed_dim": 128, "model.args.num_heads": 6} not in plan.variants
    assert len(plan.variants) == 3
    assert plan.pruned == [{"knobs": {"model.args.embed_dim": 128, "model.args.num_heads": 6},
                            "reason": plan.pruned[0]["reason"]}]
    assert "forward pass fails" in plan.pruned[0]["reason"]


def test_sweep_level_settings_cannot_be_searched():
    with pytest.raises(SpaceError, match="scaling.num_workers cannot be searched"):
        _space("params:\n  scaling.num_workers: {values: [1, 2]}\n")


def test_a_range_needs_grid_points_for_grid_search():
    space = _space("params:\n  optim.lr: {loguniform: [1.0e-4, 1.0e-2]}\n")
    with pytest.raises(SpaceError, match="grid search needs its points"):
        _grid(space)


def test_grid_points_must_lie_in_their_range():
    with pytest.raises(SpaceError, match=r"grid points \[0\.9\] lie outside uniform \[0\.3, 0\.7\]"):
        _space("params:\n  optim.weight_decay: {uniform: [0.3, 0.7], grid: [0.5, 0.9]}\n")


def test_a_condition_must_refer_to_an_earlier_knob():
    with pytest.raises(SpaceError, match="must come before it"):
        _space("params:\n  optim.lr: {values: [1.0e-3], when: {optim.weight_decay: 0.05}}\n"
               "  optim.weight_decay: {values: [0.05]}\n")


def test_a_condition_in_a_later_space_on_a_key_an_earlier_one_searches_is_refused_naming_the_order():
    later = _space("params:\n  model.args.svpn_alpha: {values: [0.5], when: {model.args.mgcrp_norm: svpn}}\n")
    earlier = _space("params:\n  model.args.mgcrp_norm: {values: [svpn, none]}\n")
    assert [d.key for d in combine([earlier, later]).dims] == ["model.args.mgcrp_norm", "model.args.svpn_alpha"]
    with pytest.raises(SpaceError, match=r"test.yaml \+ test.yaml: params.model.args.svpn_alpha depends on "
                                         r"model.args.mgcrp_norm \(when\), which must come before it \(earlier in "
                                         r"its file, or in an earlier --space\)"):
        combine([later, earlier])


@pytest.mark.parametrize("when, message", [
    # a value the searched key never takes (a typo): the knob would silently drop out of the sweep
    ("{model.args.channel_schedule: lineaar}",
     "its when model.args.channel_schedule: ['lineaar'] never holds, as model.args.channel_schedule is searched "
     "over ['decreasing', 'linear']"),
    # a key the space does not search: its base-config value decides, for every trial alike
    ("{optim.weight_decay: [0.5, 0.9]}",
     f"its when optim.weight_decay: [0.5, 0.9] never holds, as optim.weight_decay is "
     f"{load_config('smoke').optim.weight_decay!r} in every trial (the base config)"),
])
def test_a_condition_no_trial_meets_is_refused_before_the_sweep(when, message):
    space = _space("fixed: {model.name: eit3_1_4_mini}\nparams:\n"
                   "  model.args.channel_schedule: {values: [decreasing, linear]}\n"
                   f"  model.args.mha_ratio_range.0: {{values: [0.25, 1.0], when: {when}}}\n")
    with pytest.raises(SpaceError) as refused:
        _grid(space)
    assert str(refused.value) == f"test.yaml: params.model.args.mha_ratio_range.0 applies to no trial: {message}"


def test_random_search_over_choices_takes_each_configuration_once_and_refuses_more_samples_than_there_are():
    space = load_spaces(["fsne_code_size"])  # code size 8, 16, 32, 64, plain and starred: 8 configurations
    variants = plan_trials(space, _base(space), "random", 8, seed=0).variants
    assert len({tuple(sorted(v.items())) for v in variants}) == 8  # every configuration once, none repeated
    with pytest.raises(SpaceError, match=r"its knobs' choices make 8 configurations, fewer than "
                                         r"tune.num_samples=9, so trials would repeat"):
        plan_trials(space, _base(space), "random", 9, seed=0)


def test_combined_spaces_may_not_search_the_same_key():
    with pytest.raises(SpaceError, match="optim.lr_per_512 is set by both"):
        combine([load_space("lr_wd"), _space("params:\n  optim.lr_per_512: {values: [1.0e-3]}\n")])


def test_random_search_is_seeded_and_samples_within_ranges():
    space = load_spaces(["lr_wd"])
    first = plan_trials(space, _base(space), "random", 6, seed=3).variants
    assert first == plan_trials(space, _base(space), "random", 6, seed=3).variants
    assert len(first) == 6 and all(1e-4 <= v["optim.lr_per_512"] <= 3e-3 for v in first)


def test_random_search_draws_only_the_knobs_that_apply():
    space = load_space("svpn_alpha")
    for _ in range(20):
        sample = space.sample(_base(space), random.Random(_))
        assert ("model.args.svpn_alpha" in sample) == (sample["model.args.mgcrp_norm"] == "svpn")


def test_random_search_prunes_invalid_draws_and_keeps_the_count():
    space = _space("params:\n  model.args.embed_dim: {values: [96, 128]}\n  model.args.num_heads: {values: [4, 6]}\n"
                   "  optim.weight_decay: {uniform: [0.0, 0.1]}\n")  # a range: more samples than the 4 choices
    plan = plan_trials(space, _base(space), "random", 5, seed=0)
    assert len(plan.variants) == 5  # 128 channels do not split into 6 heads: that draw is pruned, not counted
    assert all((v["model.args.embed_dim"], v["model.args.num_heads"]) != (128, 6) for v in plan.variants)
    assert any((p["knobs"]["model.args.embed_dim"], p["knobs"]["model.args.num_heads"]) == (128, 6) for p in plan.pruned)
