"""Shared test setup: keep the 2-core machine usable and runs isolated from the user's stores."""
import faulthandler
import os

# Enabled before pytest's own handler, which then hands back to it: a native crash while the interpreter
# exits, after the last test, still prints every thread's stack.
faulthandler.enable()

import tempfile

# DeepSpeed must pick its CPU accelerator in tests even where a GPU happens to be visible.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Tests never write into a user's MLflow server.
os.environ.pop("MLFLOW_TRACKING_URI", None)
# What a command the tests start inherits: the environment this process started with (pytest's, with
# the session's cache directory, ``pytest_configure``; a process a test spawns, such as a simulated
# cluster's, starts with what the test gave it), as a user's shell has it, never what an in-process
# command (a command's ``main``, ``ray.init``) has put in this process's since: quiet_environment's
# settings (RAY_DEDUP_LOGS, TQDM_DISABLE, ...) passed on would hide a command that no longer sets them;
# RAY_AUTH_MODE=token would silence Ray's token-auth notice.
STARTING_ENVIRONMENT: dict[str, str] = dict(os.environ)

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from warm_ray import WarmRay, start_warm_ray
from worker_groups import ScenarioGroupScheduling, order_by_group

VITSWEEP = str(Path(sys.executable).parent / "vitsweep")
REPO = Path(__file__).resolve().parents[1]
MLFLOW = str(Path(sys.executable).parent / "mlflow")


def pytest_report_header(config) -> str:
    """The host's processor: on the same 2 cores the suite's wall time differs ~1.8x between the hosts
    this machine kind runs on (benchmarks/RESULTS.md, "The suite's wall time"), so a time needs its host."""
    cpuinfo = Path("/proc/cpuinfo")
    first = cpuinfo.read_text().split("\n\n", 1)[0] if cpuinfo.exists() else ""
    facts = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    facts = {key.strip(): value.strip() for key, value in facts.items()}
    if "model name" not in facts:
        return f"host: processor unknown, {os.cpu_count()} cores"
    return (f"host: {facts['model name']} (family {facts.get('cpu family', '?')}, model {facts.get('model', '?')}), "
            f"{float(facts.get('cpu MHz', 'nan')):.0f} MHz, {os.cpu_count()} cores")


@pytest.fixture(scope="session")
def digits16(tmp_path_factory) -> dict[str, Path]:
    """The offline digits dataset at 16 px, written once per test session (train and val .beton)."""
    from pipeline.config.schema import DataConfig
    from pipeline.data.prepare import prepare_digits

    root = tmp_path_factory.mktemp("digits16")
    data = DataConfig(train=str(root / "train.beton"), val=str(root / "val.beton"))
    train, val = prepare_digits(data, img_size=16)
    return {"train": train, "val": val}


DIGITS = tuple(f"digit {i}" for i in range(10))


@dataclass(frozen=True)
class LoggedRun:
    """A finished run's MLflow record as training leaves it, around an untrained smoke model."""

    storage: Path
    uri: str
    run_id: str
    model_id: str
    model: object  # the logged nn.Module, in eval mode
    data: dict[str, Path]  # the digits16 files it names as its datasets

    @property
    def model_uri(self) -> str:
        return f"runs:/{self.run_id}/model"


