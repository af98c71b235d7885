# Two commands on a fresh machine: `make demo` runs the main job on the CPU default, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# Prefect's first start migrates its SQLite database (~30 s on 2 cores); no telemetry offline.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: install test demo clean

install: $(VENV)/.installed

# torch first, pinned to the CPU build, so resolving `torch>=2.5` never pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/eagle3 config configs/tiny-cpu.yaml > /dev/null
	@echo "configs/tiny-cpu.yaml is valid."
	@echo "make demo: the end-to-end pipeline (data -> train -> serve -> gate) is not available yet;"
	@echo "today the format tools are: eagle3 inspect | convert | validate (see README.md)."

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
