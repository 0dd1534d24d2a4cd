"""cluster/Dockerfile, checked statically: this machine has no Docker engine, so the images are never
built here (README). What can be read from the file is held against the project it packages."""
import re
import sys
import tomllib
from pathlib import Path

import mlflow
import ray

from pipeline.data.staging import CACHE_DIR_ENV

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "cluster" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    current = None
    for instruction, arguments in instructions():
        if instruction == "FROM":
            current = arguments.split()[-1]
            found[current] = [(instruction, arguments)]
        elif current:
            found[current].append((instruction, arguments))
    return found


def args() -> dict[str, str]:
    return dict(arguments.split("=", 1) for instruction, arguments in instructions() if instruction == "ARG")


def runs(stage: str) -> str:
    return " ".join(arguments for instruction, arguments in stages()[stage] if instruction == "RUN")


def constraint(package: str) -> str:
    match = re.search(rf"^{package}==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    return match.group(1)


def test_the_default_image_is_rays_gpu_image_of_this_ray_and_python():
    names = list(stages())
    assert names[-1] == "vitsweep"  # `docker build` without --target builds the training image
    base = stages()["vitsweep"][0][1].split()[0]
    assert base == "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu"
    assert args()["RAY_VERSION"] == ray.__version__ == constraint("ray")
    assert args()["PYTHON_TAG"] == f"py{sys.version_info.major}{sys.version_info.minor}"


def test_the_image_installs_ffcvs_system_libraries_named_in_the_makefile():
    packages = re.search(r"^SYSTEM_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split()
    install = re.search(r"apt-get install (.+?)(?:&&|$)", runs("vitsweep")).group(1).split()
    assert set(packages) <= set(install)


def test_the_image_installs_vitsweep_with_the_tested_versions_and_the_object_store_clients():
    pip = re.search(r"pip install (.+?)(?:&&|$)", runs("vitsweep")).group(1).split()
    assert pip[pip.index("-c") + 1] == "constraints.txt" and "." in pip
    assert {"s3fs", "gcsfs"} <= set(pip)  # staging from s3:// and gs://
    assert "vitsweep config validate --config cluster/jobs/a100_8x8.yaml" in runs("vitsweep")


def test_the_image_copies_every_package_setuptools_builds_and_the_files_it_reads():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {word for instruction, arguments in stages()["vitsweep"] if instruction == "COPY"
              for word in arguments.split()[:-1] if not word.startswith("--")}
    needed = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert needed | {"pyproject.toml", "constraints.txt", project["project"]["readme"], "cluster"} <= copied


def test_the_image_puts_every_program_of_cluster_bin_on_path_for_the_cluster_start_commands():
    programs = sorted(path.name for path in (ROOT / "cluster" / "bin").iterdir())
    assert {"vitsweep-secret", "vitsweep-mlflow-server"} <= set(programs)
    for program in programs:
        (copy,) = [arguments.split() for instruction, arguments in stages()["vitsweep"]
                   if instruction == "COPY" and f"cluster/bin/{program}" in arguments.split()]
        assert copy[-1] == "/usr/local/bin/" and "--chmod=0755" in copy, program


def test_the_image_can_run_the_launcher_heads_mlflow_server_at_the_clients_version():
    pip = re.search(r"pip install (.+?)(?:&&|$)", runs("vitsweep")).group(1).split()
    assert '"mlflow[auth]"' in pip  # the basic-auth app (Flask-WTF) of vitsweep-mlflow-server
    assert "mlflow.server.auth" in runs("vitsweep")  # imported once built: the build fails without it


def test_the_image_defaults_each_nodes_staging_cache_to_its_local_nvme_mount():
    envs = [arguments for instruction, arguments in stages()["vitsweep"] if instruction == "ENV"]
    assert f"{CACHE_DIR_ENV}=/mnt/local-nvme/vitsweep-cache" in envs


def test_the_mlflow_server_image_has_the_auth_app_and_the_postgres_driver_at_the_clients_version():
    pip = re.search(r"pip install (.+?)(?:&&|$)", runs("mlflow-server")).group(1).split()
    assert pip[pip.index("-c") + 1] == "/tmp/constraints.txt"
    assert '"mlflow[auth]"' in pip and "psycopg2-binary" in pip
    assert constraint("mlflow") == mlflow.__version__
    assert ("USER", "1000") in stages()["mlflow-server"]


def test_no_secret_is_baked_into_either_image():
    for instruction, arguments in instructions():
        if instruction in ("ENV", "ARG"):
            assert not re.search(r"TOKEN|PASSWORD|SECRET|KEY", arguments.split("=")[0], re.IGNORECASE), arguments
        if instruction == "COPY":
            assert not re.search(r"auth_token|\.ray/|\.aws|\.config/gcloud|\.env\b", arguments), arguments


def test_the_build_context_leaves_out_the_virtualenv_and_git():
    ignored = (ROOT / "cluster" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
