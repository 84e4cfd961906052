# lmcache_async: the two set-up commands are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Pinned only here (the package itself asks for a range): on these machines
# torch==2.13.0 resolves to the CPU build on local disk; a bare `torch` pulls CUDA.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: demo test venv lmcache-venv lint typecheck pytest smoke bench bench-quick bench-render clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lmcache-venv:
	tests/support/build_lmcache_venv.sh

## The main job: the KV remap demo on the embedded server (no LMCache needed).
demo: venv
	$(BIN)/lmcache-async demo

## Everything CI runs: lint, types, the whole test suite against the real server.
test: venv lmcache-venv lint typecheck pytest

lint: venv
	$(BIN)/ruff check lmcache_async tests benchmarks

typecheck: venv
	$(BIN)/mypy

# pytest exits 5 when it collected no tests: make treats any non-zero exit as failure.
pytest: venv lmcache-venv
	LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1 $(BIN)/python -m pytest

## The issue-2 smoke run: real LMCache server, our client, chunk size + noop RTT.
smoke: venv lmcache-venv
	$(BIN)/python benchmarks/smoke_real_server.py

## The whole benchmark suite against the official SDK: starts the real servers, writes
## benchmarks/results/*.json, renders docs/benchmarks.md + docs/img/*.png (see there).
## `make bench-quick` (or BENCH_QUICK=1) is a few-minute subset; BENCH_ARGS passes options,
## e.g. BENCH_ARGS='--generation 0.5.7' or BENCH_ARGS='--sections concurrent fresh'.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH) -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: venv lmcache-venv $(BENCH_STAMP)
	$(BIN)/python benchmarks/suite.py $(BENCH_ARGS)

bench-quick:
	BENCH_QUICK=1 $(MAKE) bench

## Re-render docs/benchmarks.md from the JSON already in benchmarks/results/.
bench-render: $(BENCH_STAMP)
	$(BIN)/python benchmarks/render.py

clean:
	rm -rf $(VENV) .lmcache-venv .mypy_cache .ruff_cache .pytest_cache
