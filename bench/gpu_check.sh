#!/usr/bin/env bash
# The H200 device check: bench/gpu_check.py with these arguments (--quick, --skip-kernels,
# --skip-server, --out PATH), on .venv set up by the Makefile's own target, or, where
# bench/gpu_prepare.sh's .gpu/ came along (the device machine reaches no registry), on the
# image's python3 with the carried wheels, serving the default model's shapes with random weights.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d .gpu/whl ]; then
  make --no-print-directory .venv/.surge-installed
  exec .venv/bin/python bench/gpu_check.py "$@"
fi
python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target .gpu/site \
  .gpu/whl/*.whl
export PYTHONPATH="$PWD/.gpu/site:$PWD"
if [ -f .gpu/model/config.json ]; then
  [ -f .gpu/model/model.safetensors ] || python3 -m bench.random_model fill .gpu/model
  export SURGE_MODEL="$PWD/.gpu/model"
fi
exec python3 bench/gpu_check.py "$@"
