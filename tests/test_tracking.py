"""MLflow helpers: the final model is logged without leaking a tracking URI into the process; a URI
never carries a password into params or output; runs started at once share what they both create."""
import contextlib
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch

from conftest import nvml_problem_here
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.trained.serving import log_model
from pipeline.components.model_card import ModelCard
from pipeline.tracking.connection import DEFAULT_STORE_NAME, local_artifact_root, resolve_tracking_uri
from pipeline.tracking.store import MlflowStore
from pipeline.tracking.system_metrics import monitor_node_system


def test_a_password_in_mlflow_tracking_uri_is_rejected_without_echoing_it(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cret@mlflow.example.com")
    with pytest.raises(InvalidInputError) as err:
        resolve_tracking_uri(load_config("default"))
    assert "MLFLOW_TRACKING_PASSWORD" in str(err.value) and "s3cret" not in str(err.value)


def test_experiments_of_a_local_store_keep_their_artifacts_beside_it(tmp_path):
    store = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = store.client.get_experiment(store.experiment_id("vitsweep"))
    assert experiment.artifact_location == local_artifact_root(store.uri) == (tmp_path / "mlartifacts").as_uri()
    assert store.experiment_id("vitsweep") == experiment.experiment_id  # found again, not created twice


def test_logging_the_final_model_leaves_no_tracking_uri_for_later_subprocesses(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = MlflowStore(uri).create_run("vitsweep", "logs-a-model")
    client, run_id = run.client, run.run_id
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    card = ModelCard.of_run(load_config("smoke", ["model.img_size=8"]), num_classes=2)

    log_model(run, model, [weights], card, step=1)

    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert mlflow.get_tracking_uri() == "sqlite:///elsewhere.db"  # no global left behind either
    assert [a.path for a in client.list_artifacts(run_id)] == ["model.safetensors"]
    assert client.get_run(run_id).outputs.model_outputs  # the mlflow.pytorch model


def test_a_malformed_mlflow_tracking_uri_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://[::1:5000")
    with pytest.raises(InvalidInputError, match="MLFLOW_TRACKING_URI is not a valid URI"):
        resolve_tracking_uri(load_config("default"))


def test_a_nodes_system_metrics_get_a_sample_when_its_monitor_stops_before_the_first_interval(tmp_path):
    # A run shorter than one sampling interval (a 1-epoch sweep trial) still has each node's metrics.
    run = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db").create_run("vitsweep", "shorter-than-an-interval")
    monitor = monitor_node_system(run.uri, run.run_id, "node0", interval_s=3600)
    monitor.finish()
    history = run.metric_history("system/node0/cpu_utilization_percentage")
    assert len(history) == 1 and 0 <= history[0].value <= 100
    assert run.metric_history("system/node0/system_memory_usage_megabytes")[0].value > 0


def test_a_gpu_nodes_monitor_says_in_the_runs_log_when_it_can_record_no_gpu_metrics(tmp_path, caplog):
    # MLflow says it at INFO only, below the level the run's log keeps (vitsweep raises it to WARNING).
    run = MlflowStore(f"sqlite:///{tmp_path}/mlflow.db").create_run("vitsweep", "a-gpu-node")
    monitor = monitor_node_system(run.uri, run.run_id, "node0", interval_s=3600, gpus=True)
    monitor.finish()
    said = [r.getMessage() for r in caplog.records if r.name == "mlflow.system_metrics" and r.levelname == "WARNING"]
    problem = nvml_problem_here()  # here: no NVIDIA driver
    expected = [] if problem is None else [f"node0: NVML cannot start ({problem}): MLflow records no GPU metrics on this node"]
    assert said == expected


def test_a_node_without_the_local_store_monitors_nothing_and_creates_no_store_of_its_own(tmp_path):
    # A worker on another node than the driver's: the store's file is on the driver's disk, not here.
    elsewhere = tmp_path / "on-the-drivers-node" / DEFAULT_STORE_NAME
    assert monitor_node_system(f"sqlite:///{elsewhere}", "0" * 32, "node1") is None
    assert not elsewhere.parent.exists()


def _in_processes(task, count: int = 2) -> list:
    """``task(i, go)`` in ``count`` forked processes, each calling ``go()`` once it is set up, which releases
    them all together: what each returned, or the error it raised. This process opens the store only after
    they end: MLflow caches a store's SQLite connections, and those must not cross a fork."""
    fork = multiprocessing.get_context("fork")
    ready, outcomes = fork.Barrier(count), fork.Queue()

    def one(i):
        try:
            outcomes.put((i, task(i, ready.wait)))
        except Exception as error:  # noqa: BLE001  (the error is the assertion's message)
            outcomes.put((i, f"{type(error).__name__}: {error}"))

    processes = [fork.Process(target=one, args=(i,)) for i in range(count)]
    for process in processes:
        process.start()
    results = sorted(outcomes.get(timeout=120) for _ in processes)
    for process in processes:
        process.join()
    return [value for _, value in results]


def test_runs_logging_the_same_new_dataset_at_once_both_link_to_it(tmp_path):
    # A sweep's first trials log the sweep's dataset together; MLflow looks for it, then inserts it.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _in_processes(lambda i, go: MlflowStore(uri).experiment_id("vitsweep"), count=1)

    def log(i, go):
        run = MlflowStore(uri).create_run("vitsweep", f"trial{i}")
        go()
        run.log_datasets({"training": ("/data/train.beton", "a" * 64), "validation": ("/data/val.beton", "b" * 64)})
        return run.run_id

    run_ids = _in_processes(log)
    assert all(len(run_id) == 32 for run_id in run_ids), run_ids
    client = MlflowStore(uri).client
    linked = [sorted(i.dataset.name for i in client.get_run(run_id).inputs.dataset_inputs) for run_id in run_ids]
    assert linked == [["train.beton", "val.beton"]] * 2


def test_commands_starting_at_once_into_a_new_experiment_both_run_in_it(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _in_processes(lambda i, go: MlflowStore(uri).experiment_names(), count=1)  # the store exists; the experiment is new

    def start(i, go):
        store = MlflowStore(uri)
        store.experiment_names()
        go()
        return store.create_run("new-experiment", f"run{i}").run_id

    run_ids = _in_processes(start)
    assert all(len(run_id) == 32 for run_id in run_ids), run_ids
    store = MlflowStore(uri)
    assert {run.info.run_id for run in store.search(store.experiment_id("new-experiment"), "")} == set(run_ids)


def _schema_revision(database: Path) -> str | None:
    """The MLflow schema revision ``database`` is at, read while another process may be migrating it."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=0.1)) as db:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:  # not a database yet, no such table yet, or locked by the migration
        return None
    return row[0] if row else None


def _cut_short_while_migrating(code: str, tmp_path: Path) -> None:
    """Run ``code`` in a new interpreter (its temporary directory under ``tmp_path``) and SIGKILL it as soon
    as a SQLite file under ``tmp_path`` is part-way through MLflow's schema migrations."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    head, scratch = _get_latest_schema_revision(), tmp_path / "tmp"
    scratch.mkdir()
    creating = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(scratch)},
                                cwd=Path(__file__).parents[1], stderr=subprocess.DEVNULL)
    while creating.poll() is None and not any(_schema_revision(db) not in (None, head) for db in tmp_path.rglob("*.db")):
        time.sleep(0.02)
    assert creating.poll() is None, "the store was created before the test could cut its creation short"
    creating.kill()
    creating.wait()


def test_a_new_store_whose_creation_is_cut_short_is_left_absent_and_the_next_command_creates_it(tmp_path):
    """MLflow creates a SQLite store's tables by ~4 s of migrations; a command ended meanwhile (the
    driver's checks open the store on a thread that dies with it) must not leave a half-migrated file,
    which MLflow refuses ever after as an "out-of-date database schema"."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    store = tmp_path / "runs" / DEFAULT_STORE_NAME
    uri = f"sqlite:///{store}"
    _cut_short_while_migrating(f"from pipeline.tracking.store import MlflowStore; MlflowStore({uri!r})", tmp_path)

    assert not store.exists() and not list(store.parent.iterdir())  # no half store, nor a partial copy beside
    assert MlflowStore(uri).experiment_id("vitsweep")  # the next command creates it whole
    assert _schema_revision(store) == _get_latest_schema_revision()


def test_a_store_left_half_created_is_refused_in_one_line_saying_what_to_do(tmp_path):
    # The file CI's interrupted command left before stores were built whole: every table made, its last
    # migration not recorded (the revision CI's store stopped at), no run.
    store = tmp_path / DEFAULT_STORE_NAME
    uri = f"sqlite:///{store}"
    MlflowStore(uri)
    with contextlib.closing(sqlite3.connect(store)) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '75868b020152'")

    # The next command, a new process (MLflow keeps the store it opened in this one).
    opening = subprocess.run([sys.executable, "-c", f"from pipeline.tracking.store import MlflowStore; MlflowStore({uri!r})"],
                             capture_output=True, text=True, cwd=Path(__file__).parents[1])
    last = opening.stderr.strip().splitlines()[-1]
    assert last.startswith("pipeline.errors.InvalidInputError: "), opening.stderr[-3000:]
    problem = last.removeprefix("pipeline.errors.InvalidInputError: ")
    assert problem.startswith(f"MLflow store {uri} cannot be opened: its schema is at revision 75868b020152, "
                              f"MLflow {mlflow.__version__}'s at "), problem
    assert "\n" not in problem and "holds 0 run(s)" in problem, problem
    assert f"move {store} aside" in problem and f"`mlflow db upgrade {uri}`" in problem, problem


def test_commands_starting_at_once_into_a_new_store_both_run_in_it(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def start(i, go):
        go()  # both open the store at once: neither finds it
        return MlflowStore(uri).create_run("vitsweep", f"run{i}").run_id

    run_ids = _in_processes(start)
    assert all(len(run_id) == 32 for run_id in run_ids), run_ids
    store = MlflowStore(uri)
    assert {run.info.run_id for run in store.search(store.experiment_id("vitsweep"), "")} == set(run_ids)
    assert sorted(path.name for path in tmp_path.iterdir()) == [DEFAULT_STORE_NAME]


def _imported(modules: str, libraries: set[str]) -> list[str]:
    """Which of ``libraries`` importing ``modules`` imports, in a fresh interpreter."""
    probe = f"import sys, {modules}; print(sorted(set({sorted(libraries)}) & set(sys.modules)))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1]).stdout.strip()


def test_what_ray_trains_controller_and_workers_import_first_stays_off_each_runs_start():
    """Ray Train's controller imports the modules of its callbacks (the epoch logger; a sweep trial's
    report to Tune) before it starts any worker, and each worker the recipe's before its first line:
    torch, timm or ffcv in the first, MLflow in the second (a node's system-metrics monitor imports it on a
    thread of its own) would add seconds to every run's start on a small machine."""
    controller = "pipeline.training.epoch_logger, pipeline.tracking.store, pipeline.sweeps.tune_callback"
    assert _imported(controller, {"torch", "timm", "ffcv", "deepspeed"}) == "[]"
    assert _imported("pipeline.training.worker", {"mlflow"}) == "[]"


