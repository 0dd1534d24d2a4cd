"""The papers' recipes (pipeline/config/papers/): each value checked against the number its paper prints
(the citation beside it), the ones the papers leave to the authors' code said so; every row trains as a
preset at the paper's global batch and rate; `vitsweep config diff` lists where a config departs."""
import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import readme_block

from pipeline.cli import main
from pipeline.components.lr_scaling import recorded_params
from pipeline.config.loading import load_config, schema_problem
from pipeline.config.papers import DERIVED_KEYS, departures, paper_recipes, same
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PAPER_JOBS = sorted((REPO / "cluster" / "jobs" / "papers").glob("*.yaml"))
ROWS = [(paper, row) for paper, recipe in paper_recipes().items() for row in recipe.rows]
TEACHER = ["distill.teacher_checkpoint=regnety_160.safetensors"]  # a distilled row's teacher weights are the user's


def row_config(paper: str, row: str, overrides: list[str] = ()):
    recipe = paper_recipes()[paper]
    taught = recipe.values(recipe.row(row))["distill.teacher"].value is not None
    return load_config(f"paper:{paper}:{row}", [*(TEACHER if taught else []), *overrides])


def trained_values(cfg) -> dict:
    """What a run records: the config's keys with the global batch and rate it trains at."""
    return {**cfg.flat(), **recorded_params(cfg.optim, cfg.scaling.num_workers)}


def value(paper: str, row: str, key: str):
    return trained_values(row_config(paper, row))[key]


# (paper, row, key, value, where the paper prints it): typed from shared/papers/, not from the recipe files.
PRINTED = [
    ("003", "xcit_small_12_p16", "optim.epochs", 400, '§4.1 "We train our model for 400 epochs"'),
    ("003", "xcit_small_12_p16", "optim.schedule.name", "cosine", '§4.1 "using a cosine learning rate decay"'),
    ("003", "xcit_small_12_p16", "data.val_crop_ratio", 1.0, '§4.1 "cropped with crop ratio of 1.0 for evaluation"'),
    ("003", "xcit_nano_12_p16", "model.img_size", 224, "Table 1, @224/16"),
    ("003", "xcit_small_12_p8_384", "model.img_size", 384, 'Table 1 caption, "tested at resolution 384x384"'),
    ("003", "xcit_small_12_p8_384", "distill.kind", "hard", '§4.1 "using hard distillation"'),
    ("000", "xcit_nano_12_p16_psne", "optim.global_batch_size", 4096, '§5 "a batch size of 4,096 for XCiT-N12"'),
    ("000", "xcit_tiny_12_p16_psne", "optim.global_batch_size", 2816, '§5 "2,816 for XCiT-T12-based models"'),
    ("000", "xcit_nano_12_p16_sne", "optim.epochs", 400, '§5 "we trained the model for 400 epochs"'),
    ("000", "xcit_nano_12_p16_fsne8", "model.img_size", 224, '§5 "fixed at 224×224"'),
    ("000", "xcit_nano_12_p16_fsne8", "model.args.code_size", 8, "Table 2, XCiT-N12 (F-SNE, 8)"),
    ("000", "xcit_nano_12_p16_transfer", "optim.epochs", 1000, '§5 "5 × 10−5 for 1,000 epochs of training"'),
    ("004", "sot_tiny", "optim.global_batch_size", 1024, "Table S-3, Batch size 1024"),
    ("004", "sot_small", "optim.global_batch_size", 1024, "Table S-3, Batch size 1024"),
    ("004", "sot_base", "optim.global_batch_size", 512, "Table S-3, Batch size 512"),
    ("004", "sot_tiny", "optim.lr_effective", 1e-3, "Table S-3, Base LR 1e-3"),
    ("004", "sot_small", "optim.lr_effective", 1e-3, "Table S-3, Base LR 1e-3"),
    ("004", "sot_base", "optim.lr_effective", 5e-4, "Table S-3, Base LR 5e-4"),
    ("004", "sot_tiny", "optim.weight_decay", 0.03, "Table S-3, Weight decay 0.03"),
    ("004", "sot_base", "optim.weight_decay", 0.065, "Table S-3, Weight decay 0.065"),
    ("004", "sot_small", "optim.epochs", 310, "Table S-3, Epochs 310"),
    ("004", "sot_small", "optim.schedule.min_lr", 1e-5, "Table S-3, Final LR 1e-5"),
    ("004", "sot_small", "data.augment.label_smoothing", 0.1, "Table S-3, Label smoothing 0.1"),
    ("004", "sot_small", "data.augment.mixup_alpha", 0.8, "Table S-3, Mixup 0.8"),
    ("004", "sot_small", "data.augment.cutmix_alpha", 1.0, "Table S-3, Cutmix 1.0"),
    ("004", "sot_small", "data.augment.random_erasing", 0.25, "Table S-3, Erasing prob. 0.25"),
    ("004", "sot_small", "data.augment.rand_augment", "rand-m9-mstd0.5-inc1", "Table S-3, RandAugment 9/0.5"),
    ("004", "sot_small", "optim.schedule.warmup_epochs", 5, '§D.2.1 "a learning rate warm up (5 epochs)"'),
    ("001", "eit16_4_3_mini", "optim.global_batch_size", 1024, "Table 4 caption, 1024 for EIT-Mini"),
    ("001", "eit16_4_3_tiny", "optim.global_batch_size", 1024, "Table 4 caption, 1024 for EIT-Tiny"),
    ("001", "eit16_4_3_base", "optim.global_batch_size", 512, "Table 4 caption, 512 for EIT-Base"),
    ("001", "eit16_4_3_large", "optim.global_batch_size", 512, "Table 4 caption, 512 for EIT-Large"),
    ("001", "eit16_4_3_tiny", "optim.epochs", 300, 'Table 4 caption, "for 300 epochs"'),
    ("001", "eit16_4_3_large", "model.img_size", 224, 'Table 5, "The image size is 224× 224"'),
    ("002", "armour_tiny", "optim.epochs", 300, '§5.1 "trained without distillation for 300 epochs"'),
    ("002", "armour_tiny_distilled", "optim.epochs", 300, '§5.1 "By training DeiT-Ti dist for 300 epochs"'),
    ("002", "armour_tiny_distilled_1200", "optim.epochs", 1200, '§5.1 "trained for 1200 epochs"'),
    ("002", "armour_tiny_distilled", "model.name", "armour_tiny_distilled", "Table 1, Armour-Ti dist"),
]


