# The two README commands: `make demo` and `make test`. Each does its own set-up.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvbridge-setup
# ^ib only on a host without InfiniBand/RoCE devices (else UCX processes segfault at exit
# here; on an RDMA host it would force TCP): the same rule as kvbridge.backends.env_defaults
ifeq ($(wildcard /sys/class/infiniband/*),)
export UCX_MODULES ?= ^ib
endif
export NIXL_LOG_LEVEL ?= WARN
export MC_LOG_LEVEL ?= WARNING

.PHONY: setup demo test lint typecheck pytest test-slow test-auth test-guard clean

setup: $(STAMP)

# setup.py and the C source: a change rebuilds the fs tier's extension (pip install -e)
$(STAMP): pyproject.toml setup.py offload/_fsio.c .ci/setup.sh
	bash .ci/setup.sh

demo: $(STAMP)
	$(VENV)/bin/kvbridge demo $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy resolves `kvbridge` through a symlink: the repository root is the package.
typecheck: $(STAMP)
	mkdir -p .typecheck && ln -sfn $(CURDIR) .typecheck/kvbridge
	MYPYPATH=.typecheck $(VENV)/bin/mypy --config-file pyproject.toml -p kvbridge

pytest: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not vllm" $(PYTEST_ARGS)

test: lint typecheck pytest

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not vllm" $(PYTEST_ARGS)

# The tests of everything that listens or connects, again with a cluster secret configured
# for every engine, client and tool they start (kvbridge.auth; `make test` runs without one).
AUTH_TESTS ?= tests/auth tests/handshake tests/connectors/nixl tests/engine tests/events tests/tools
test-auth: $(STAMP)
	KVBRIDGE_SECRET=make-test-auth-cluster-secret-0123456789 KVBRIDGE_SECRET_FILE= \
		$(PY) -m pytest -q -m "not slow and not vllm" $(AUTH_TESTS) $(PYTEST_ARGS)

# The connector suite again with every engine's KV guarded against host reads
# (kvbridge.layouts.kv_memory): KV then refuses what GPU memory refuses (numpy, tolist,
# the buffer protocol), so a host-only read of device KV fails here, on a CPU.
# Left out: files that test a protocol, a CLI or a registry, whose KV reads are the same
# worker paths the files kept here run (make test runs them all, unguarded); and the
# mooncake_te connector (12 tests, ~2.3 min): it moves host memory only (device KV is a
# config error) over the PD core the nixl cases run here guarded.
GUARD_TESTS ?= tests/connectors
GUARD_IGNORE ?= $(addprefix --ignore=tests/connectors/,nixl/test_hostile_peers.py \
	nixl/test_cli.py nixl/test_notif_sessions.py nixl/test_params_bounds.py nixl/test_netns.py \
	nixl/test_auth.py nixl/test_sealed_params.py test_registry_source_tree.py \
	test_conformance_negative.py mooncake_store/test_demo.py)
test-guard: $(STAMP)
	KVBRIDGE_KV_HOST_GUARD=1 $(PY) -m pytest -q -m "not slow and not vllm" $(GUARD_TESTS) \
		$(GUARD_IGNORE) -k "not mooncake_te" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# Real vLLM (CPU build) with kvbridge's connectors: its own venv, see integrations/vllm/setup.sh.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvbridge-vllm-setup
VLLM_TESTS ?= tests/integrations
.PHONY: setup-vllm test-vllm
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py offload/_fsio.c integrations/vllm/setup.sh
	bash integrations/vllm/setup.sh

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 KVBRIDGE_VLLM_PYTHON=$(VLLM_VENV)/bin/python KVBRIDGE_VLLM_LOGS=$(CURDIR)/build/vllm-logs \
		$(VLLM_VENV)/bin/python -m pytest -q -m vllm --timeout 900 $(VLLM_TESTS) $(PYTEST_ARGS)
