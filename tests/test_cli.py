"""The `vitsweep` command: help, exit codes (0 ok, 2 invalid input, 1 failure), doctor, config."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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


def test_make_test_fails_when_a_test_fails(tmp_path):
    (tmp_path / "test_broken.py").write_text("def test_broken():\n    assert 1 == 2\n")
    result = _make_test(tmp_path / "test_broken.py")
    assert result.returncode != 0 and "1 failed" in result.stdout


def test_make_test_fails_when_no_test_is_collected(tmp_path):
    (tmp_path / "test_empty.py").write_text("# no tests here\n")
    result = _make_test(tmp_path / "test_empty.py")
    assert result.returncode != 0 and "collected no tests" in result.stderr


def test_ci_runs_exactly_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make test" in ci.splitlines()[-1]
    assert "make test" in readme


def test_make_mutation_refuses_a_module_outside_the_core_ones_before_installing_anything():
    result = subprocess.run(["make", "--no-print-directory", "mutation", "MODULE=pipeline.worker"],
                            cwd=REPO, capture_output=True, text=True, env=_env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MODULE=pipeline.worker is not one of: pipeline.metrics pipeline.losses" in result.stderr


def test_the_readme_mutation_command_names_a_module_make_mutation_accepts():
    (module,) = re.findall(r"`make mutation MODULE=(\S+)`", (REPO / "README.md").read_text())
    result = subprocess.run(["make", "--no-print-directory", "mutation-module", f"MODULE={module}"],
                            cwd=REPO, capture_output=True, text=True, env=_env())
    assert result.returncode == 0, result.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}


def _make_test(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "test", f"PYTEST_ARGS=-p no:cacheprovider {target}"],
        cwd=REPO, capture_output=True, text=True, env=_env(),
    )
