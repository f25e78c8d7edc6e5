# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build first (on local disk here); an unpinned torch would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

# The default run plus the slow chaos runs (what CI runs).
test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

clean:
	rm -rf $(VENV)
