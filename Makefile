VENV ?= .venv
PY := $(VENV)/bin/python
# Made once the venv holds torch and the package; remade only when pyproject.toml changes, so
# `make serve` does not reinstall on every start.
STAMP := $(VENV)/.installed

.PHONY: setup test serve

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,server]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest tests

# Without --model this serves the random-weight demo model (made in ~/.cache/moeferry on first use).
# Pass flags with SERVE_ARGS, e.g. make serve SERVE_ARGS="--model DIR --port 8000".
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/moeferry serve $(SERVE_ARGS)
