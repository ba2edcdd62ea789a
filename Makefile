# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-torch-range bench lint clean

# setup.py builds the C kernels of headroom.nn; a change to them needs a reinstall.
INSTALL_DEPS := pyproject.toml setup.py src/headroom/nn/_bitkernels.c
# The venv, with torch pinned before anything else can pull in another version.
VENV_TORCH := test -x $(PY) || $(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install --quiet --upgrade pip && \
	$(PY) -m pip install --quiet $(TORCH_PIN)

# make test, lint and bench: the package with its test extra.
$(VENV)/.installed: $(INSTALL_DEPS)
	$(VENV_TORCH)
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	@touch $@

# make demo: only what the demo imports (the demo extra), not the test extra.
$(VENV)/.installed-demo: $(INSTALL_DEPS)
	$(VENV_TORCH)
	$(PY) -m pip install --quiet -e ".[demo]" "$(TORCH_PIN)"
	@touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/headroom demo

# Tests run in parallel processes, one per core up to 4 (pytest-xdist); `pytest` alone runs them
# one after the other.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto --maxprocesses 4

# The suite on the oldest and the newest torch headroom supports (pyproject.toml's range: the
# oldest is also headroom/__init__.py's _TORCH_MIN), each in a venv of its own.
TORCH_oldest := torch==2.13.0
TORCH_newest := torch==2.14.1

.venv-torch-%/.installed: pyproject.toml setup.py src/headroom/nn/_bitkernels.c
	@test -x .venv-torch-$*/bin/python || $(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-torch-$*/bin/python -m pip install --quiet -e ".[test]" "$(TORCH_$*)"
	@touch $@

test-torch-range: .venv-torch-oldest/.installed .venv-torch-newest/.installed
	@for v in oldest newest; do \
		echo "== torch $$(.venv-torch-$$v/bin/python -c 'import torch; print(torch.__version__)')"; \
		.venv-torch-$$v/bin/python -m pytest -q -n auto --maxprocesses 4 || exit 1; \
	done

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

# Peers (the `bench` extra) are compared against in benchmarks only, never runtime dependencies.
# If they do not all install here, each is tried alone; a benchmark whose peer is missing says so
# in its results.
PEERS := cut-cross-entropy deepspeed accelerate

bench: $(VENV)/.installed
	@$(PY) -m pip install --quiet -e ".[bench]" "$(TORCH_PIN)" || { \
		$(PY) -m pip install --quiet psutil; \
		for p in $(PEERS); do \
			$(PY) -m pip install --quiet "$$p" "$(TORCH_PIN)" || echo "bench: peer $$p did not install"; \
		done; }
	@for f in benchmarks/*.py; do \
		case $$f in *_gpu.py|*/_*) continue;; esac; \
		echo "== $$f"; $(PY) $$f || exit 1; \
	done

clean:
	rm -rf $(VENV) .venv-torch-oldest .venv-torch-newest build *.egg-info src/*.egg-info src/headroom/nn/*.so
