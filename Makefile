# `make demo` and `make test` work on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "commitgate needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/commitgate demo

test: $(STAMP)
	$(VENV)/bin/ruff check server tools tests
	$(VENV)/bin/ruff format --check server tools tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/commitgate bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