@pytest.fixture(scope="session")
def logged_run(tmp_path_factory, digits16) -> LoggedRun:
    """A FINISHED run in a sqlite store with what `vitsweep train` records (description, final metrics at
    step 1, both datasets) and its model logged by training's own ``pipeline.trained.serving.log_model``: random
    weights of the smoke model (no training: tests check what is done with the weights, not accuracy)."""
    import torch
    from safetensors.torch import save_model

    from pipeline.config.loading import load_config
    from pipeline.data.sidecar import read_sidecar
    from pipeline.components.model_card import ModelCard
    from pipeline.components.modeling import build_model
    from pipeline.trained.serving import log_model
    from pipeline.tracking.store import MlflowStore, run_origin

    storage = tmp_path_factory.mktemp("logged-run")
    cfg = load_config("smoke", [f"run.storage_path={storage}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, len(DIGITS)).eval()
    save_model(model, str(storage / "model.safetensors"))
    uri = f"sqlite:///{storage}/mlflow.db"
    run = MlflowStore(uri).create_run("vitsweep", "logged")
    run.log_params(cfg.flat())
    run.set_tags(run_origin("**xcit_nano_12_p8**, untrained.", "vitsweep train --config smoke"))
    run.log_metrics({"val_top1": 12.5, "val_top5": 50.0, "val_loss": 2.3, "train_loss": 2.31}, step=1)
    run.log_datasets({context: (str(digits16[split]), read_sidecar(digits16[split]).sha256)
                      for context, split in (("training", "train"), ("validation", "val"))})
    model_id = log_model(run, model, [storage / "model.safetensors"], ModelCard.of_run(cfg, len(DIGITS), DIGITS), step=1)
    run.end("FINISHED", "completed")
    return LoggedRun(storage, uri, run.run_id, model_id, model, digits16)


def copy_with_sidecar(beton: Path, directory: Path, chunk_bytes: int | None = None, flip_at: int | None = None) -> Path:
    """``beton`` copied into ``directory`` (created), optionally with one byte flipped; its sidecar lists
    digests of ``chunk_bytes`` chunks of the original, or none (a sidecar written before chunk digests)."""
    from pipeline.data.sidecar import chunk_sha256s, read_sidecar, write_sidecar

    directory.mkdir()
    copy = directory / beton.name
    data = bytearray(beton.read_bytes())
    if flip_at is not None:
        data[flip_at] ^= 0xFF
    copy.write_bytes(bytes(data))
    chunks = dict(chunk_bytes=chunk_bytes, chunk_sha256=chunk_sha256s(beton, chunk_bytes) if chunk_bytes else None)
    write_sidecar(copy, read_sidecar(beton).model_copy(update=chunks))
    return copy


def _ports_nothing_takes_unasked() -> Iterator[int]:
    """Ports below the kernel's ephemeral range (``ip_local_port_range``), which it never assigns on its
    own (a bind to port 0, an outgoing connection), and above Ray's worker ports (10002-19999), in an
    order of this process's: each handed out once."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first_ephemeral = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    ports = list(range(20000, max(first_ephemeral, 20001)))
    random.Random(os.getpid()).shuffle(ports)
    return iter(ports)


_PORTS = _ports_nothing_takes_unasked()


def free_port() -> int:
    """A loopback port free now, for a server a test starts: servers of the tests' own never collide with
    a user's on the defaults, nor (between this check and the server's own bind) with a port the kernel
    hands another process, nor with one handed out before in this session."""
    for port in _PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port left below the ephemeral range")


def vitsweep_env() -> dict[str, str]:
    env = {k: v for k, v in STARTING_ENVIRONMENT.items() if not k.startswith(("PYTEST_", "MLFLOW_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def environment_restored() -> Iterator[None]:
    """``os.environ`` as it was before the block, whatever the block set or removed."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_environment() -> Iterator[None]:
    """Each test starts from the environment the last one started from: a command run in-process
    (``main``) sets library settings in ``os.environ``, which the next in-process command would find set."""
    with environment_restored():
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config) -> None:
    """Directories of this session's own. For ``tmp_path``: pytest's default keeps the last three
    sessions' and deletes older ones, a running session's included when pytests run side by side (a
    test of ``make test`` starts one). For ``VITSWEEP_CACHE_DIR``: tests never write into the user's
    ~/.cache/vitsweep (the record of verified datasets, staged copies), nor read what they left there."""
    if config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix="pytest-vitsweep-")
    os.environ["VITSWEEP_CACHE_DIR"] = config.session_cache = tempfile.mkdtemp(prefix="vitsweep-tests-cache-")
    STARTING_ENVIRONMENT.update(os.environ)


