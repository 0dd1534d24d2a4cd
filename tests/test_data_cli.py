"""`vitsweep data ...` and prepare_digits: offline on a fresh machine, exit 2 on bad input."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from conftest import ignoring_as_the_project_does, readme_block, readme_shell_env, untracked_by_git

from pipeline.cli import EXIT_INVALID_INPUT, EXIT_OK, main
from pipeline.config.schema import DataConfig
from pipeline.data.prepare import prepare_digits
from pipeline.data.sidecar import read_sidecar
from pipeline.errors import InvalidInputError

VITSWEEP = Path(sys.executable).parent / "vitsweep"


def test_write_digits_then_inspect_works_offline_and_saves_a_sample_grid(tmp_path):
    beton = tmp_path / "digits_train.beton"
    written = subprocess.run(
        [str(VITSWEEP), "data", "write", "digits", str(beton), "--split", "train", "--img-size", "16", "--workers", "2"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert written.returncode == 0, written.stderr
    assert "1437 samples, 10 classes" in written.stdout
    inspected = subprocess.run([str(VITSWEEP), "data", "inspect", str(beton)], capture_output=True, text=True,
                               cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["digits_train.beton", "digits_train.beton.json"]
    inspected = subprocess.run([str(VITSWEEP), "data", "inspect", str(beton), "--samples", "9",
                                "--grid", "grid.png"], capture_output=True, text=True, cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert "1437 in 10 classes" in inspected.stdout and "sha256" in inspected.stdout
    counts = read_sidecar(beton).counts_per_class
    assert all(f"  {digit}  {counts[digit]}" in inspected.stdout for digit in counts)
    grid = Image.open(tmp_path / "grid.png")
    assert grid.size == (3 * 96, 3 * (96 + 14))
    assert "Exception ignored" not in inspected.stderr + written.stderr


def test_the_readmes_offline_data_commands_run_as_written_and_leave_nothing_for_git(tmp_path):
    """README "Data": its offline lines (write digits, inspect them with a grid) run as written, in a
    directory that ignores what the project's .gitignore does: the dataset, its sidecar and the grid are
    written, and `git status` shows none of them."""
    offline = ("vitsweep data write digits ", "vitsweep data inspect train.beton ")
    lines = [line for line in readme_block("## Data") if line.startswith(offline)]
    assert len(lines) == 2, lines
    home = ignoring_as_the_project_does(tmp_path)
    for line in lines:
        result = subprocess.run(["bash", "-c", line], cwd=home, env=readme_shell_env(), capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
    grid = re.search(r"--grid (\S+)", lines[1]).group(1)
    assert Image.open(home / grid).size[0] > 0 and (home / "train.beton.json").is_file()
    assert untracked_by_git(home) == []


def test_write_of_a_missing_source_exits_2_naming_it(tmp_path, capsys):
    assert main(["data", "write", str(tmp_path / "no_such_dir"), str(tmp_path / "x.beton")]) == EXIT_INVALID_INPUT
    assert "no_such_dir" in capsys.readouterr().err
    assert not (tmp_path / "x.beton").exists()


def test_write_option_out_of_range_exits_2_naming_the_flag(tmp_path, capsys):
    code = main(["data", "write", "digits", str(tmp_path / "x.beton"), "--split", "val", "--jpeg-quality", "101"])
    assert code == EXIT_INVALID_INPUT and "--jpeg-quality" in capsys.readouterr().err


def test_write_of_an_imagefolder_warns_about_skipped_files_on_stderr(tmp_path, capsys):
    (tmp_path / "src" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8), "red").save(tmp_path / "src" / "cat" / "a.png")
    (tmp_path / "src" / "cat" / "notes.txt").write_text("not an image")
    assert main(["data", "write", str(tmp_path / "src"), str(tmp_path / "x.beton"), "--workers", "1"]) == EXIT_OK
    assert f"warning: skipped 1 file(s) under {str(tmp_path / 'src')!r} that are not readable images" in \
        capsys.readouterr().err


def test_inspect_of_a_truncated_file_exits_2_naming_it(tmp_path, capsys):
    beton = tmp_path / "d.beton"
    assert main(["data", "write", "digits", str(beton), "--split", "val", "--img-size", "8", "--workers", "1"]) == EXIT_OK
    beton.write_bytes(beton.read_bytes()[:-10])
    capsys.readouterr()
    assert main(["data", "inspect", str(beton)]) == EXIT_INVALID_INPUT
    assert "d.beton" in capsys.readouterr().err


@pytest.mark.parametrize("flag, given, message", [
    ("--grid", "samples", "--grid {path}: name an image file (.png, .jpg, ...)"),  # no suffix: Pillow has no format
    ("--grid", "grid.txt", "--grid {path}: name an image file"),
    ("--export", "a-file/samples", "--export: '{path.parent}' is a file, so nothing can exist below it"),
])
def test_inspect_refuses_an_output_it_cannot_write_before_reading_the_file(tmp_path, capsys, flag, given, message):
    (tmp_path / "a-file").write_text("not a directory")
    path = tmp_path / given
    # the dataset is not even opened: the refusal comes first (a missing file would be the other error)
    assert main(["data", "inspect", str(tmp_path / "absent.beton"), flag, str(path)]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert message.format(path=path) in err and "absent.beton" not in err, err
    assert not path.exists()


@pytest.mark.parametrize("args, message", [
    (["{existing}"], "output '{existing}' already exists; pass --overwrite to replace it"),
    (["{tmp}/out.tar"], "output '{tmp}/out.tar' must end in '.beton'"),
    (["{tmp}/out.beton", "--per-class", "0"], "--per-class 0: need at least 1 image of each class"),
])
def test_write_refuses_its_own_arguments_before_it_opens_the_source(tmp_path, capsys, args, message):
    """A source is scanned first (ImageNet: every image's header, minutes): an output or a count that cannot
    work is refused before; the source given here does not even exist."""
    existing = tmp_path / "done.beton"
    existing.write_bytes(b"written before")
    given = [arg.format(existing=existing, tmp=tmp_path) for arg in args]
    assert main(["data", "write", str(tmp_path / "no-such-folder"), *given]) == EXIT_INVALID_INPUT
    err = capsys.readouterr().err
    assert message.format(existing=existing, tmp=tmp_path) in err and "no-such-folder" not in err, err
    assert existing.read_bytes() == b"written before"


def test_stage_prints_the_local_copy_of_a_uri(tmp_path, capsys):
    beton = tmp_path / "d.beton"
    assert main(["data", "write", "digits", str(beton), "--split", "val", "--img-size", "8", "--workers", "1"]) == EXIT_OK
    capsys.readouterr()
    assert main(["data", "stage", f"file://{beton}", "--cache-dir", str(tmp_path / "cache")]) == EXIT_OK
    local = Path(capsys.readouterr().out.strip())
    assert local.is_file() and local.parent.parent == tmp_path / "cache"


def test_prepare_digits_writes_train_and_val_once(tmp_path):
    data = DataConfig(train=str(tmp_path / "d" / "train.beton"), val=str(tmp_path / "d" / "val.beton"), prepare="digits")
    train, val = prepare_digits(data, img_size=8, num_workers=1)
    assert train.is_absolute() and val == tmp_path / "d" / "val.beton"
    assert (read_sidecar(train).num_samples, read_sidecar(val).num_samples) == (1437, 360)
    assert read_sidecar(train).source.split == "train" and read_sidecar(val).image_size.max_width == 8
    stamps = (train.stat().st_mtime_ns, val.stat().st_mtime_ns)
    assert prepare_digits(data, img_size=8) == (train, val)
    assert (train.stat().st_mtime_ns, val.stat().st_mtime_ns) == stamps


def test_prepare_digits_refuses_files_it_wrote_at_another_size_or_of_another_source(tmp_path):
    """A run at another model.img_size than the first must not train on the first run's images."""
    data = DataConfig(train=str(tmp_path / "train.beton"), val=str(tmp_path / "val.beton"), prepare="digits")
    train, val = prepare_digits(data, img_size=8, num_workers=1)
    stamps = (train.stat().st_mtime_ns, val.stat().st_mtime_ns)
    with pytest.raises(InvalidInputError) as refused:
        prepare_digits(data, img_size=12)
    assert str(refused.value) == (
        f"data.prepare='digits' finds data.train={str(train)!r} written at 8 px, but model.img_size is 12: point "
        "data.train and data.val at new files (e.g. digits_12_train.beton), or remove these")
    assert (train.stat().st_mtime_ns, val.stat().st_mtime_ns) == stamps
    folder = tmp_path / "folder"
    for name in ("cat", "dog"):
        (folder / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(folder / name / "0.png")
    assert main(["data", "write", str(folder), str(tmp_path / "pets.beton"), "--workers", "1"]) == EXIT_OK
    pets = DataConfig(train=str(tmp_path / "pets.beton"), val=str(val), prepare="digits")
    with pytest.raises(InvalidInputError, match="pets.beton' holding imagefolder images, not digits"):
        prepare_digits(pets, img_size=8)


def test_prepare_digits_never_overwrites_a_file_it_did_not_write(tmp_path):
    (tmp_path / "mine.beton").write_bytes(b"someone's dataset")
    data = DataConfig(train=str(tmp_path / "mine.beton"), val=str(tmp_path / "val.beton"), prepare="digits")
    with pytest.raises(InvalidInputError, match="mine.beton"):
        prepare_digits(data, img_size=8)
    assert (tmp_path / "mine.beton").read_bytes() == b"someone's dataset"


def test_prepare_digits_refuses_uris(tmp_path):
    data = DataConfig(train="s3://bucket/train.beton", val=str(tmp_path / "val.beton"), prepare="digits")
    with pytest.raises(InvalidInputError, match="s3://bucket/train.beton"):
        prepare_digits(data, img_size=8)


def test_data_prepare_command_writes_the_configs_files(tmp_path, capsys):
    code = main(["data", "prepare", "-c", "smoke", "--set", f"data.train={tmp_path}/t.beton",
                 "--set", f"data.val={tmp_path}/v.beton"])
    assert code == EXIT_OK
    assert read_sidecar(tmp_path / "t.beton").image_size.max_width == 16  # the smoke preset's model.img_size


def test_write_defaults_to_ffcv_imagenets_storage_and_records_chunk_digests(tmp_path):
    # write_imagenet.sh 500 0.50 90: proportion mode, longest side 500 px, half JPEG at quality 90.
    beton = tmp_path / "d.beton"
    assert main(["data", "write", "digits", str(beton), "--split", "val", "--img-size", "8", "--workers", "1"]) == EXIT_OK
    sidecar = read_sidecar(beton)
    assert (sidecar.write.write_mode, sidecar.write.max_resolution) == ("proportion", 500)
    assert (sidecar.write.jpeg_quality, sidecar.write.compress_probability) == (90, 0.5)
    assert sidecar.chunk_sha256 and len(sidecar.chunk_sha256) == 1


def test_write_of_some_classes_and_a_few_images_of_each_records_the_subset(tmp_path, capsys):
    beton = tmp_path / "few.beton"
    assert main(["data", "write", "digits", str(beton), "--split", "train", "--img-size", "8", "--write-mode", "raw",
                 "--classes", "5,6,7", "--per-class", "4", "--workers", "1"]) == EXIT_OK
    sidecar = read_sidecar(beton)
    assert sidecar.classes == ["5", "6", "7"] and sidecar.counts_per_class == {"5": 4, "6": 4, "7": 4}
    assert (sidecar.source.selected_classes, sidecar.source.per_class) == (["5", "6", "7"], 4)
    assert "12 samples, 3 classes" in capsys.readouterr().out


def test_write_of_a_class_the_source_lacks_exits_2_naming_it(tmp_path, capsys):
    beton = tmp_path / "few.beton"
    assert main(["data", "write", "digits", str(beton), "--split", "val", "--classes", "5,x"]) == EXIT_INVALID_INPUT
    assert "--classes x: not classes of" in capsys.readouterr().err and not beton.exists()
