"""`ruff check` (pyflakes' checks, pyproject's [tool.ruff]) passes on the whole project, in `make test`."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_ruff_finds_nothing_in_the_project():
    result = ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_as_configured_finds_a_method_defined_twice_and_an_undefined_name(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "twice.py").write_text("class Run:\n    def log(self):\n        pass\n\n    def log(self):\n"
                                       "        return missing\n")
    found = ruff("--output-format", "concise", ".", cwd=tmp_path).stdout
    assert "F811" in found and "F821" in found, found
