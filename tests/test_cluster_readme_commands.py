"""README "From laptop to 8×8 A100": every `vitsweep train|tune` command of its steps, resolved as
vitsweep resolves it (the real argument parser; --config, a sweep's fixed keys, --set; the README's
own `export`ed variables), holds to the scaling rules the README states, with the numbers read from
the README's text. A stale batch, rate or worker count fails here, not at a user's first launch."""
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster_nodes import ray_start_resources
from pipeline.cli import build_parser
from pipeline.config.schema import ExperimentConfig
from pipeline.config.loading import load_config
from pipeline.components.lr_scaling import effective_lr, global_batch_size
from pipeline.sweeps.runner import TrialResources, base_config
from pipeline.sweeps.spaces import load_spaces

REPO = Path(__file__).resolve().parents[1]
SECTION = "## From laptop to 8×8 A100"
NUMBER = r"[\d,]*\.?\d+(?:e[-+]?\d+)?"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def cluster_section() -> str:
    return (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]


def _one_line(text: str) -> str:
    return " ".join(text.split())  # the README's prose wraps anywhere


def _rule(pattern: str) -> re.Match:
    found = re.search(pattern, _one_line(cluster_section()))
    assert found, f"the README's cluster section no longer states {pattern!r}"
    return found


@dataclass(frozen=True)
class Rules:
    """The numbers the README's scaling rules state."""

    gpus_per_node: int  # "`scaling.num_workers` = nodes × 8 = 64"
    cluster_gpus: int
    node_vcpus: int  # "... fit the node's 96 vCPUs"
    job_factors: tuple[int, int, int]  # "128 × 1 × 64 = 8192": micro batch, accumulation, GPUs
    job_batch: int
    job_lr: float  # the rate the rules give the paired job
    base_lr: float  # "`lr = 5e-4 × global / 512`"
    base_batch: int
    sqrt_from: int | None  # "√(global / 1024)": where the sqrt rule leaves the linear one, if the README has it

    @property
    def nodes(self) -> int:
        return self.cluster_gpus // self.gpus_per_node

    def lr(self, global_batch: int, scaling: str) -> float:
        """The rate the README's formula gives a global batch, worked out here from its own numbers."""
        if scaling == "linear" or global_batch <= (self.sqrt_from or global_batch):
            return self.base_lr * global_batch / self.base_batch
        return self.base_lr * self.sqrt_from / self.base_batch * math.sqrt(global_batch / self.sqrt_from)


def readme_rules() -> Rules:
    workers = _rule(r"`scaling\.num_workers` = nodes × (\d+) = (\d+)")
    batch = _rule(rf"\*\*Global batch = [^*]+\*\*[^:]*: (\d+) × (\d+) × (\d+) = ({NUMBER})")
    linear = _rule(rf"`lr = ({NUMBER}) × global / (\d+)`")
    sqrt = re.search(r"√\(global / ([\d,]+)\)", _one_line(cluster_section()))
    job_lr = _rule(rf"`lr = [^`]+` = ({NUMBER})")
    return Rules(int(workers[1]), int(workers[2]), int(_rule(r"the node's (\d+) vCPUs")[1]),
                 tuple(int(batch[i]) for i in (1, 2, 3)), int(_number(batch[4])), _number(job_lr[1]),
                 _number(linear[1]), int(linear[2]), int(_number(sqrt[1])) if sqrt else None)


@dataclass(frozen=True)
class ReadmeCommand:
    step: str  # "3", "4"
    prose: str  # the step's text outside its code blocks
    argv: list[str]  # from `vitsweep` on, variables substituted

    @property
    def id(self) -> str:
        return f"step{self.step}-{self.argv[1]}"


