# The two commands of the README: `make demo` and `make test`. Both set themselves up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-stop test bench dist clean

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

# the library as a zip for Spark executors (--py-files), cached by content hash; prints its path
dist: setup
	@PYTHONPATH=include $(PY) -m tidemark.sparkconf

clean:
	rm -rf .tidemark .pytest_cache
