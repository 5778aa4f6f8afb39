# Everything a fresh machine needs: Python 3.11 and this Makefile.
# `make run` sets up .venv and runs the default job; `make test` sets up and runs the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
NP      ?= 17
CONFIG  ?=
ARGS    ?=
STAMP   := $(VENV)/.installed

.PHONY: setup run test soak bench bench-full docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python -c 'from deploy.launch import warm_kernels; warm_kernels()'  # kernels built ahead of time, once
	touch $(STAMP)

# 1 master + (NP-1) slaves; works as root and with more ranks than cores (see deploy/launch.py)
run: $(STAMP)
	$(BIN)/python -m deploy.launch -n $(NP) -- $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

# the lint (ruff, pyproject.toml) and the in-MPI tests (pytest-mpi) first, then everything else (whose closing
# line CI reads): tests/unit (pure, in-process) and tests/cluster (mpirun, Spark, sockets, namespace hosts) on
# two workers, the soak variants left out
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	timeout 600 $(BIN)/python -m deploy.launch -n 3 --module pytest -- -q --color=no -p no:cacheprovider --with-mpi tests/mpi
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25 -m "not soak" tests --ignore=tests/mpi

# the soak variants of the suite's cases, then random draws of the differential matrix (tests/matrix.py) for
# SOAK_MINUTES, and a table of draws and failures; then one run under the nemesis (tests/nemesis.py) for
# NEMESIS_MINUTES (NEMESIS_SEED: its schedule again), and its table of faults, exit codes, results and resources
SOAK_MINUTES ?= 30
NEMESIS_MINUTES ?= 60
NEMESIS_SEED ?=
soak: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m soak tests/cluster
	$(BIN)/python -m tests.matrix --minutes $(SOAK_MINUTES)
	$(BIN)/python -m tests.nemesis --minutes $(NEMESIS_MINUTES) $(if $(NEMESIS_SEED),--seed $(NEMESIS_SEED))

# quick: one run per point, 60 s of event time (6M tuples) per run (docs/benchmarks.md: its time); bench-full: medians of 3, 1-8 slaves, more epochs
bench: $(STAMP)
	$(BIN)/python -m bench --quick
	$(BIN)/python -m bench.balance --quick --repeats 1
	$(BIN)/python -m bench.hotkeys --quick --repeats 1
	$(BIN)/python -m bench.metrics_cost --quick --repeats 3
	$(BIN)/python -m bench.join_types --quick --repeats 1
	$(BIN)/python -m bench.payload --quick --repeats 1
	$(BIN)/python -m bench.query --quick --repeats 1
	$(BIN)/python -m bench.aggregate --quick --repeats 1 --lag-seconds 20
	$(BIN)/python -m bench.audit --quick --repeats 1
	$(BIN)/python -m bench.kafka --quick --repeats 3
	$(BIN)/python -m bench.limit --rows 10000000 --repeats 2
	$(BIN)/python -m bench.startup --quick --repeats 3

bench-full: $(STAMP)
	$(BIN)/python -m bench
	$(BIN)/python -m bench.balance
	$(BIN)/python -m bench.hotkeys
	$(BIN)/python -m bench.metrics_cost
	$(BIN)/python -m bench.join_types
	$(BIN)/python -m bench.payload
	$(BIN)/python -m bench.query
	$(BIN)/python -m bench.aggregate
	$(BIN)/python -m bench.audit --repeats 3
	$(BIN)/python -m bench.kafka
	$(BIN)/python -m bench.limit --rows 10000000 --profile
	$(BIN)/python -m bench.startup
	$(BIN)/python -m bench.failover

# the configuration reference, made from protocol/config.py's defaults (tests/unit/test_config.py checks it is current)
docs: $(STAMP)
	$(BIN)/python -m protocol.config --reference > docs/configuration.md

clean:
	rm -rf out bench-report .pytest_cache
