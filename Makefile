# tracon-jobs: `make run` to try it, `make test` to check it, `make all` before a commit.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help run test test-fast lint format types all bench clean

help:  # the targets, each with what it does
	@grep -E '^[a-z-]+:.*#' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):[^#]*# */  make \1\t/' | expand -t 20

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)  # the whole system on this machine; PORT=8001 FLOWER_PORT=5556, or ARGS="--port 8001"
	$(BIN)/tracon-jobs dev $(if $(PORT),--port $(PORT)) $(if $(FLOWER_PORT),--flower-port $(FLOWER_PORT)) $(ARGS)

test: $(STAMP)  # the whole suite in four processes (most tests wait), an idle one taking half of another's queue
	$(BIN)/python -m pytest -q -n 4 --dist worksteal

test-fast: $(STAMP)  # the suite without the real-process tests
	$(BIN)/python -m pytest -q -m "not e2e"

lint: $(STAMP)  # ruff's checks and its format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  # fix what lint finds that ruff can fix, and format the code
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

types: $(STAMP)  # mypy, strict
	$(BIN)/mypy

all: lint types test  # before a commit

bench: $(STAMP)  # every benchmark, then a summary; BENCH="b2_inflight b3_coordination" for some
	$(BIN)/python -m bench $(BENCH)

clean:  # remove var/ and the tools' caches
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