@pytest.mark.parametrize("paper, row, key, printed, where", PRINTED, ids=lambda v: str(v)[:40])
def test_each_preset_holds_the_number_its_paper_prints(paper, row, key, printed, where):
    assert same(printed, value(paper, row, key)), where


# Values the papers leave to "the DeiT recipe" / "the original XCiT": the authors' released code's defaults
# (facebookresearch/xcit and deit main.py, MrHaiPi/EIT train.py, jiangtaoxie/SoT main.py), not the papers.
FROM_AUTHORS_CODE = [
    ("003", "xcit_small_12_p16", "optim.ema_decay", 0.99996, "xcit main.py --model-ema-decay"),
    ("003", "xcit_small_12_p16", "data.repeated_augmentation", 3, "xcit main.py --repeated-aug, RASampler x3"),
    ("003", "xcit_small_12_p16", "optim.global_batch_size", 1024, "xcit issue #19: batch 1024 throughout"),
    ("003", "xcit_small_12_p16", "model.drop_path_rate", 0.05, "xcit README: --drop-path 0.05 for S12/16"),
    ("003", "xcit_small_12_p8_384", "optim.lr_effective", 5e-6, "deit README: 384 fine-tune --lr 5e-6 at 512"),
    ("004", "sot_small", "optim.schedule.cooldown_epochs", 10, "SoT main.py: 300 epochs + 10 cooldown"),
    ("004", "sot_small", "data.repeated_augmentation", None, "SoT main.py: timm's loader, no RASampler"),
    ("001", "eit16_4_3_tiny", "model.drop_path_rate", 0.0, "EIT eit_model.py: drop_path_ratio=0"),
    ("002", "armour_tiny", "distill.teacher", None, "Table 1's first rows: no distillation"),
    ("002", "armour_tiny_distilled", "distill.teacher", "regnety_160", "deit README: --teacher-model regnety_160"),
]


@pytest.mark.parametrize("paper, row, key, expected, where", FROM_AUTHORS_CODE, ids=lambda v: str(v)[:40])
def test_values_the_papers_leave_to_the_authors_code_are_that_codes(paper, row, key, expected, where):
    assert same(expected, value(paper, row, key)), where


