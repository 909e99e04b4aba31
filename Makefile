# The two commands of the README: `make demo` and `make test`. Both set themselves up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-stop test bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	@$(VENV)/bin/tidemark demo

demo-stop: setup
	@$(VENV)/bin/tidemark demo --stop

test: setup
	@$(PY) -m pytest tests

bench: setup
	@$(PY) benchmarks/run_all.py

clean:
	rm -rf .tidemark .pytest_cache
