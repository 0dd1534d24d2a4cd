"""The `vitsweep` command: help, exit codes (0 ok, 2 invalid input, 1 failure), doctor, config."""
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import STARTING_ENVIRONMENT, environment_restored, nvml_problem_here, vitsweep_env
from pipeline.cli import EXIT_FAILURE, EXIT_INVALID_INPUT, EXIT_OK, main

REPO = Path(__file__).resolve().parents[1]
VITSWEEP = Path(sys.executable).parent / "vitsweep"


def test_console_script_prints_help_with_every_subcommand():
    result = subprocess.run([str(VITSWEEP), "--help"], capture_output=True, text=True, check=True)
    for command in ("train", "tune", "data", "models", "config", "doctor"):
        assert command in result.stdout


def test_python_dash_m_pipeline_is_the_same_command():
    result = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "doctor" in result.stdout


# A command whose main leaves garbage only the collection at interpreter exit frees (a reference cycle with
# a finalizer, the collector off until then) and an exit handler that prints without flushing.
_ENDING = """
import atexit, gc, sys
import pipeline.cli

class Collected:
    def __del__(self, open=open, path=sys.argv[1]):  # builtins are gone by then
        open(path, "w").close()

def main():
    gc.disable()
    cycle = Collected()
    cycle.self = cycle
    atexit.register(lambda: print("exit handler ran", end=""))
    return 3

pipeline.cli.main = main
{end}
"""


@pytest.mark.parametrize("end, collected", [("pipeline.cli.entry_point()", False), ("sys.exit(main())", True)],
                         ids=["entry point", "plain exit"])
def test_the_command_ends_once_its_exit_handlers_ran_skipping_pythons_last_collection(tmp_path, end, collected):
    """The installed script and `python -m pipeline` end in ``entry_point``: with main's exit code, after
    the exit handlers (Ray's shutdown, the log files) and their output, without the seconds Python's
    last garbage collection takes after a training command (the plain exit, the control, pays them)."""
    marker = tmp_path / "collected"
    program = _ENDING.format(end=end)
    result = subprocess.run([sys.executable, "-c", program, str(marker)], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (3, "exit handler ran", "")
    assert marker.exists() is collected
    script = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="console_scripts")}
    assert script["vitsweep"] == "pipeline.cli:entry_point"
    assert (REPO / "pipeline" / "__main__.py").read_text().endswith("\nentry_point()\n")


@pytest.mark.parametrize("end", ["pipeline.cli.entry_point()", "sys.exit(main())"], ids=["entry point", "plain exit"])
@pytest.mark.parametrize("exit_call, code, stderr", [("sys.exit(4)", 4, ""), ("sys.exit()", 0, ""),
                                                      ("sys.exit('no such thing')", 1, "no such thing\n")],
                         ids=["code 4", "no code", "message"])  # ids without a newline: xdist cannot track one
def test_a_library_exiting_inside_the_command_ends_it_with_the_code_python_gives(end, exit_call, code, stderr):
    program = f"import sys\nimport pipeline.cli\ndef main():\n    {exit_call}\npipeline.cli.main = main\n{end}\n"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (code, stderr)


