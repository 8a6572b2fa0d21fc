# The README's two commands (demo, test), and a fast tier for editing (check).
# Needs only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnquant-installed

.PHONY: demo test check install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# MAX 26.7 does not resolve with pip < 24.
	$(PY) -m pip install -q --upgrade "pip>=24"
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m attnquant demo

# Everything, real MAX graphs and servers on CPU included (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -q

# The tests that compile no MAX graph: minutes, for the edit-test loop.
check: $(STAMP)
	$(PY) -m pytest -q -m "not max"