def per_test_under_mutation(scope: str) -> Callable[[str, pytest.Config], str]:
    """A shared fixture's scope: ``scope``, but each test's own under mutmut (``make mutation`` sets
    MUTANT_UNDER_TEST). mutmut runs, against a mutant, the tests that ran the mutated code while it
    recorded them; a shared fixture's code runs in the first test that asks for it, so the others
    that read its result would never be run against it."""
    return lambda fixture_name, config: "function" if "MUTANT_UNDER_TEST" in os.environ else scope


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's directories go with a passing session; a failing one's stay for a look, except under
    `make mutation`, whose every killed mutant is a failing session (hundreds of them would fill the disk)."""
    shutil.rmtree(session.config.session_cache, ignore_errors=True)
    kept = exitstatus != 0 and "MUTANT_UNDER_TEST" not in os.environ
    if not kept and Path(session.config.option.basetemp).name.startswith("pytest-vitsweep-"):
        shutil.rmtree(session.config.option.basetemp, ignore_errors=True)


class WarmRays:
    """The session's warm local Ray (README "A warm local Ray"), started when a command first joins it
    (``running``) and stopped when a run of such commands is over (``stop``; after the last test that may
    need it at the latest, ``pytest_runtest_teardown``): idle, its ~20 processes use about 6 % of a core
    (``benchmarks/bench_warm_ray.py``), so on 2 cores it pays only while its commands follow each other."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory, self.cluster = tmp_path_factory, None

    def running(self) -> WarmRay:
        """The warm Ray, started by the README's lines (``start_warm_ray``), with every CPU free again:
        whatever ran on it before is gone."""
        if self.cluster is None:
            self.cluster = start_warm_ray(self.tmp_path_factory.mktemp("warm-ray") / "home")
        self.cluster.wait_until_idle()
        return self.cluster

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


@pytest.fixture(scope="session")
def warm_rays(request, tmp_path_factory) -> Iterator[WarmRays]:
    request.config.warm_rays = warm = WarmRays(tmp_path_factory)
    yield warm
    warm.stop()


def pytest_collection_modifyitems(config, items) -> None:
    order_by_group(items)


def pytest_xdist_make_scheduler(config, log) -> ScenarioGroupScheduling:
    """`make test`'s two workers each take whole groups of tests (tests/worker_groups.py)."""
    return ScenarioGroupScheduling(config, log)


def pytest_collection_finish(session) -> None:
    """The last test (of those selected) that may use the warm Ray, for ``pytest_runtest_teardown``."""
    users = [item for item in session.items if "warm_rays" in getattr(item, "fixturenames", ())]
    session.config.last_warm_ray_user = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """The warm Ray goes as soon as no later test may need it, not at the session's end."""
    if item is getattr(item.config, "last_warm_ray_user", None) and hasattr(item.config, "warm_rays"):
        item.config.warm_rays.stop()


def train_command(storage: Path, data: dict[str, Path], *overrides: str, config: str = "smoke") -> list[str]:
    """`vitsweep train` on the smoke preset, writing only under ``storage``."""
    args = [VITSWEEP, "train", "--config", config,
            "--set", f"run.storage_path={storage}",
            "--set", f"data.train={data['train']}", "--set", f"data.val={data['val']}",
            "--set", "data.prepare=null"]
    for override in overrides:
        args += ["--set", override]
    return args


# Two one-worker trials at once on 2 cores (each trial's function is idle while its worker trains), for a
# sweep whose trials' order does not matter to its test: about a quarter less wall time than one at a time.
TWO_TRIALS_AT_ONCE = ("tune.trial_cpus=0.5", "scaling.cpus_per_worker=0.5")