def test_a_commands_mlflow_starts_no_telemetry_thread_whose_offline_failure_breaks_a_request():
    """MLflow's telemetry thread, failing to fetch its settings offline, unsets an environment variable while a
    request reads the environment (seen: `vitsweep evaluate` on a simulated KubeRay head, "failed with
    exception '_MLFLOW_TELEMETRY_SESSION_ID'"). In an environment MLflow does not take for a test or CI (the
    commands of a cluster's nodes), a command's settings leave it off."""
    probe = ("from pipeline.console import quiet_environment; quiet_environment(); import mlflow, threading; "
             "from mlflow.telemetry import get_telemetry_client; "
             "print(get_telemetry_client() is None, [t.name for t in threading.enumerate() if 'Telemetry' in t.name])")
    clean = {key: value for key, value in os.environ.items()
             if key not in ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=clean,
                            cwd=Path(__file__).parents[1])
    assert result.stdout.strip() == "True []", result.stdout + result.stderr[-2000:]


def test_a_runs_description_reads_as_prose_counting_its_epochs(tmp_path):
    """What the MLflow UI shows first: "1 epoch" (not "1 epochs"), the model's arguments as key=value."""
    from pipeline.training.runs import CheckedRun, ModelFacts, ResolvedData, describe_run

    for epochs, counted in ((1, "1 epoch on"), (2, "2 epochs on")):
        cfg = load_config("smoke", [f"optim.epochs={epochs}", "model.args.qkv=fsne", "model.args.code_size=8"])
        run = CheckedRun(cfg, ResolvedData("train.beton", "val.beton", 10), ModelFacts.measure(cfg.model, 10),
                         "described", str(tmp_path), f"sqlite:///{tmp_path}/mlflow.db")
        text = describe_run(run)
        assert text.startswith("**xcit_nano_12_p8** (xcit, paper 003, depth=2, qkv=fsne, code_size=8): "), text
        assert counted in text and "; 2 CPU workers, DeepSpeed" in text, text
