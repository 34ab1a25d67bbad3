# The two commands of the README: `make quickstart` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "bcd needs Python 3.11 or newer"'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/python -m control.quickstart

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check bcd attestors control

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python bench/join.py

clean:
	rm -rf $(VENV) .quickstart .pytest_cache .mypy_cache .ruff_cache
