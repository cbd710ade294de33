VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all env test test-fast lint main compare bench clean

all: test

env:
	bash scripts/setup_env.sh

test: env
	$(PY) -m pytest -q -p no:cacheprovider tests $(PYTEST_ARGS)

test-fast: env
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check gpattn tests benchmarks

main: env
	$(VENV)/bin/gpattn regression --out runs/regression

compare: env
	$(VENV)/bin/gpattn compare

bench: env
	$(PY) benchmarks/kl_scaling.py

clean:
	rm -rf build dist *.egg-info runs .pytest_cache .ruff_cache .hypothesis benchmarks/results site
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print -exec rm -rf {} +
