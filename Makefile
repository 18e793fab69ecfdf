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

pipeline: venv
	$(PY) pipeline.py $(ARGS)

test: venv
	$(PY) data/prepare.py --tokenizer-only
	$(PY) -m pytest -q tests
