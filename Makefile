# `make demo` and `make test` work on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The client alone on the MCP SDK's 1.x line, beside langchain-mcp-adapters (which needs mcp<2): the
# tests run an agent from it against the server of $(VENV) (tests/test_client_sdk1.py).
SDK1 := .venv-sdk1
SDK1_STAMP := $(SDK1)/.installed

.PHONY: demo test test-fast check bench clean

$(STAMP): pyproject.toml client/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "commitgate needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./client -e '.[test]'
	touch $(STAMP)

# A wheel of client/ (not a link to it), so the client's own packaging is what gets tested.
$(SDK1_STAMP): client/pyproject.toml $(wildcard client/*.py)
	test -x $(SDK1)/bin/python || $(PYTHON) -m venv $(SDK1)
	$(SDK1)/bin/python -m pip install --quiet --upgrade pip
	$(SDK1)/bin/python -m pip install --quiet './client[langchain]' 'mcp>=1.24,<2'
	$(SDK1)/bin/python -m pip install --quiet --force-reinstall --no-deps ./client
	touch $(SDK1_STAMP)

demo: $(STAMP)
	$(VENV)/bin/commitgate demo

# Lint, format and types: seconds, no server started. Both type checkers see the code under its
# import names, through src/commitgate/ (what they check: pyproject.toml).
check: $(STAMP)
	$(VENV)/bin/ruff check server tools client examples tests
	$(VENV)/bin/ruff format --check server tools client examples tests
	@# The two type checkers side by side: each keeps one core busy for minutes.
	$(VENV)/bin/mypy & mypy=$$!; $(VENV)/bin/basedpyright; pyright=$$?; wait $$mypy && exit $$pyright

# Everything CI runs: the checks, then every test (end-to-end and PostgreSQL included).
# Three workers: most tests wait on server processes, disks and a browser, so three keep two cores busy;
# a module's tests stay on one worker (--dist loadfile), beside its module-scoped fixtures.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the tests start
# hundreds of Python processes, and each would compile commitgate's modules again (about 60 ms of CPU).
test: check $(SDK1_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 3 --dist loadfile

# The quick loop while editing: no server processes, no PostgreSQL.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not postgres"

bench: $(STAMP)
	$(VENV)/bin/commitgate bench

clean:
	rm -rf $(VENV) $(SDK1) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