def test_doctor_reports_each_component_and_passes_here(tmp_path):
    result = subprocess.run(
        [str(VITSWEEP), "doctor", "--set", f"run.storage_path={tmp_path}"],
        capture_output=True, text=True, env={**_env(), "MLFLOW_TRACKING_URI": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for component in ("torch", "deepspeed", "ffcv", "ray", "mlflow", "disk"):
        assert f"ok  {component}" in result.stdout
    assert "accelerator cpu" in result.stdout and "GPUs: 0" in result.stdout


def test_doctor_fails_when_the_mlflow_server_is_unreachable(tmp_path):
    code = main(["doctor", "--set", "tracking.mlflow_uri=http://127.0.0.1:9", "--set", f"run.storage_path={tmp_path}"])
    assert code == EXIT_FAILURE


def test_doctor_on_a_head_node_skips_the_gpu_check_of_a_gpu_job_and_says_why(tmp_path, capsys):
    code = main(["doctor", "--node", "head", "--config", str(REPO / "cluster" / "jobs" / "a100_8x8.yaml"),
                 "--set", f"run.storage_path={tmp_path}"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    (line,) = [line for line in out.splitlines() if " gpu " in line]
    assert line.startswith("skip  gpu") and "the head runs no GPU work" in line
    (line,) = [line for line in out.splitlines() if " gpu_metrics " in line]
    assert line.startswith("skip  gpu_metrics") and "each GPU node reports its own" in line
    (line,) = [line for line in out.splitlines() if " nccl_hangs " in line]
    assert line.startswith("skip  nccl_hangs") and "the head runs no collective" in line
    assert "8/8 checks passed, 3 skipped on a head node" in out


def test_doctor_before_ray_starts_on_a_gpu_node_checks_its_driver_whatever_the_config(capsys):
    # No tracking server answers at that URI and the default config trains on CPUs: neither matters there.
    code = main(["doctor", "--node", "gpu-driver", "--set", "tracking.mlflow_uri=http://127.0.0.1:9"])
    out = capsys.readouterr().out
    checked = {line.split()[1]: line.split()[0] for line in out.splitlines() if line[:6].strip() in ("ok", "FAIL", "skip")}
    assert checked == {"python": "ok", "torch": "ok", "gpu": checked["gpu"], "gpu_metrics": "skip", "nccl_hangs": "skip",
                       "timm": "skip", "deepspeed": "skip", "ffcv": "skip", "ray": "skip", "mlflow": "skip",
                       "disk": "skip"}
    assert code == (EXIT_OK if checked["gpu"] == "ok" else EXIT_FAILURE)


def test_doctor_on_a_gpu_worker_says_whether_mlflow_will_record_its_gpus(tmp_path, capsys, monkeypatch):
    def gpu_metrics_line() -> str:
        main(["doctor", "--node", "gpu-worker", "--set", f"run.storage_path={tmp_path}", "--set", "tracking.mlflow_uri=null"])
        (line,) = [line for line in capsys.readouterr().out.splitlines() if " gpu_metrics " in line]
        return line

    problem = nvml_problem_here()  # here: no NVIDIA driver
    if problem is None:
        assert gpu_metrics_line().startswith("  ok  gpu_metrics MLflow records the metrics of ")
    else:
        assert gpu_metrics_line() == ("FAIL  gpu_metrics GpuMetricsUnavailable: NVML cannot start "
                                      f"({problem}): MLflow records no GPU metrics on this node")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # an image without nvidia-ml-py
    assert gpu_metrics_line() == ("FAIL  gpu_metrics GpuMetricsUnavailable: nvidia-ml-py is not installed "
                                  "(pip install nvidia-ml-py): MLflow records no GPU metrics on this node")


def test_doctor_refuses_a_node_role_it_does_not_know_naming_the_roles(capsys):
    assert main(["doctor", "--node", "gpu"]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert "'gpu'" in err and all(role in err for role in ("head", "gpu-worker", "gpu-driver"))


def test_invalid_config_exits_2_and_names_the_key(capsys):
    assert main(["config", "show", "--set", "optim.lr=-1"]) == EXIT_INVALID_INPUT
    assert "optim.lr" in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["config", "show", "--config", str(tmp_path / "missing.yaml")]) == EXIT_INVALID_INPUT
    assert "missing.yaml" in capsys.readouterr().err


def test_usage_error_exits_2():
    assert main(["config", "frobnicate"]) == EXIT_INVALID_INPUT


def test_config_show_prints_yaml_that_reloads_to_the_same_config(tmp_path, capsys):
    assert main(["config", "show", "--config", "smoke", "--set", "optim.lr=2e-4"]) == EXIT_OK
    path = tmp_path / "shown.yaml"
    path.write_text(capsys.readouterr().out)
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == pytest.approx(2e-4)
    assert main(["config", "show", "--config", str(path), "--flat"]) == EXIT_OK
    assert "optim.lr=0.0002" in capsys.readouterr().out.splitlines()


def test_config_validate_builds_the_model_on_meta(capsys):
    assert main(["config", "validate", "--config", "smoke"]) == EXIT_OK
    assert "parameters" in capsys.readouterr().out


def test_config_validate_rejects_an_unknown_constructor_argument(capsys):
    assert main(["config", "validate", "--set", "model.args.no_such_knob=3"]) == EXIT_INVALID_INPUT
    assert "model.args" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [None, "0"], ids=["two workers", "TEST_WORKERS=0"])
def test_make_test_fails_when_a_test_fails(tmp_path, workers):
    (tmp_path / "test_broken.py").write_text("def test_broken():\n    assert 1 == 2\n")
    result = _make_test(tmp_path / "test_broken.py", *([f"TEST_WORKERS={workers}"] if workers else []))
    assert result.returncode != 0 and "1 failed" in result.stdout
    assert ("created: 2/2 workers" in result.stdout) == (workers is None), result.stdout  # README "Development"


def test_make_test_fails_when_no_test_is_collected(tmp_path):
    (tmp_path / "test_empty.py").write_text("# no tests here\n")
    result = _make_test(tmp_path / "test_empty.py")
    assert result.returncode != 0 and "collected no tests" in result.stderr


@pytest.mark.parametrize("where,built_for", [("TORCH_EXTENSIONS_DIR/op", "this venv"),
                                             ("default cache/build/op", "this venv"),
                                             ("default cache/build/op", "another clone's venv")])
def test_make_setup_builds_deepspeeds_cpu_comm_op_only_where_none_is_built_for_this_venv(tmp_path, where, built_for):
    # torch builds into $TORCH_EXTENSIONS_DIR/<op> where it is set, else into ~/.cache/torch_extensions/<build>/<op>;
    # its build file names the venv whose torch it compiled against
    built = (tmp_path if where == "TORCH_EXTENSIONS_DIR/op" else tmp_path / "py311_cu132") / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    venv = REPO / ".venv" if built_for == "this venv" else tmp_path / "another-clone" / ".venv"
    (built / "build.ninja").write_text(f"cflags = -isystem {venv}/lib/python3.11/site-packages/torch/include\n")
    # CXX=false (torch's build file compiles with $CXX): a build that starts fails at once
    result = subprocess.run(["make", "--no-print-directory", "deepspeed-cpu-ops"], cwd=REPO, capture_output=True,
                            text=True, env={**_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false"})
    if built_for == "this venv":
        assert result.returncode == 0 and "building" not in result.stdout, result.stdout + result.stderr
    else:  # the first worker would rebuild it (and every other wait on its lock): setup does, for this venv
        assert "building DeepSpeed's CPU comm op for this environment" in result.stdout, result.stdout + result.stderr
        assert result.returncode != 0 and "failed to build" in result.stderr, result.stdout + result.stderr


def test_ci_runs_exactly_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make test" in ci.splitlines()[-1]
    assert "make test" in readme


def test_make_mutation_refuses_a_module_outside_the_core_ones_before_installing_anything():
    result = subprocess.run(["make", "--no-print-directory", "mutation", "MODULE=pipeline.training.worker"],
                            cwd=REPO, capture_output=True, text=True, env=_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MODULE=pipeline.training.worker is not one of: pipeline.components.metrics pipeline.components.losses" in result.stderr


def test_the_readme_mutation_command_names_a_module_make_mutation_accepts():
    (module,) = re.findall(r"`make mutation MODULE=(\S+)`", (REPO / "README.md").read_text())
    result = subprocess.run(["make", "--no-print-directory", "mutation-module", f"MODULE={module}"],
                            cwd=REPO, capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def _make_test(target: Path, *make_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "test", f"PYTEST_ARGS=-p no:cacheprovider {target}", *make_args],
        cwd=REPO, capture_output=True, text=True, env=_env(),
    )



# What quiet_environment sets (pipeline.console): a command run in-process puts them in pytest's os.environ.
QUIET_SETTINGS = ("RAY_DEDUP_LOGS", "RAY_AIR_NEW_OUTPUT", "RAY_TRAIN_ENABLE_PRINT_PATCH", "TQDM_DISABLE",
                  "MLFLOW_CONFIGURE_LOGGING", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "MLFLOW_DISABLE_TELEMETRY")


def test_a_command_run_in_process_leaves_nothing_for_later_tests_or_the_commands_they_start(capsys):
    """The console tests of real runs (test_training, test_tune_e2e) see library noise only where the
    command itself fails to quiet it: nothing a command run in-process set may reach their commands,
    nor the next test."""
    before = {key for key in QUIET_SETTINGS if key in os.environ}
    with environment_restored():
        assert main(["train", "--config", "smoke", "--set", "optim.lrr=1"]) == EXIT_INVALID_INPUT  # quiets, refuses
        assert all(key in os.environ for key in QUIET_SETTINGS)  # the command set them here
        leaked = {key for key in QUIET_SETTINGS if key in vitsweep_env() and key not in STARTING_ENVIRONMENT}
        assert not leaked, leaked
    assert {key for key in QUIET_SETTINGS if key in os.environ} == before


def test_doctor_on_a_gpu_worker_says_whether_ray_can_detect_an_nccl_hang_there(tmp_path, capsys, monkeypatch):
    def nccl_line() -> str:
        main(["doctor", "--node", "gpu-worker", "--set", f"run.storage_path={tmp_path}", "--set", "tracking.mlflow_uri=null"])
        (line,) = [line for line in capsys.readouterr().out.splitlines() if " nccl_hangs " in line]
        return line

    monkeypatch.setenv("PATH", str(tmp_path))  # no ncclras here
    assert nccl_line().startswith("  ok  nccl_hangs  ncclras not found on PATH: Ray Train's NCCL hang detector cannot")
    client = tmp_path / "ncclras"
    client.write_text("#!/bin/sh\n")
    client.chmod(0o755)
    assert nccl_line() == f"  ok  nccl_hangs  {client} (NCCL hangs fail the run after 600 s)"
