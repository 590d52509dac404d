# Every target creates its own virtual environment on first use (Python 3.11+ only).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: help demo docs docs-serve test test-fast test-slow fuzz bench bench-cluster bench-groups soak partitions balance-train balance-eval balance-walkthrough lint check-minimal clean

$(STAMP): pyproject.toml setup.py src/kvcomm/_l2core.c $(wildcard src/kvcomm/_l2core_c/*) src/kvcomm/tiers/shm/layout.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)          ## the swarm demo on the embedded default (no servers)
	$(BIN)/kvcomm demo

# The documentation site (mkdocs.yml, pages in docs/): built strictly into site/, so a broken
# link, a missing page or a docstring mkdocstrings cannot read fails the build. The
# configuration and command-line references are generated at build time from the pydantic
# model and the argparse parser (docs/hooks/reference.py). About 10 s.
docs: $(STAMP)          ## the documentation site, built strictly into site/
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)    ## the documentation site on http://127.0.0.1:8000, rebuilt on change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

help:                   ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 22

# TEST_WORKERS pytest-xdist workers, a test file whole on one worker (its module fixtures,
# a dev cluster say, are made once): most of the suite's wall time is waiting on servers
# and deadlines (its CPU is about 11 minutes of 2 cores' 10 in two workers), so three
# workers on 2 cores keep both busy. TEST_WORKERS=0 runs it in one process. Every test
# makes its own namespaces, servers and ports: none shares state.
TEST_WORKERS ?= 3
test: $(STAMP)          ## the test suite, less the long fault runs (make test-slow); TEST_WORKERS=3
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=25

# The inner loop: the tests that start no server (markers redis and etcd, which the
# fixtures that start one give: tests/conftest.py) and no swarm of processes on one L2
# (marker multiprocess): the pure structures, the embedded client, the simulations, the
# tools' offline parts, the integrations on one host. `make test` runs them all. About 1,250
# tests (collected 2026-12-03), about 240 s of CPU: 2 1/2 minutes on 2 idle cores in
# TEST_WORKERS workers, as make test; 5 1/2 at a load average of 5-7.
test-fast: $(STAMP)     ## the tests that need no server and fork no process swarm (the inner loop)
	$(BIN)/python -m pytest -q -m "not slow and not redis and not etcd and not multiprocess" -n $(TEST_WORKERS) --dist loadfile --durations=10

# The long runs (pytest marker `slow`): the soaks for 30 s, the 15 s jepsen run, two
# partitions in a row, 300 random corrupted segments, 1500 mutated L3 records, 1500 hostile
# LangGraph records, LangGraph's
# example across hosts. `make test` runs a smaller variant of each that crosses the same
# faults.
test-slow: $(STAMP)     ## the long fault runs make test leaves out (marker slow)
	$(BIN)/python -m pytest -q -m slow

# The segment fuzzer's long run: 20000 corrupted segments, each opened and used by a fresh
# process that must work or raise a KVCommError (never a signal, another exception or a
# hang). FUZZ_SEED replays a run, FUZZ_CASE one case; the report lands in
# /tmp/kvcomm-fuzz-<seed>.txt, with C frames (gdb) for each kind of crash. Takes about
# 40 minutes on 2 cores (longer while cases hang: each costs its 25 s deadline).
# See tests/l2/test_fuzz_segment.py for every knob.
FUZZ_CASES ?= 20000
fuzz: $(STAMP)          ## the segment fuzzer's long run (FUZZ_CASES=20000, FUZZ_SEED=...)
	FUZZ_CASES=$(FUZZ_CASES) FUZZ_GDB=1 $(BIN)/python -m pytest -q -s tests/l2/test_fuzz_segment.py -k never_crash

bench: $(STAMP)         ## benchmarks against peers (Redis, manager, LMDB, UltraDict, rbloom, pyprobables); metrics' cost
	$(BIN)/python -m pip install -q UltraDict atomics rbloom pyprobables
	$(BIN)/python bench/bench_embedded.py
	$(BIN)/python bench/bench_core.py
	$(BIN)/python bench/bench_metrics.py

bench-cluster: $(STAMP) ## cluster mode vs Redis Cluster directly (needs redis-server)
	$(BIN)/python bench/bench_cluster.py

soak: $(STAMP)          ## 10 minutes of faults on a 3-host dev cluster: lost = 0? (needs redis-server)
	$(BIN)/kvcomm soak --hosts 3 --minutes 10

# The seeds' "20 of 20": `kvcomm jepsen` whose nemesis first partitions a host 20 times in
# a row (both sides keep writing; each heal -> convergence measured), then every jepsen
# fault once. Prints the partitions healed and converged with p50/p99 of heal ->
# convergence, and the strong history's verdict. About 4 minutes on 2 cores.
PARTITIONS ?= 20
partitions: $(STAMP)    ## 20 partitions in a row: healed/converged, heal -> convergence p50/p99 (needs redis-server, etcd)
	$(BIN)/kvcomm jepsen --hosts 3 --seconds 10 --partitions $(PARTITIONS)

bench-groups: $(STAMP)  ## what cluster.groups costs: commands/s per host idle and under the swarm, propagation (16/1024/16384; needs redis-server)
	$(BIN)/python bench/group_cost.py --idle 10 --settle 15 --samples 30 --swarm 5

# Slot balancing (docs/balancing.md). balance-walkthrough: a dev cluster with a hot
# master, `kvcomm balance --once`, each master's load and p99 before and after, nothing
# lost. balance-train fits the learned policy and tunes the threshold policy on training
# seeds and writes the shipped model (a few minutes on 2 free cores); balance-eval compares both policies on 20
# held-out seeds per workload, prints the table in docs/balancing.md and draws docs/balance-sim.png.
BALANCE_SEED ?= 1
balance-train: $(STAMP) ## retrain the shipped balancing model (BALANCE_SEED=1)
	$(BIN)/kvcomm balance train --seed $(BALANCE_SEED) --out src/kvcomm/balance/balance_model.json

balance-eval: $(STAMP)  ## learned vs threshold on held-out seeds: table + docs/balance-sim.png
	$(BIN)/python bench/balance_eval.py --seeds 20

balance-walkthrough: $(STAMP) ## the balancing walkthrough of docs/balancing.md on a dev cluster (needs redis-server)
	$(BIN)/python bench/balance_walkthrough.py --window 10

# `pip install kvcomm` with no extra, in a fresh venv: exactly the four base dependencies
# get installed, the embedded default works, and cluster mode asks for kvcomm[cluster].
MIN_VENV ?= /tmp/kvcomm-minimal-venv
check-minimal:          ## the plain install (no extra) in a fresh venv
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q .
	$(MIN_VENV)/bin/python -m pip list --format=freeze
	$(MIN_VENV)/bin/python -c 'import kvcomm; kv = kvcomm.open("minimal-check"); \
	  kv.put("k", [1, 2]); assert kv.get("k") == [1, 2]; kv.close()'
	$(MIN_VENV)/bin/kvcomm purge --name minimal-check
	$(MIN_VENV)/bin/kvcomm dev-cluster up --dir $(MIN_VENV)/dc 2>&1 | grep -F "pip install 'kvcomm[cluster]'"
	rm -rf $(MIN_VENV)

lint: $(STAMP)          ## ruff and mypy
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

clean:                  ## remove the .venv, build outputs and the site
	rm -rf $(VENV) build site src/*.egg-info src/kvcomm/*.so
