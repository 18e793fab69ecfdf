# The two commands of the README:
#   make pipeline   prepare the real data, run 0 → 1 → 2 → 3 (demo preset), generate, write reports/report.md
#   make test       the test suite
# Each creates or refreshes the local virtual environment .venv first.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

.PHONY: pipeline test venv

venv: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	cp requirements.txt $(STAMP)

# glibc's malloc hands tensors of more than 32 MB back to the kernel when they are freed, so the next step gets
# fresh pages and pays a page fault for each 4 KB of them; keeping freed memory in the process makes the demo's
# training steps 10-20% faster on CPU (bench/README.md). Ignored outside glibc; an existing setting wins.
pipeline: export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
pipeline: venv
	$(PY) pipeline.py $(ARGS)

test: venv
	$(PY) data/prepare.py --tokenizer-only
	$(PY) -m pytest -q tests