def readme_commands() -> list[ReadmeCommand]:
    """Every `vitsweep train|tune` line of the section's code blocks, with the step it belongs to."""
    section = cluster_section()
    exported = dict(re.findall(r"export (\w+)=(\S+)", section))
    steps = re.split(r"\n\*\*(\d+)\. ", section)  # [before, number, body, number, body, ...]
    commands = []
    for number, body in zip(steps[1::2], steps[2::2]):
        blocks = re.findall(r"```bash\n(.*?)\n```", body, re.S)
        prose = re.sub(r"```bash\n.*?\n```", "", body, flags=re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                found = re.search(r"\bvitsweep (train|tune)\b.*", line)
                if not found:
                    continue
                text = re.sub(r"\$\{?(\w+)\}?", lambda m: exported.get(m[1], m[0]), found[0])
                assert "$" not in text, f"README step {number} uses a variable it never exports: {text}"
                commands.append(ReadmeCommand(number, prose, shlex.split(text, comments=True)))
    return commands


COMMANDS = readme_commands()


def test_the_cluster_section_shows_a_training_run_and_a_sweep():
    assert {command.argv[1] for command in COMMANDS} == {"train", "tune"}


def test_the_rules_job_batch_is_the_paired_jobs():
    rules = readme_rules()
    micro, accum, gpus = rules.job_factors
    assert micro * accum * gpus == rules.job_batch
    cfg = load_config(str(REPO / "cluster/jobs/a100_8x8.yaml"))
    assert (cfg.optim.micro_batch_size, cfg.optim.grad_accum_steps, cfg.scaling.num_workers) == rules.job_factors
    assert gpus == rules.cluster_gpus


def test_xcits_own_recipe_is_the_one_override_away_the_readme_says():
    recipe = _rule(rf"XCiT's own recipe \(global batch ({NUMBER}), lr ({NUMBER})[^)]*\) is one override away: (.*?)\. ")
    overrides = re.findall(r"`--set (\S+)`", recipe[3])
    assert overrides, "the README names no override that gives XCiT's recipe back"
    for override in overrides:
        cfg = load_config(str(REPO / "cluster/jobs/a100_8x8.yaml"), [override])
        workers = cfg.scaling.num_workers
        assert global_batch_size(cfg.optim, workers) == _number(recipe[1]), override
        assert effective_lr(cfg.optim, workers) == pytest.approx(_number(recipe[2])), override


def resolve(command: ReadmeCommand) -> ExperimentConfig:
    """The config `vitsweep` would run: a sweep's is the base every trial starts from."""
    args = build_parser().parse_args(command.argv[1:])
    if args.command == "train":
        return load_config(args.config, args.overrides)
    space = load_spaces(args.spaces)
    batch_or_rate = [key for key in space.keys if key.startswith(("optim.lr", "optim.micro", "optim.grad_accum"))]
    assert not batch_or_rate, f"step {command.step} searches {batch_or_rate}: state each trial's batch and rate"
    return base_config(args.config, args.overrides, space)


def stated(command: ReadmeCommand, rules: Rules) -> tuple[int, int, float]:
    """GPUs, global batch and rate the command's step states ("8 GPUs: global batch 1,024, lr 1e-3"),
    else those the rules state for the paired job."""
    found = re.findall(rf"(\d+) GPUs: global batch ({NUMBER}), lr ({NUMBER})", _one_line(command.prose))
    if not found:
        return rules.job_factors[2], rules.job_batch, rules.job_lr
    gpus, batch, lr = found[-1]
    return int(gpus), int(_number(batch)), _number(lr)


@pytest.fixture(autouse=True)
def at_the_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the README runs its commands from there


def _ids(commands: list[ReadmeCommand]) -> list[str]:
    return [command.id for command in commands]


@pytest.mark.parametrize("command", COMMANDS, ids=_ids(COMMANDS))
def test_each_command_trains_the_global_batch_and_rate_the_readme_states_by_its_rule(command):
    rules, cfg = readme_rules(), resolve(command)
    gpus, batch, lr = stated(command, rules)
    workers = cfg.scaling.num_workers
    assert (workers, global_batch_size(cfg.optim, workers)) == (gpus, batch), (
        f"step {command.step}: {cfg.optim.micro_batch_size} x {cfg.optim.grad_accum_steps} x {workers} GPUs")
    rule = rules.lr(batch, cfg.optim.lr_scaling)
    assert effective_lr(cfg.optim, workers) == pytest.approx(rule), (
        f"step {command.step}: trains at {effective_lr(cfg.optim, workers):g}; the README's rule gives {rule:g} "
        f"at a global batch of {batch}")
    assert lr == pytest.approx(rule, rel=0.01), f"step {command.step} states lr {lr:g}; its rule gives {rule:g}"


@pytest.mark.parametrize("command", COMMANDS, ids=_ids(COMMANDS))
def test_each_command_places_one_worker_per_gpu_packed_on_whole_nodes(command):
    rules, cfg = readme_rules(), resolve(command)
    scaling = cfg.scaling
    assert scaling.use_gpu and scaling.gpus_per_worker == 1 and scaling.placement_strategy == "PACK"
    assert scaling.num_workers % rules.gpus_per_node == 0 and scaling.num_workers <= rules.cluster_gpus
    assert scaling.cpus_per_worker * rules.gpus_per_node <= rules.node_vcpus
    assert cfg.data.num_workers * rules.gpus_per_node <= rules.node_vcpus


SWEEPS = [command for command in COMMANDS if command.argv[1] == "tune"]


@pytest.mark.parametrize("command", SWEEPS, ids=_ids(SWEEPS))
def test_each_sweep_runs_as_many_trials_at_once_as_its_step_says(command):
    rules, cfg = readme_rules(), resolve(command)
    at_once = re.search(r"(\d+) at a time", _one_line(command.prose))
    assert at_once, f"step {command.step} does not say how many trials run at a time"
    per_node = re.search(r"one trial per (\d+)-GPU node", _one_line(command.prose))
    if per_node:  # a trial fills whole nodes: its workers are one node's GPUs
        assert cfg.scaling.num_workers == int(per_node[1]) == rules.gpus_per_node
    # the head takes no workers, and the trial functions take its slots: the nodes' CPUs and GPUs hold the workers
    need = TrialResources.of(cfg, ray_start_resources()["aws-p4d.yaml"]["head"])
    assert need.on_head
    fits = min(rules.nodes * rules.node_vcpus // need.cpus, rules.cluster_gpus // need.gpus)
    assert fits == int(at_once[1]), f"step {command.step}: {need.describe(cfg)} per trial, {fits:g} fit the cluster"
    assert cfg.tune.max_concurrent_trials in (None, int(at_once[1]))  # where the step caps it, at the same number
