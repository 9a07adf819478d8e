# Two commands on a fresh machine: `make demo` (the main job, embedded, no servers) and `make test`.
# Both create .venv and install everything pinned in requirements.lock on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/chipledger demo

test: $(STAMP)
	bash scripts/postgres.sh ensure
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/replay.py

clean:
	rm -rf $(VENV) demo lake chipledger.db .pytest_cache .hypothesis
