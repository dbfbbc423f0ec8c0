VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test serve

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,server]'

test: setup
	$(PY) -m pytest tests

serve: setup
	$(VENV)/bin/moeferry serve
