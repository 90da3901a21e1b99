# Set-up and everyday commands. Each target creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TESTS ?= tests

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -c constraints-cpu.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)  ## The main job on the CPU: task, SFT warm start, BAPO with the embedded engine, export, eval, plots
	$(PY) examples/demo.py

test: $(STAMP) lint  ## Lint, then every test tier; GPU tests skip without CUDA (pytest exit 5, no tests, is not a failure)
	$(PY) -m pytest $(TESTS) || [ $$? -eq 5 ]

test-fast: $(STAMP) lint  ## The everyday loop: every tier but the files marked slow (the full run is `make test`)
	$(PY) -m pytest -m "not slow" $(TESTS) || [ $$? -eq 5 ]

lint: $(STAMP)  ## ruff check and ruff format --check over the whole tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)  ## BAPO search and loss benchmark (prints a table)
	$(PY) benchmarks/bench_bapo_search.py

clean:
	rm -rf $(VENV) .pytest_cache
