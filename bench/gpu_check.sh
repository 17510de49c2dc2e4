#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): the suite's GPU tests, the README's job, ResNet-50 and a GPT against plain torch,
# the fake-CUDA dry run -- one JSON in bench/results/gpu_check.json. Without a GPU the GPU steps are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PY" bench/gpu_check.py "$@"
