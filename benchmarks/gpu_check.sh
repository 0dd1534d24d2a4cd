#!/usr/bin/env bash
# benchmarks/gpu_check.py on the lent GPU machine, in one line (from the repository root, with
# .whl/gpu-check carried: `make gpu-check-wheels` builds it here):
#   bash benchmarks/gpu_check.sh "$OUT"
# The wheels go into a directory of their own, ahead of the image's packages; nothing is installed
# into the image's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" .whl/gpu-check/*.whl
PYTHONPATH="$site" exec python3 benchmarks/gpu_check.py --out "$out" "${@:2}"
