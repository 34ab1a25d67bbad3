# The two commands of the README: `make quickstart` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The example third-party attestor (a separate distribution, tests/plugins/) the
# test suite joins a node with, installed like any third party's plugin.
EXAMPLE_ATTESTOR := tests/plugins/example_attestor

# Debian packages the TPM tests and the tpm2-pytss build need (swtpm with its local
# CA, tpm2-tools, the tpm2-tss headers and swtpm TCTI) and what building a wheel and
# a venv takes on a fresh machine, and what the docs' first run uses (curl, jq,
# openssl; tests/test_docs_commands.py). Installed only when one is missing.
DEB_PACKAGES := swtpm swtpm-tools tpm2-tools libtss2-dev libtss2-tcti-swtpm0 pkg-config \
	gcc python3-dev python3-venv curl jq openssl
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: quickstart test lint typecheck pytest bench fuzz clean system-packages artifact

# Runs on every make (a dpkg-query, a few ms) but, as an order-only prerequisite,
# does not make $(STAMP) out of date. apt-get update only when the install fails
# without it (no or stale package lists).
system-packages:
	@if ! command -v dpkg-query >/dev/null 2>&1; then \
	  echo "not a Debian system: install the equivalents of $(DEB_PACKAGES) yourself"; \
	else \
	  missing=$$(for p in $(DEB_PACKAGES); do \
	    dpkg-query -W -f='$${db:Status-Abbrev}' $$p 2>/dev/null | grep -q '^ii' || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:" $$missing; \
	    $(APT) install -y -q $$missing || \
	      { $(APT) update -q && $(APT) install -y -q $$missing; } || exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml $(EXAMPLE_ATTESTOR)/pyproject.toml | system-packages
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "bcd needs Python 3.11 or newer"'
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q -e $(EXAMPLE_ATTESTOR)
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

# The bcd artifact for this machine's architecture, in dist/bcd/<version>/linux-<arch>
# (docs/installing.md); serve it with better-compute serve --downloads dist.
# WITH="DIST ..." bundles further distributions (wheels or project directories), e.g.
# make artifact WITH=tests/plugins/example_attestor
artifact: $(STAMP)
	$(BIN)/python packaging/build_artifact.py --out dist $(foreach d,$(WITH),--with $(d))

bench: $(STAMP)
	$(BIN)/python bench/join.py
	$(BIN)/python bench/renew.py
	$(BIN)/python bench/tpm.py
	$(BIN)/python bench/replicas.py
	$(BIN)/python bench/leafonly.py
	$(BIN)/python bench/cli_start.py
	$(BIN)/python bench/fleet.py --nodes 1000 --procs 2 --gateways 2

# HTTP-level property-based fuzzing of a real serve (fuzz/http_fuzz.py; not part of
# make test): 100,000 inputs per path family by default, --per-family N for less.
# Then schemathesis from the API's own OpenAPI description (fuzz/openapi_fuzz.py):
# 1,000 positive and 200 schema-violating cases per operation, seeded; override with
# OPENAPI_FUZZ="--max-examples N --negative-examples M --seed S".
OPENAPI_FUZZ ?= --max-examples 1000 --negative-examples 200 --seed 13
fuzz: $(STAMP)
	$(BIN)/python fuzz/http_fuzz.py
	$(BIN)/python fuzz/openapi_fuzz.py $(OPENAPI_FUZZ)

clean:
	rm -rf $(VENV) .quickstart .pytest_cache .mypy_cache .ruff_cache
