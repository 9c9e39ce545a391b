# tracon-jobs: `make run` to try it, `make test` to check it, `make all` before a commit.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint types all bench clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)  # make run PORT=8001 FLOWER_PORT=5556, or ARGS="--port 8001"
	$(BIN)/tracon-jobs dev $(if $(PORT),--port $(PORT)) $(if $(FLOWER_PORT),--flower-port $(FLOWER_PORT)) $(ARGS)

test: $(STAMP)  # two test processes: most of the real-process tests wait, not compute
	$(BIN)/python -m pytest -q -n 2

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

all: lint types test

bench: $(STAMP)  # every benchmark, then a summary; make bench BENCH="b2_inflight b3_coordination"
	$(BIN)/python -m bench $(BENCH)

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
