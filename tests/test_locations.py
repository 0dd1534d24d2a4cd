"""Every place a command creates or writes is checked before anything starts: a path below a file, a
directory that cannot be created (/proc, a read-only mount) or a directory given for a file is bad
input (exit 2) naming the setting, the path and the reason, never a traceback from the library that
would have tripped over it."""
import pytest

from pipeline.cli import EXIT_INVALID_INPUT, main
from pipeline.config.loading import load_config
from pipeline.errors import InvalidInputError
from pipeline.training.locations import check_can_create, run_directories
from pipeline.tracking.connection import check_reachable

UNCREATABLE = "/proc/vitsweep-test/runs"  # /proc refuses every mkdir, even root's


def test_a_storage_path_that_cannot_be_created_is_named_with_the_reason():
    cfg = load_config("smoke", [f"run.storage_path={UNCREATABLE}"])
    with pytest.raises(InvalidInputError, match=r"run.storage_path: '/proc/vitsweep-test/runs' cannot be created: "
                                                 r"the system refuses to create a directory in '/proc'"):
        check_can_create(run_directories(cfg))


def test_a_cache_directory_below_a_file_is_named_by_its_variable(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("a file")
    monkeypatch.setenv("VITSWEEP_CACHE_DIR", str(tmp_path / "config.yaml" / "cache"))
    cfg = load_config("smoke", [f"run.storage_path={tmp_path / 'runs'}"])
    with pytest.raises(InvalidInputError, match="the record of verified datasets: .*config.yaml' is a file, so "
                                                "nothing can exist below it"):
        check_can_create(run_directories(cfg))


def test_a_writable_directory_passes_and_the_check_leaves_nothing_behind(tmp_path):
    cfg = load_config("smoke", [f"run.storage_path={tmp_path / 'runs'}"])
    check_can_create(run_directories(cfg))
    assert list(tmp_path.iterdir()) == []


def test_a_run_lists_its_storage_the_datasets_it_prepares_the_staging_cache_and_the_verified_record(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VITSWEEP_CACHE_DIR", str(tmp_path / "node-cache"))
    cfg = load_config("smoke", [f"run.storage_path={tmp_path / 'runs'}", f"data.train={tmp_path / 'd' / 't.beton'}",
                                "data.val=s3://bucket/v.beton", "data.prepare=null"])
    assert run_directories(cfg) == {"run.storage_path": str(tmp_path / "runs"),
                                    "$VITSWEEP_CACHE_DIR": tmp_path / "node-cache",
                                    "the record of verified datasets": tmp_path / "node-cache"}
    prepared = load_config("smoke", [f"run.storage_path={tmp_path / 'runs'}", f"data.train={tmp_path / 'd' / 't.beton'}",
                                     f"data.val={tmp_path / 'v' / 'v.beton'}"])
    assert run_directories(prepared)["data.train (written by data.prepare)"] == tmp_path / "d"
    assert run_directories(prepared)["data.val (written by data.prepare)"] == tmp_path / "v"


def test_a_sweep_also_lists_its_own_storage(tmp_path):
    cfg = load_config("smoke", [f"run.storage_path={tmp_path / 'runs'}", f"tune.storage_path={UNCREATABLE}"])
    with pytest.raises(InvalidInputError, match="tune.storage_path: '/proc/vitsweep-test/runs' cannot be created"):
        check_can_create(run_directories(cfg, sweep=True))


def test_an_mlflow_store_that_cannot_be_created_is_named():
    with pytest.raises(ConnectionError, match="MLflow store sqlite:////proc/vitsweep-test/mlflow.db: "
                                              "'/proc/vitsweep-test' cannot be created"):
        check_reachable("sqlite:////proc/vitsweep-test/mlflow.db")


def test_tune_with_an_uncreatable_sweep_directory_exits_2_before_anything_starts(tmp_path, capsys):
    code = main(["tune", "--config", "smoke", "--space", "lr_wd", "--set", f"run.storage_path={tmp_path / 'runs'}",
                 "--set", f"tune.storage_path={UNCREATABLE}", "--set", "tune.scheduler=fifo"])
    assert code == EXIT_INVALID_INPUT
    assert "tune.storage_path: '/proc/vitsweep-test/runs' cannot be created" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_data_write_below_a_file_exits_2_naming_it(tmp_path, capsys):
    (tmp_path / "file.yaml").write_text("a file")
    assert main(["data", "write", "digits", str(tmp_path / "file.yaml" / "x.beton"), "--split", "val"]) == \
        EXIT_INVALID_INPUT
    assert f"OUT.beton: '{tmp_path / 'file.yaml'}' is a file, so nothing can exist below it" in capsys.readouterr().err


def test_data_write_where_no_directory_can_be_created_exits_2(capsys):
    assert main(["data", "write", "digits", f"{UNCREATABLE}/x.beton", "--split", "val"]) == EXIT_INVALID_INPUT
    assert "OUT.beton: '/proc/vitsweep-test/runs' cannot be created" in capsys.readouterr().err


def test_data_write_onto_a_directory_exits_2_saying_it_is_one(tmp_path, capsys):
    (tmp_path / "x.beton").mkdir()
    assert main(["data", "write", "digits", str(tmp_path / "x.beton"), "--split", "val"]) == EXIT_INVALID_INPUT
    assert "x.beton' is a directory, and a file is needed here" in capsys.readouterr().err


def test_data_inspect_of_a_directory_and_a_grid_that_cannot_be_written_exit_2(tmp_path, capsys, digits16):
    assert main(["data", "inspect", str(tmp_path)]) == EXIT_INVALID_INPUT
    assert f"FILE.beton: '{tmp_path}' is a directory, and a file is needed here" in capsys.readouterr().err
    assert main(["data", "inspect", str(digits16["val"]), "--grid", f"{UNCREATABLE}/grid.png"]) == EXIT_INVALID_INPUT
    assert "--grid: '/proc/vitsweep-test/runs' cannot be created" in capsys.readouterr().err


def test_data_stage_into_a_cache_that_cannot_be_created_exits_2(capsys, digits16):
    assert main(["data", "stage", str(digits16["val"]), "--cache-dir", UNCREATABLE]) == EXIT_INVALID_INPUT
    assert "--cache-dir: '/proc/vitsweep-test/runs' cannot be created" in capsys.readouterr().err


def test_data_prepare_into_a_directory_that_cannot_be_created_exits_2(capsys):
    assert main(["data", "prepare", "--config", "smoke", "--set", f"data.train={UNCREATABLE}/t.beton"]) == \
        EXIT_INVALID_INPUT
    assert "data.train: '/proc/vitsweep-test/runs' cannot be created" in capsys.readouterr().err


def test_doctor_fails_the_disk_check_naming_a_storage_path_that_cannot_be_created(capsys):
    assert main(["doctor", "--set", f"run.storage_path={UNCREATABLE}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  disk" in out and "run.storage_path: '/proc/vitsweep-test/runs' cannot be created" in out
