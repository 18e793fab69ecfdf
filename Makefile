# The two commands of the README:
#   make pipeline   prepare the real data, run 0 → 1 → 2 → 3 (demo preset), generate, write reports/report.md
#   make test       the whole test suite
# and the daily loop:
#   make quick      the fast tests (everything not marked slow; under 2 minutes on 2 cores)
#   make lint       ruff (rules in ruff.toml)
#   make lock       re-resolve requirements.txt into requirements.lock (after changing a pin)
# Each creates or refreshes the local virtual environment .venv first, from the lock file.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

.PHONY: pipeline test quick lint lock venv

venv: $(STAMP)

# llama-cpp-python builds llama.cpp from source: without the multimodal library (unused here), on every core
$(STAMP): export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF
$(STAMP): export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)
$(STAMP): requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	cp requirements.lock $(STAMP)

# requirements.txt names what the code imports; the lock pins everything they pull in. torch is written without its
# local build tag (+cpu), so pip takes the build that suits the machine (see requirements.txt).
lock: venv
	$(PY) -m pip install --quiet --disable-pip-version-check pip-tools==7.7.0
	$(PY) -m piptools compile --quiet --no-header --strip-extras --no-emit-index-url --no-emit-find-links --output-file requirements.lock requirements.txt
	sed -i -e 's/^torch==\([0-9.]*\)+[a-z0-9]*$$/torch==\1/' \
	    -e '1i # The full resolved environment of requirements.txt, written by `make lock`; `make venv` installs it.' \
	    requirements.lock

# glibc's malloc hands tensors of more than 32 MB back to the kernel when they are freed, so the next step gets
# fresh pages and pays a page fault for each 4 KB of them; keeping freed memory in the process makes the demo's
# training steps 10-20% faster on CPU (bench/README.md). Ignored outside glibc; an existing setting wins.
pipeline: export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
pipeline: venv
	$(PY) pipeline.py $(ARGS)

test: venv
	$(PY) data/prepare.py --tokenizer-only
	$(PY) -m pytest -q -rs tests

quick: venv
	$(PY) data/prepare.py --tokenizer-only
	$(PY) -m pytest -q -rs -m "not slow" tests

lint: venv
	$(PY) -m ruff check .
