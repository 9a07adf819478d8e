# Two commands on a fresh machine: `make demo` (the main job, embedded, no servers) and `make test`.
# Both create .venv and install everything pinned in requirements.lock on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# the ledger core compiled with mypyc (scripts/build_core.py; ledger/_compiled.py loads it only when it was
# built from the sources on disk): rebuilt when they change. Without a C compiler the core runs as plain Python;
# CHIPLEDGER_REQUIRE_COMPILED=1 (CI) makes that an error.
CORE   := $(VENV)/chipledger-core/manifest.json
# every ledger/*.py: a superset of ledger/_compiled.py's MODULES (build_core.py rebuilds only when their digest changed)
CORE_SOURCES := $(wildcard ledger/*.py)

.PHONY: demo test bench core clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[test,core]'
	touch $(STAMP)

$(CORE): $(STAMP) $(CORE_SOURCES) scripts/build_core.py
	$(PY) scripts/build_core.py $(if $(CHIPLEDGER_REQUIRE_COMPILED),--require)

core: $(CORE)

demo: $(CORE)
	$(VENV)/bin/chipledger demo

test: $(CORE)
	bash scripts/postgres.sh ensure
	bash scripts/prometheus.sh ensure
	bash scripts/chromium.sh ensure
	bash scripts/slurm.sh ensure
	bash scripts/valgrind.sh ensure
	PYTHON=$(PY) bash scripts/kube.sh ensure  # builds once per machine (~14 min, cached in ~/.cache/chipledger/kube)
	$(PY) -m pytest; status=$$?; bash scripts/kube.sh stop; exit $$status

bench: $(CORE)
	$(PY) bench/replay.py

clean:
	rm -rf $(VENV) demo lake chipledger.db .pytest_cache .hypothesis
