VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all env test test-fast lint main quick tune regression results bench docs notebooks clean

all: test

env:
	bash scripts/setup_env.sh

# one worker process per core (pytest-xdist), each test file in one worker (its module fixtures built once); every
# test runs with one torch thread (tests/conftest.py)
XDIST := -n auto --dist loadfile

test: env
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) tests $(PYTEST_ARGS)

test-fast: env
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow" tests $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check gpattn tests benchmarks

# extra options of main / quick / regression, e.g. make main ARGS=--resume (continue an interrupted run) or
# ARGS=--overwrite (replace the earlier results); an existing run folder is never overwritten without one of them
ARGS ?=

# the main job (the protocol's primary endpoint on a subset of its seeds): the primary pair kep_svgp and softmax (each
# with its +ts row) on MNIST-1D, seeds 0-6, in the tuned configurations (gpattn/comparison/tuned/), two runs at a time
# with one torch thread each (all 10 seeds took 1063 s, over the 15-minute budget); `gpattn compare --full` runs the
# declared grid: every row of the main table on both tasks, the primary pair with all 10 seeds
main: env
	$(VENV)/bin/gpattn compare --main --jobs 2 --out runs/main $(ARGS)

# a smoke test (one seed, few epochs): checks that everything runs, compares nothing; one process (its runs are too
# short for two workers' start-up to pay off: --jobs 2 was no faster in measurements)
quick: env
	$(VENV)/bin/gpattn compare --quick --out runs/quick $(ARGS)

# the tuning of every row on validation (docs/guide/tuning.md): 20 trials per (task, row), two trial workers with one
# torch thread each; writes the tuned configurations into the package (gpattn/comparison/tuned/<task>.json, to review
# and commit) and keeps the studies in runs/tune/study.db (make tune ARGS=--resume continues an interrupted tuning)
tune: env
	$(VENV)/bin/gpattn tune --jobs 2 --out runs/tune --write-tuned $(ARGS)

regression: env
	$(VENV)/bin/gpattn regression --out runs/regression $(ARGS)

# docs/guide/results.md (and its figures, docs/guide/results_figures/) generated from the records of runs/main and, if
# it exists, runs/full (gpattn compare --full): no number on the page is typed by hand; RESULTS_CHECKS: run folders of
# the same comparison under a perturbation (--threads 2, another seed block) whose primary verdict the page checks
RESULTS_RUNS ?= runs/main $(wildcard runs/full)
RESULTS_CHECKS ?=
results: env
	$(VENV)/bin/gpattn report $(RESULTS_RUNS) --page docs/guide/results.md $(if $(RESULTS_CHECKS),--same-verdict $(RESULTS_CHECKS))

# the documentation site (strict: warnings fail) into site/
docs: env
	$(VENV)/bin/mkdocs build --strict

# re-execute the notebooks at full size from their sources notebooks/NN_*.py, writing the paired .ipynb (outputs
# committed); one notebook: make notebooks NOTEBOOKS=notebooks/02_kernel_eigen_svgp_regression.py
NOTEBOOKS ?= $(wildcard notebooks/[0-9][0-9]_*.py)
notebooks: env
	$(PY) scripts/execute_notebooks.py $(NOTEBOOKS)

bench: env
	$(PY) benchmarks/kl_scaling.py

clean:
	rm -rf build dist *.egg-info runs .pytest_cache .ruff_cache .hypothesis benchmarks/results site
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print -exec rm -rf {} +
