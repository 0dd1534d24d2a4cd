"""benchmarks/gpu_check.py, the one prepared run for a lent GPU machine: every part of it on CPU
(``--tiny``) with Ray, FFCV and MLflow unimportable, as on that machine; what it imports is the
machine's image or the wheels it carries, and those fit the device tool's 64 MiB."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_check import MODELS, NOT_IMPORTED, Sizes, largest_micro_batch  # noqa: E402

# The GPU machine's image (the device tool's README): these and what they require.
IMAGE = ("torch", "timm", "numba", "numpy", "pillow")
# Imported where installed, gone without where not (each inside a try): numba's cffi support
# (numba/core/typing/cffi_utils.py), its SciPy version check (numba/__init__.py) and its coverage
# support (numba/misc/coverage_support.py), numpy.f2py's charset_normalizer, torch.cuda's NVML bindings
# (nvidia-ml-py's pynvml, torch/cuda/__init__.py), httpx2's zstd decoder (backports.zstd below Python
# 3.14: the ``backports`` namespace, which backports.tarfile provides in this environment).
OPTIONAL = {"cffi", "pycparser", "scipy", "coverage", "charset-normalizer", "nvidia-ml-py", "backports-zstd",
            "backports.tarfile"}
CARRY_LIMIT = 64 * 2**20

# The script run as the GPU machine has it: the packages it lacks cannot be imported (a library that
# imports one optionally, as DeepSpeed's autotuner does MLflow, goes on without it).
_WITHOUT = """
import importlib.abc, runpy, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Absent())
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    script = str(REPO / "benchmarks" / "gpu_check.py")
    code = _WITHOUT.format(absent=set(NOT_IMPORTED), argv=[script, "--device", "cpu", "--tiny", "--out", str(out)],
                           script=script)
    builds_before = _cpu_comm_op_build_logs()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    report["markdown"] = (out / "gpu_check.md").read_text()
    report["cpu_comm_op_builds"] = (builds_before, _cpu_comm_op_build_logs())
    return report


def _cpu_comm_op_build_logs() -> dict[str, str]:
    """ninja's log of each DeepSpeed CPU comm op build in torch's extension cache (``make setup`` builds one)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return {str(log): log.read_text() for log in root.glob("**/deepspeed_shm_comm/.ninja_log")}


def test_every_paper_model_is_stepped_by_vitsweeps_engine_and_timms_loop(tiny_run):
    assert [row["model"] for row in tiny_run["steps"]] == [model.label for model in MODELS]
    for index, row in enumerate(tiny_run["steps"]):
        for side in ("vitsweep", "timm"):
            figures = row[side]
            assert figures["images_per_s"] > 0 and figures["step_ms"] > 0 and figures["tflops"] > 0, (row["model"], side)
            if index < Sizes.of(tiny=True).profiled_models:
                assert re.search(r"aten::\w+", figures["profile"]), figures["profile"]  # one step's operators
            else:  # on CPU the first model's profile alone: reading one back costs seconds
                assert figures["profile"] is None, (row["model"], side)
        # On CPU nothing runs out of memory: the search ends at its bound.
        assert row["vitsweep"]["largest_micro_batch"] == Sizes.of(tiny=True).max_batch
    assert not tiny_run["skipped"]


def test_the_input_pipeline_svpn_and_compile_parts_report_their_figures(tiny_run):
    assert tiny_run["augment"]["vitsweep_device_images_per_s"] > 0 and tiny_run["augment"]["timm_cpu_images_per_s"] > 0
    assert tiny_run["svpn"]["ms"]["exact (SVD)"] > 0 and "approx #sv=1 #iter=1" in tiny_run["svpn"]["ms"]
    assert tiny_run["compile"]["compiled_images_per_s"] > 0 and tiny_run["compile"]["compile_s"] is not None
    assert tiny_run["compile"]["backend"] == "aot_eager" and Sizes.of(tiny=False).compile_backend == "inductor"
    assert "| XCiT-N12/16 (003) | vitsweep |" in tiny_run["markdown"]


def test_on_cpu_it_loads_deepspeeds_comm_op_as_built_whichever_ninja_its_shell_finds_first(tiny_run):
    # With Debian's ninja first on PATH (make test's shell) it rebuilt the op, and the next worker rebuilt it
    # back with pip's: ~100 s of the suite's CPU, while every starting worker waited on the build's lock.
    before, after = tiny_run["cpu_comm_op_builds"]
    rebuilt = [log for log, text in after.items() if before.get(log) != text]
    assert before and not rebuilt, f"the run rebuilt DeepSpeed's CPU comm op: {rebuilt}"


def test_it_needs_no_ray_ffcv_or_mlflow(tiny_run):
    assert tiny_run["imported"] == []


def _requirements_closure(names) -> set[str]:
    """The distributions ``names`` need, transitively, as this environment's metadata declares them
    (extras left out)."""
    found, todo = set(), [name.lower() for name in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower().replace("_", "-"))
    return found


@pytest.fixture(scope="module")
def carried_wheels() -> list[Path]:
    built = subprocess.run(["make", "--no-print-directory", "gpu-check-wheels"], cwd=REPO, capture_output=True,
                           text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return sorted((REPO / ".whl" / "gpu-check").glob("*.whl"))


def test_what_it_imports_is_the_images_or_the_carried_wheels(tiny_run, carried_wheels):
    carried = {wheel.name.split("-")[0].lower().replace("_", "-") for wheel in carried_wheels}
    # what it surely imports is found (with make setup's .venv inside the repository, it once found nothing)
    assert {"torch", "timm", "deepspeed", "numba", "pillow"} <= set(tiny_run["distributions_imported"])
    unavailable = set(tiny_run["distributions_imported"]) - _requirements_closure(IMAGE) - carried - OPTIONAL
    assert not unavailable, f"the GPU machine would lack {sorted(unavailable)}"


def test_the_carried_wheels_are_for_python_312_on_linux_and_fit_in_64_mib(carried_wheels):
    assert any(wheel.name.startswith("deepspeed-") for wheel in carried_wheels)
    for wheel in carried_wheels:
        python, abi, platform = wheel.stem.split("-")[-3:]
        assert python in ("py3", "cp312") or abi == "abi3", wheel.name
        assert platform == "any" or "manylinux" in platform and "x86_64" in platform, wheel.name
    assert sum(wheel.stat().st_size for wheel in carried_wheels) < CARRY_LIMIT


@pytest.mark.parametrize("start,bound", [(1, 64), (4, 1024), (128, 2048), (300, 300)])
def test_the_micro_batch_search_finds_within_a_sixteenth_of_the_largest_that_fits(start, bound):
    for largest in range(0, bound + 40):
        probes = []

        def fits(batch: int) -> bool:
            probes.append(batch)
            return batch <= largest

        found, count = largest_micro_batch(fits, start, bound)
        expected = min(largest, bound)  # the definition: the largest fitting batch within the bound
        assert found <= expected and (found == 0) == (expected == 0), (largest, found)
        assert expected - found <= max(1, found // 16), (largest, found)
        assert all(batch <= bound for batch in probes) and count == len(probes)
        assert count <= 2 * bound.bit_length() + 2, (largest, count)
