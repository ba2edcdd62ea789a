# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench lint clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	@touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/headroom demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[bench]" "$(TORCH_PIN)" || true
	@for f in benchmarks/*.py; do \
		case $$f in *_gpu.py|*/_*) continue;; esac; \
		echo "== $$f"; $(PY) $$f || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
