#!/usr/bin/env bash
# Sets up everything kvbridge needs on a fresh machine, and reuses it on the next run.
# Called by `make setup` (and so by `make demo` / `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# Debian libraries that Mooncake's wheel links against; iproute2 for the netns tests.
need_apt=()
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1 libcurl.so.4; do
    if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then need_apt+=("$lib"); fi
done
command -v ip >/dev/null 2>&1 || need_apt+=(ip)
# a C compiler and Python's headers build the fs tier's optional C extension
# (offload/_fsio.c: GIL-free block reads); without them the install goes on and the tier
# reads in Python, slower (`kvbridge doctor` says which)
command -v cc >/dev/null 2>&1 || need_apt+=(cc)
"$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need_apt+=(Python.h)
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian packages for: ${need_apt[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            libibverbs1 librdmacm1 libnuma1 libcurl4 iproute2 gcc python3-dev >/dev/null
    else
        echo "setup: missing system libraries (${need_apt[*]}); install libibverbs1 librdmacm1 libnuma1 libcurl4 iproute2 gcc python3-dev" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extras=test,triton
    # torch first, to learn its CUDA: the NIXL build must link the same CUDA major, and
    # pip cannot read torch's CUDA in a marker. The base install brings nixl-cu12 (CPU and
    # CUDA 12 torch); a CUDA 13 torch adds nixl-cu13 (kvbridge[cu13]), which kvbridge
    # loads first there (backends/nixl/load.py).
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "setup: installing torch"
        "${PIP[@]}" install "torch>=2.4"
    fi
    cuda_major=$("$VENV/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
    case "$cuda_major" in
        # Mooncake's CUDA wheel links libcudart of one major: its CUDA 13 build is its own
        # package (mooncake-transfer-engine-cuda13)
        12) extras="$extras,cu12,mooncake" ;;
        13) extras="$extras,cu13,mooncake-cu13" ;;
        *) extras="$extras,mooncake"
           echo "setup: torch has no CUDA 12/13 build (torch.version.cuda major '${cuda_major}'); NIXL stays nixl-cu12" ;;
    esac
else
    extras=test,triton,mooncake-cpu
    # A CPU build of torch: an unpinned torch would pull several GB of CUDA.
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "setup: installing CPU torch"
        "${PIP[@]}" install "torch==2.13.0"
    fi
fi

echo "setup: installing kvbridge[$extras] (editable)"
"${PIP[@]}" install -e ".[$extras]"
touch "$VENV/.kvbridge-setup"