@pytest.mark.parametrize("paper, row, base_lr_per_512, batch", [
    # "initial learning rate" / "learning rate" read as the authors' --lr, which their main.py scales
    # by batch / 512: SNE's 5e-4 at 4,096 (§5), Armour's 1e-3 at DeiT's 1,024 (§5), EIT's 1e-3 (train.py).
    ("000", "xcit_nano_12_p16_psne", 5e-4, 4096),
    ("000", "xcit_tiny_12_p16_psne", 5e-4, 2816),
    ("000", "xcit_nano_12_p16_transfer", 5e-5, 1024),
    ("002", "armour_tiny", 1e-3, 1024),
    ("002", "deit_tiny_p16", 5e-4, 1024),
    ("003", "xcit_small_12_p16", 5e-4, 1024),
    ("001", "eit16_4_3_mini", 1e-3, 1024),
    ("001", "eit16_4_3_large", 1e-3, 512),
])
def test_a_rate_the_authors_give_per_512_images_is_scaled_to_the_papers_batch(paper, row, base_lr_per_512, batch):
    assert value(paper, row, "optim.lr_effective") == pytest.approx(base_lr_per_512 * batch / 512)


@pytest.mark.parametrize("paper, row", ROWS)
def test_every_row_trains_as_a_preset_at_its_papers_batch_and_rate_and_cites_every_key(paper, row):
    recipe = paper_recipes()[paper]
    cited = recipe.values(recipe.row(row))
    values = trained_values(row_config(paper, row))
    assert not departures(values, recipe, recipe.row(row))
    for key, entry in cited.items():
        assert key in DERIVED_KEYS or schema_problem(key) is None, key
        assert len(entry.source) > 5, f"{key} has no citation"
    # No row leaves a part of the recipe to vitsweep's own defaults: each cites what the XCiT row does.
    baseline = paper_recipes()["003"].values(paper_recipes()["003"].row("xcit_small_12_p16"))
    assert set(baseline) - set(cited) <= {"distill.kind", "distill.alpha"}


def test_the_cluster_jobs_config_diff_against_paper_003_lists_its_ema_and_repeated_augmentation_when_it_lacks_them(
        tmp_path, capsys):
    # The job file took XCiT main.py's EMA and repeated augmentation; without them, as it was, both are listed.
    job = yaml.safe_load((REPO / "cluster" / "jobs" / "a100_8x8.yaml").read_text())
    job["optim"]["ema_decay"] = None
    job["data"]["repeated_augmentation"] = None
    before = tmp_path / "a100_8x8_before.yaml"
    before.write_text(yaml.safe_dump(job))
    assert main(["config", "diff", "--against", "paper:003", "--config", str(before)]) == 0
    out = capsys.readouterr().out
    assert "row xcit_small_12_p16" in out  # the row of the job's model
    listed = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[3:] if line.startswith("  ")}
    assert listed["optim.ema_decay"] == ["0.99996", "null"]
    assert listed["data.repeated_augmentation"] == ["3", "null"]
    # As shipped: the EMA and the repeats are the paper's; its batch of 8 x 8 x 128 and sqrt-scaled rate are not.
    assert main(["config", "diff", "--against", "paper:003", "--config", str(REPO / "cluster/jobs/a100_8x8.yaml")]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[3:] if line.startswith("  ")}
    assert listed == {"optim.global_batch_size": ["1024", "8192"],
                      "optim.lr_effective": ["0.001", f"{5e-4 * 1024 / 512 * (8192 / 1024) ** 0.5:g}"]}


@pytest.mark.parametrize("path", PAPER_JOBS, ids=lambda p: p.name)
def test_each_papers_cluster_job_keeps_its_rows_recipe_on_64_a100(path, capsys):
    paper, row = path.stem.split("_", 1)
    assert main(["config", "diff", "--against", f"paper:{paper}:{row}", "--config", str(path)]) == 0
    assert "no departure" in capsys.readouterr().out
    cfg = load_config(str(path), TEACHER if "distilled" in row else [])
    assert cfg.scaling.num_workers == 64 and cfg.scaling.use_gpu and cfg.scaling.gpus_per_worker == 1
    assert cfg.optim.lr_per_512 is not None  # the rate follows the batch if the split changes
    assert cfg.deepspeed.precision == "bf16" and cfg.run.max_failures > 0


def test_every_paper_has_a_cluster_job():
    assert {path.stem.split("_", 1)[0] for path in PAPER_JOBS} == set(paper_recipes())