def tune_command(storage, data, space, *overrides) -> list[str]:
    """`vitsweep tune` on the smoke model with one worker per trial, writing only under ``storage``."""
    args = [VITSWEEP, "tune", "--space", str(space), "--config", "smoke",
            "--set", f"run.storage_path={storage}", "--set", "scaling.num_workers=1",
            "--set", f"data.train={data['train']}", "--set", f"data.val={data['val']}", "--set", "data.prepare=null"]
    for override in overrides:
        args += ["--set", override]
    return args
# ZeRO-3 keeps whole on every rank each parameter of up to 1e5 elements (DeepSpeed's
# stage3_param_persistence_threshold). The shared run's student is DeiT-Ti with its distillation token (paper
# 002's "dist" rows) at the smoke preset's 2 blocks and 16 px (one patch): MLP ratio 8 makes each block's two
# MLP weights 294,912 elements (192 x 1,536), the patch embedding's 147,456: each rank holds half of each, and the
# final weights need both halves.
ZERO3_SPLIT = ("deepspeed.zero_stage=3", "model.args.mlp_ratio=8", "model.name=deit_tiny_distilled_p16")


@pytest.fixture(scope="session")
def teacher_checkpoint(tmp_path_factory) -> Path:
    """A one-block XCiT-N12 teacher for ``digits16``'s 10 classes, its weights as safetensors."""
    import timm
    from safetensors.torch import save_model

    import models  # noqa: F401  (registers vitsweep's variants)

    teacher = timm.create_model("xcit_nano_12_p8", img_size=16, num_classes=10, depth=1)
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    save_model(teacher, str(path))
    return path


