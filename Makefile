# vitsweep's two commands: `make demo` (the embedded default training run) and `make test`.
# Both install first; `make setup` is idempotent and re-runs only when the dependency set changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.vitsweep-setup
UV_INSTALL := $(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode -c constraints.txt
# FFCV compiles against these and loads them at run time (ffcv 1.0.2).
SYSTEM_PACKAGES := pkg-config g++ libturbojpeg0-dev libopencv-dev
BROWSER_PACKAGES := chromium chromium-driver

.PHONY: setup demo test mutation mutation-module ui-screenshots system-packages browser-packages deepspeed-cpu-ops \
	gpu-check-wheels
.DEFAULT_GOAL := test

setup: $(STAMP) deepspeed-cpu-ops

# apt-get install those of the Debian packages $(1) that are missing ($(2): what they are for).
define apt_install
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing $(2): $$missing"; \
	  command -v apt-get >/dev/null || { echo "setup: apt-get not found; install these Debian packages by hand: $$missing" >&2; exit 1; }; \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null \
	    || { echo "setup: apt-get could not install: $$missing" >&2; exit 1; }; \
	fi
endef

system-packages:
	$(call apt_install,$(SYSTEM_PACKAGES),FFCV's system libraries)

# The test suite's browser check (tests/test_mlflow_ui.py) drives headless Chromium; the demo does not need it.
browser-packages:
	$(call apt_install,$(BROWSER_PACKAGES),Chromium for the MLflow UI check)

$(STAMP): pyproject.toml constraints.txt | system-packages
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "setup: '$(PYTHON) -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
	@# uv (pinned in constraints.txt) installs the pinned set several times faster than pip: CI's every run
	@# pays it. Compiled to bytecode as pip does: a shell with PYTHONDONTWRITEBYTECODE (this machine's, CI's)
	@# would compile every module in every process, a smoke run then using ~1.6x its CPU.
	$(BIN)/python -m pip install -q -c constraints.txt uv
	$(UV_INSTALL) -e ".[dev]"
	@# pipeline.data.runtime also fills numba's on-disk cache of what `import ffcv` compiles (~3 s per process after).
	$(BIN)/python -c "import torch, torchvision, timm, ray, deepspeed, mlflow, pipeline.data.runtime, models" \
	  || { echo "setup: the environment does not import; see the errors above" >&2; exit 1; }
	@touch $(STAMP)
	@echo "setup: ready ($(VENV))"

# Without a GPU, DeepSpeed JIT-compiles its shared-memory comm op on first start (minutes); build
# it once here, into torch's extension cache, so no training run or test pays for it (with the ninja
# every worker uses: pipeline.components.engine.use_the_environments_ninja). torch builds into
# $TORCH_EXTENSIONS_DIR/<op> where that is set, else into a per-build folder of ~/.cache/torch_extensions.
# That cache is per user, not per environment: an op built there for another venv (another clone's) would
# be rebuilt by the first worker that loads it (its build file names that venv's torch), while every
# other worker waits on its lock. So it counts as built only where its build file names this venv.
TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions
deepspeed-cpu-ops: $(STAMP)
	@if ! $(BIN)/python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then :; \
	elif ( for op in $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm $(TORCH_EXTENSIONS_DIR)/*/deepspeed_shm_comm; do \
	         ls $$op/*.so >/dev/null 2>&1 && grep -qF -- "-isystem $(abspath $(VENV))/" $$op/build.ninja 2>/dev/null && exit 0; \
	       done; exit 1 ); then :; \
	else echo "setup: building DeepSpeed's CPU comm op for this environment (a minute or two)"; \
	  DS_ACCELERATOR=cpu $(BIN)/python -c "from pipeline.components.engine import use_the_environments_ninja; \
	    use_the_environments_ninja(); from deepspeed.accelerator import get_accelerator; \
	    get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 \
	  || { echo "setup: DeepSpeed's CPU comm op failed to build (needs g++)" >&2; exit 1; }; fi

demo: setup
	$(BIN)/vitsweep train

# Two pytest-xdist workers, each taking whole groups of tests (tests/worker_groups.py): on 2 cores one
# end-to-end run's idle moments go to another's work. TEST_WORKERS=0 runs the suite in this one process.
# pytest exits 5 when it collected no tests: that is a failure too (nothing was shown).
TEST_WORKERS ?= 2
test: setup browser-packages
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS); status=$$?; \
	if [ $$status -eq 5 ]; then echo "test: pytest collected no tests" >&2; exit 1; fi; exit $$status

# Mutation testing of one core module against its fast unit tests (pyproject's [tool.mutmut]): every
# mutant mutmut makes of MODULE, then the score and each survivor. Minutes to hours on 2 cores; not CI.
MUTATION_MODULES := pipeline.components.metrics pipeline.components.losses pipeline.components.optim \
	pipeline.components.checkpointing models.layers.mgcrp pipeline.data.rand_augment models.layers.svpn \
	pipeline.sweeps.importance pipeline.sweeps.report pipeline.trained.transfer pipeline.trained.prediction \
	pipeline.trained.evaluation pipeline.trained.registry
mutation: mutation-module setup
	@test -x $(BIN)/mutmut || $(UV_INSTALL) -e ".[mutation]"
	rm -rf mutants
	$(BIN)/mutmut run "$(MODULE).*"
	@$(BIN)/mutmut results --all true | awk -v module="$(MODULE)." \
	  'index($$1, module) == 1 { total++; if ($$2 == "killed") killed++; else print } \
	   END { printf "%s: %d mutants, %d killed (%.1f%%)\n", substr(module, 1, length(module) - 1), total, killed, 100 * killed / total }'

mutation-module:
	@if ! echo " $(MUTATION_MODULES) " | grep -q " $(MODULE) "; then \
	  echo "mutation: MODULE=$(MODULE) is not one of: $(MUTATION_MODULES)" >&2; exit 2; fi

# The README's MLflow UI screenshots (tests/ui_screenshots/), as the browser check takes them.
ui-screenshots: setup browser-packages
	VITSWEEP_UI_SCREENSHOTS=$(CURDIR)/tests/ui_screenshots $(BIN)/python -m pytest -q tests/test_mlflow_ui.py

# What benchmarks/gpu_check.py needs on the lent GPU machine beyond its image (Python 3.12, torch, timm,
# numba, numpy, pillow; no package registry): DeepSpeed, built here from its sdist without ops (they
# compile just in time there), and its and vitsweep's other dependencies as CPython 3.12 manylinux or
# pure wheels, at constraints.txt's versions. They travel with the working tree (the device tool's
# `carry`); benchmarks/gpu_check.sh installs them there. tests/test_gpu_check.py checks their size.
GPU_CHECK_WHEELS := .whl/gpu-check
GPU_CHECK_PACKAGES := hjson msgpack ninja packaging psutil py-cpuinfo pydantic pydantic_core annotated-types \
	typing_extensions typing-inspection tqdm einops PyYAML
gpu-check-wheels: $(GPU_CHECK_WHEELS)/.complete

$(GPU_CHECK_WHEELS)/.complete: constraints.txt | $(STAMP)
	rm -rf $(GPU_CHECK_WHEELS) && mkdir -p $(GPU_CHECK_WHEELS)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -c constraints.txt -d $(GPU_CHECK_WHEELS) $(GPU_CHECK_PACKAGES)
	DS_BUILD_OPS=0 $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed \
	  -c constraints.txt -w $(GPU_CHECK_WHEELS) deepspeed
	@touch $@
	@du -sh $(GPU_CHECK_WHEELS)

