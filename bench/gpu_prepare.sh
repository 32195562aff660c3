#!/usr/bin/env bash
# Run here, before bench/gpu_check.sh runs on the device machine, which reaches no registry:
# fills .gpu/ (git-ignored) with what its image lacks, for the `carry` of each device call.
#   .gpu/whl/     wheels of the dependencies the image does not hold (CPython 3.12)
#   .gpu/model/   the default model's config and tokenizer: its weights (98 MB) exceed what a
#                 call carries (64 MiB), so the device fills random ones (bench/random_model.py)
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory .venv/.surge-installed
mkdir -p .gpu/whl
# The versions this .venv holds; the image already has torch, Triton, aiohttp, transformers...
wheels=()
for name in pyzmq msgspec setproctitle gguf llguidance redis; do
  wheels+=("$name==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")")
done
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${tag}_x86_64")
done
.venv/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .gpu/whl "${wheels[@]}"
gguf=$(.venv/bin/python -c "from surge.model_files import resolve_model; print(resolve_model('default').path)")
rm -rf .gpu/model
.venv/bin/python -m bench.random_model export "$gguf" .gpu/model
du -sh .gpu/whl .gpu/model