@pytest.fixture(scope="session")
def teacher_source(tmp_path_factory, teacher_checkpoint) -> Path:
    """``teacher_checkpoint``'s teacher as a model source that says what it is: a .safetensors file with its
    card in the metadata, as vitsweep saves a run's sources (``distill.teacher_from``)."""
    from safetensors.torch import load_file

    from pipeline.components.model_card import EvalPreprocessing, ModelCard
    from pipeline.config.schema import ModelConfig
    from pipeline.trained.model_source import ModelSource, Provenance
    from pipeline.trained.transfer import save_source

    card = ModelCard(model=ModelConfig(name="xcit_nano_12_p8", img_size=16, args={"depth": 1}), num_classes=10,
                     class_names=DIGITS, preprocessing=EvalPreprocessing(img_size=16, crop_ratio=1.0,
                                                                          mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)))
    path = tmp_path_factory.mktemp("teacher-source") / "teacher.safetensors"
    save_source(ModelSource(load_file(teacher_checkpoint), card, Provenance(str(teacher_checkpoint), "safetensors",
                                                                             str(teacher_checkpoint))), str(path))
    return path


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, digits16, teacher_source):
    """One finished run several modules read: one epoch of a student with DeiT's distillation token under ZeRO-3
    (``ZERO3_SPLIT``), distilled from the model source ``teacher_source`` (``distill.teacher_from``), with
    --verbose. (storage, its command, its result.)"""
    storage = tmp_path_factory.mktemp("finished") / "runs"
    args = train_command(storage, digits16, "run.name=done", *ZERO3_SPLIT,
                         f"distill.teacher_from={teacher_source}") + ["--verbose"]
    result = run_vitsweep(args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return storage, args, result


def assert_scores_the_runs_metrics(model, cfg, val_beton: Path, metrics: dict[str, float]) -> None:
    """``model`` (a run's final weights), evaluated as the run's workers evaluate (the config's val loader
    and precision, BatchNorm in fp32 with exact running statistics), scores the run's final metrics."""
    import pytest
    import torch

    from pipeline.data.loaders import build_val_loader
    from pipeline.data.sidecar import read_sidecar
    from pipeline.components.engine import input_dtype, keep_batchnorm_in_fp32
    from pipeline.components.metrics import validation_metrics

    dtype, weights = input_dtype(cfg), model.state_dict()
    model.to(dtype)
    keep_batchnorm_in_fp32(model)
    model.load_state_dict(weights)  # copies into the cast tensors: the running statistics stay exact
    loader = build_val_loader(cfg.data, val_beton, 2 * cfg.optim.micro_batch_size, cfg.model.img_size, "cpu")
    ours = validation_metrics(model, loader, dtype, torch.device("cpu"))
    # The ranks' batch shapes change how a kernel rounds: in fp32 by ~1e-7, in bf16 by up to ~1e-2,
    # which may flip a near-tie: one sample.
    one_sample = 100.0 / read_sidecar(val_beton).num_samples
    assert ours["val_top1"] == pytest.approx(metrics["val_top1"], abs=one_sample + 1e-9)
    assert ours["val_loss"] == pytest.approx(metrics["val_loss"], rel=1e-5 if dtype == torch.float32 else 1e-2)


def run_vitsweep(args: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``args`` run to the end in the suite's environment (``env`` added to it, e.g. a warm Ray's address)."""
    return subprocess.run(args, capture_output=True, text=True, env={**vitsweep_env(), **(env or {})}, timeout=timeout)


def wait_for(condition, timeout: float, what: str, every: float = 0.5):
    """Poll ``condition`` every ``every`` s until it returns something truthy (returned), or fail naming
    ``what``. A moment that lasts a second or two (a process that exists only while Ray starts) needs a
    short ``every``: on a loaded host a half-second poll can miss it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextlib.contextmanager
def mlflow_server(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`mlflow server ARGS` on a free loopback port, its output in ``log``; yields its URI once it answers
    /health, and stops its whole process group after. Without MLflow 3.17's job runner (GenAI jobs, which
    vitsweep never submits): its 8 huey consumers cost ~26 CPU-seconds at every start, 3.5x the server's own."""
    port = free_port()
    env = {**(env or vitsweep_env()), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as output:
        process = subprocess.Popen([MLFLOW, "server", *args, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                   stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        uri = f"http://127.0.0.1:{port}"
        try:
            def healthy() -> bool:
                assert process.poll() is None, f"mlflow server exited with {process.returncode}: {log.read_text()[-3000:]}"
                return answers_200(f"{uri}/health")

            wait_for(healthy, 120, f"mlflow server at {uri} to answer /health")
            yield uri
        finally:
            stop_process_group(process)


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, port: int) -> Iterator[None]:
    """This (spawned) process as ``rank`` of a gloo process group on loopback ``port``, for the block."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def nvml_problem_here() -> str | None:
    """What NVML itself says of this machine: None where it starts (a GPU machine), else its error."""
    import pynvml  # nvidia-ml-py

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return str(err)
    pynvml.nvmlShutdown()
    return None


def answers_200(url: str) -> bool:
    """Whether ``url`` answers HTTP 200 now (a server still starting does not)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the whole process group of ``process`` (started with ``start_new_session``), then
    SIGKILL to whatever of it is left."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:  # its worker processes may ignore SIGTERM while busy
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


# Set to a value of its own in each background command's environment, which every process it starts
# (Ray's, however deep, even once orphaned) inherits: how a test finds them all.
PROCESS_MARK = "VITSWEEP_TEST_COMMAND"


def readme_shell_env() -> dict[str, str]:
    """A user's shell for the README's commands: the venv's `vitsweep` and `mlflow` on the PATH."""
    return {**vitsweep_env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def readme_block(heading: str) -> list[str]:
    """The commands of README's first ```bash block after ``heading``, continuation lines joined."""
    section = (REPO / "README.md").read_text().split(heading + "\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def readme_output(heading: str) -> list[str]:
    """The lines of README's first plain ``` block (a command's expected output) after ``heading``."""
    section = (REPO / "README.md").read_text().split(heading + "\n", 1)[1]
    return section.split("\n\n```\n", 1)[1].split("\n```", 1)[0].splitlines()  # a block opens after a blank line


def ignoring_as_the_project_does(root: Path) -> Path:
    """``root`` made a git repository holding the project's .gitignore alone: after the README's commands
    run there, `git status` shows what a clone of the project would show."""
    shutil.copyfile(REPO / ".gitignore", root / ".gitignore")
    for git in (["init", "-q"], ["add", ".gitignore"], ["-c", "user.name=vitsweep", "-c", "user.email=vitsweep@localhost",
                                                        "commit", "-q", "-m", "the project's .gitignore"]):
        subprocess.run(["git", *git], cwd=root, check=True, capture_output=True)
    return root


def untracked_by_git(root: Path) -> list[str]:
    """What `git status` shows in ``root`` (new or changed files that no .gitignore entry covers)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True,
                            text=True, check=True)
    return status.stdout.splitlines()


@pytest.fixture(scope="session")
def readme_finetuning(tmp_path_factory, warm_rays) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """README's "Fine-tuning" commands run as written, one after the other, in a fresh directory (with the
    venv's `vitsweep` on PATH): a 2-epoch smoke run ``digits16`` (with an EMA) and a 2-trial fine-tuning sweep
    from it that registers its best trial. Their store (``./vitsweep-runs``) and each command's output; the
    MLflow UI check browses the same store (adding README "A first sweep" and the demo's run after every other
    module that reads it), and README "After training" continues in
    the same directory (``test_after_training``), as a user would. The shell has exported RAY_ADDRESS=auto
    after `ray start --head` (README "A warm local Ray"): every command joins the warm Ray. The directory is
    a git repository holding the project's .gitignore alone, so that `git status` there tells whether the
    README's commands wrote anything a clone would show (``test_after_training``)."""
    root = ignoring_as_the_project_does(tmp_path_factory.mktemp("readme-finetuning"))
    env = {**readme_shell_env(), **warm_rays.running().joining}
    results = []
    for command in readme_block("## Fine-tuning"):
        result = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, env=env,
                                timeout=1500)
        assert result.returncode == 0, f"{command}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        results.append(result)
    return root / "vitsweep-runs", results


@pytest.fixture(scope="session")
def readme_store_server(readme_finetuning) -> Iterator[str]:
    """`mlflow server` on a free loopback port over README "Fine-tuning"'s store: one for the modules that
    browse it (the fine-tuning check, the MLflow UI check after it adds the first sweep and the demo's run)."""
    storage, _ = readme_finetuning
    with mlflow_server(storage / "mlflow-server.log", "--backend-store-uri", f"sqlite:///{storage / 'mlflow.db'}") as uri:
        yield uri


@pytest.fixture
def screenshots(tmp_path) -> Path:
    """Where a browser check saves its screenshots: $VITSWEEP_UI_SCREENSHOTS (`make ui-screenshots`), else tmp."""
    return Path(os.environ.get("VITSWEEP_UI_SCREENSHOTS") or tmp_path)


@pytest.fixture
def browser(server):
    """Chromium on the test module's ``server`` as a first-time visitor: a fresh profile, nothing preset (MLflow
    opens its Assistant panel on a first load), so the model-training mode must come from the link."""
    from webdriver import Browser

    with Browser(width=1400, height=900) as chromium:
        yield chromium


RAY_PROCESSES = ("gcs_server", "raylet", "ray::", "ray-dashboard", "dashboard", "log_monitor")


@contextlib.contextmanager
def processes_started_below(root_pid: int) -> Iterator[set[str]]:
    """The names of the processes that appear below ``root_pid`` (at any depth) while the block runs,
    listed every 20 ms: a local Ray's first process (its GCS server) lives for seconds before a refusal
    could stop it."""
    import psutil

    def below() -> dict[int, str]:
        found = {}
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process(root_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    found[process.pid] = process.name()
        return found

    before, seen = set(below()), set()
    with sampled_every(0.02, lambda: seen.update(name for pid, name in below().items() if pid not in before)):
        yield seen


@contextlib.contextmanager
def sampled_every(every: float, sample: Callable[[], None]) -> Iterator[None]:
    """``sample()`` on a thread every ``every`` s while the block runs, and once more as it ends."""
    done = threading.Event()

    def keep_sampling() -> None:
        while not done.wait(every):
            sample()

    sampler = threading.Thread(target=keep_sampling, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        sample()


def ray_processes(names: set[str]) -> set[str]:
    return {name for name in names if name.startswith(RAY_PROCESSES)}


def refused_in_process(args: list[str], capsys) -> str:
    """``vitsweep ARGS`` run in this process (``main``): it must exit 2 having started no Ray process;
    returns what it printed to stderr."""
    from pipeline.cli import EXIT_INVALID_INPUT, main

    with processes_started_below(os.getpid()) as started:
        code = main(args)
    err = capsys.readouterr().err
    assert code == EXIT_INVALID_INPUT, err
    assert not ray_processes(started), f"a refused command started Ray: {sorted(started)}"
    return err


class RunningVitsweep:
    """A `vitsweep` process in the background, its stdout and stderr collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.mark = uuid.uuid4().hex
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**vitsweep_env(), **(env or {}), PROCESS_MARK: self.mark})
        self.lines: list[str] = []
        self.arrivals: list[float] = []  # when each line arrived (time.monotonic())
        self._new_line = threading.Condition()
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            with self._new_line:
                self.lines.append(line)
                self.arrivals.append(time.monotonic())
                self._new_line.notify_all()
        with self._new_line:
            self.ended = True
            self._new_line.notify_all()

    ended = False  # the command closed its output (it ended)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, text: str, timeout: float = 300) -> None:
        """Returns as the line arrives (woken by the reader, not a poll), else fails naming ``text``."""
        with self._new_line:
            if not self._new_line.wait_for(lambda: self.ended or any(text in line for line in self.lines), timeout):
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for a line with {text!r}")
            if not any(text in line for line in self.lines):
                raise AssertionError(f"the command ended without a line with {text!r}:\n{self.output[-3000:]}")

    def train_workers(self) -> list:
        """This run's Ray Train workers: descendants of the driver (which started Ray in-process)."""
        import psutil

        workers = []
        for process in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if " ".join(process.cmdline()).startswith("ray::RayTrainWorker"):
                    workers.append(process)
            except psutil.NoSuchProcess:
                continue
        return workers

    def processes(self) -> list:
        """Every live process this command started, at any depth (the command itself included)."""
        import psutil

        found = []
        for process in psutil.process_iter():
            try:
                if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(PROCESS_MARK) == self.mark:
                    found.append(process)
            except psutil.Error:  # gone meanwhile, or not ours to read
                continue
        return found

    def finish(self, timeout: float = 600) -> int:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self._reader.join(timeout=10)
        return self.process.returncode


@pytest.fixture(scope="module")
def single_process_group():
    """One gloo rank with the variables a launcher sets and the PATH a CPU worker sets, as a Ray Train worker
    has before ``deepspeed.initialize``; torn down with DeepSpeed's module-level handles on it, so that the
    next module's group is the one DeepSpeed uses (a Ray Train worker has one group for its whole life)."""
    import deepspeed.comm.comm as deepspeed_comm
    import deepspeed.utils.groups as deepspeed_groups
    import torch.distributed as dist

    from pipeline.components.engine import use_the_environments_ninja

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                            "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                            "PATH": os.environ["PATH"]}.items():
            patch.setenv(name, value)
        use_the_environments_ninja()  # as a worker does: DeepSpeed loads its CPU comm op, not rebuilds it
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
            deepspeed_comm.cdb = None  # DeepSpeed's handles on the destroyed group
            deepspeed_groups._WORLD_GROUP = None
