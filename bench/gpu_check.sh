#!/usr/bin/env bash
# The H200 device check: .venv set up (or refreshed) by the Makefile's own target, then
# bench/gpu_check.py with these arguments (--quick, --skip-kernels, --skip-server, --out PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.surge-installed
exec .venv/bin/python bench/gpu_check.py "$@"