def test_a_model_argument_the_paper_does_not_set_departs_and_the_diff_picks_the_models_closest_row(capsys):
    # paper 000's rows all train XCiT-N12: without :ROW, the one the config departs from least
    assert main(["config", "diff", "--against", "paper:000", "--config", "paper:000:xcit_nano_12_p16_fsne8",
                 "--set", "model.args.hidden_dim=64", "--set", "optim.epochs=100"]) == 0
    out = capsys.readouterr().out
    assert "row xcit_nano_12_p16_fsne8:" in out
    listed = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[2:]
              if line.startswith("  ") and not line.startswith("  KEY")}
    assert listed == {"model.args.hidden_dim": ["(model", "default)"], "optim.epochs": ["400", "100"]}
    # the baseline row leaves qkv at the model's own (linear): a config that names another departs
    assert main(["config", "diff", "--against", "paper:000:xcit_nano_12_p16", "--config", "paper:000:xcit_nano_12_p16",
                 "--set", "model.args.qkv=sne"]) == 0
    listed = {line.split()[0]: line.split()[1:4] for line in capsys.readouterr().out.splitlines()[2:]
              if line.startswith("  ") and not line.startswith("  KEY")}
    assert listed == {"model.args.qkv": ["(model", "default)", "sne"]}


def test_a_config_with_a_teacher_is_compared_with_the_distilled_row_it_departs_from_least():
    recipe = paper_recipes()["002"]
    values = trained_values(row_config("002", "armour_tiny_distilled_1200"))
    assert recipe.row_of(values).name == "armour_tiny_distilled_1200"
    values = trained_values(row_config("002", "armour_tiny_distilled_1200", ["optim.epochs=500"]))
    row = recipe.row_of(values)  # 300 or 1200 epochs: one departure either way, the table's first row taken
    assert row.name == "armour_tiny_distilled"
    assert [(d.key, d.paper, d.config) for d in departures(values, recipe, row)] == [("optim.epochs", 300, 500)]


def test_values_compare_as_numbers_and_lists_not_as_text():
    assert same(1e-3, 5e-4 * 1024 / 512) and same(0.1, 0.1) and same([0.08, 1.0], (0.08, 1))
    assert not same(1e-3, 1.1e-3) and not same(3, None) and not same(True, 1) and not same([0.08, 1.0], [0.08])


@pytest.mark.parametrize("spec, message", [
    ("paper:009", "names no shipped paper recipe; they are paper:000"),
    ("paper:003:xcit_huge", "paper 003 (XCiT) has no row 'xcit_huge'; its rows: xcit_nano_12_p16"),
])
def test_an_unknown_paper_or_row_is_refused_with_the_list(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(spec)


def test_a_sweeps_summary_names_its_closest_paper_row_and_departures_besides_its_knobs():
    from pipeline.sweeps.summary import describe_recipe

    cfg = row_config("004", "sot_tiny", ["optim.epochs=30", "model.args.mgcrp_heads=4"])
    assert describe_recipe(cfg, {"model.args.mgcrp_heads"}) == (
        "Recipe: closest to paper 004 (SoT), row sot_tiny: Table 5, SoT-Tiny (7.7M, 80.3%); besides the knobs "
        "searched it departs in 1 key (`vitsweep config diff --against paper:004:sot_tiny` lists each with its "
        "source): optim.epochs 310 → 30.")
    # a searched rate or batch moves the rate the config trains at: not a departure of the base config's
    for knob in ("optim.lr_per_512", "optim.micro_batch_size"):
        searched = row_config("002", "armour_tiny", [f"{knob}=64"])
        assert "departs" not in describe_recipe(searched, {knob}), knob
    assert describe_recipe(row_config("002", "armour_tiny"), set()) == (
        "Recipe: paper 002 (Armour), row armour_tiny: Table 1, Armour-Ti (5.3M, 72.0%), with no departure besides "
        "the knobs searched.")


def test_the_readmes_recipe_commands_run_as_written_and_say_what_it_says(capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the README's paths are the repository's
    outputs = []
    for command in readme_block("### The papers' recipes"):
        program, *argv = shlex.split(command)
        assert program == "vitsweep" and main(argv) == 0, command  # in this process: the CLI's own entry
        outputs.append(capsys.readouterr().out)
    job, changed, shown = outputs
    assert "2 of 30 keys depart" in job and "optim.global_batch_size" in job and "optim.lr_effective" in job
    assert "1 of 30 keys departs" in changed and "optim.epochs" in changed
    assert "epochs: 1200" in shown and "teacher: regnety_160" in shown


def test_a_teacher_from_a_model_source_is_a_teacher_to_the_diff():
    recipe = paper_recipes()["002"]
    values = trained_values(load_config("paper:002:armour_tiny_distilled", [
        "distill.teacher=null", "distill.teacher_from=models:/regnety@champion"]))
    row = recipe.row_of(values)
    assert row.name == "armour_tiny_distilled"  # distilled: the model's row with a teacher
    assert [(d.key, d.paper, d.config) for d in departures(values, recipe, row)] == [
        ("distill.teacher", "regnety_160", "teacher_from=models:/regnety@champion")]
