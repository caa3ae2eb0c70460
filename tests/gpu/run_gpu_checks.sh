#!/usr/bin/env bash
# GPU checks of kvbridge's NIXL path (issue 15): VRAM registration, VRAM->VRAM READ/WRITE
# between two processes (every byte verified, GB/s of kvbridge vs raw NIXL vs a torch
# device-to-device copy, the UCX protocol selected), CUDA IPC between two processes on one
# GPU, the nixl connector's pull and push with KV in CUDA memory, and torch-mix64-v1 digests
# of device KV against a CPU copy (issue 18).
#
# NOT part of the test suite (CI has no GPU). Run it on a host with an NVIDIA GPU, from
# anywhere:   tests/gpu/run_gpu_checks.sh [--wheels DIR] [--out DIR] [--python PY]
#                                         [--budget S] [--dry-run-cpu] [-- GPU_CHECKS_ARGS]
#
# Needs on the GPU host: python3 (3.12) with torch built for CUDA, numpy and msgpack. What
# is missing comes as wheels in DIR (default: .whl at the repository root, ignored by git),
# installed into a temporary directory (nothing else on the host changes). Fetch them on
# a machine with pip and network access, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl nixl-cu13==1.5.1 pyzmq
# (nixl-cu13 for a CUDA 13 torch, nixl-cu12 for CUDA 12; together about 57 MiB.)
#
# Writes OUT/gpu_checks.json (the report) and OUT/gpu_checks.log (everything printed);
# OUT defaults to $OUT if set, else ./gpu-checks-out. Exit code: gpu_checks.py's (0 all
# passed, 1 a check failed, 2 no CUDA / usage), 3 set-up failed, 124 over --budget
# (default 290 s, so the whole run stays under 5 minutes).
# --dry-run-cpu runs the transfers check on host memory: the script's own logic, no GPU.
set -u -o pipefail

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEELS="$REPO/.whl"
OUTDIR="${OUT:-$PWD/gpu-checks-out}"
PY=python3
BUDGET=290
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --out) OUTDIR="${2:?--out needs a directory}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --dry-run-cpu) EXTRA+=(--checks transfers --device cpu --quick --iters 2); shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    *) echo "run_gpu_checks.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "run_gpu_checks.sh: --budget must be whole seconds" >&2
                               exit 2 ;; esac

mkdir -p "$OUTDIR" || exit 3
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvb-gpu-checks.XXXXXX") || exit 3
trap 'rm -rf "$TMP"' EXIT

if compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into a temporary dir"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$TMP/site" "$WHEELS"/*.whl || { echo "wheel install failed" >&2; exit 3; }
fi
mkdir -p "$TMP/pp" && ln -s "$REPO" "$TMP/pp/kvbridge"  # the repository root IS the package
export PYTHONPATH="$TMP/pp:$TMP/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}"

# set-up check: every import the checks need, with what to do when one is missing
"$PY" - <<'PYEOF' || exit 3
import importlib, sys
need = {"torch": "torch with CUDA on the host", "numpy": "numpy on the host",
        "msgpack": "msgpack on the host", "zmq": "a pyzmq wheel in --wheels"}
missing = []
for name, what in need.items():
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name} ({what}): {exc!r}")
try:
    from kvbridge.backends.nixl import load_nixl_api, loaded_nixl
    load_nixl_api()
    print("nixl:", loaded_nixl())
except Exception as exc:
    missing.append(f"NIXL (a nixl-cu13/nixl-cu12 wheel matching torch's CUDA in --wheels): {exc}")
if missing:
    print("run_gpu_checks.sh: missing:\n  " + "\n  ".join(missing), file=sys.stderr)
    sys.exit(1)
print("python", sys.version.split()[0])
PYEOF

cd "$REPO" || exit 3
timeout "$BUDGET" "$PY" "$REPO/tests/gpu/gpu_checks.py" --json "$OUTDIR/gpu_checks.json" \
    "${EXTRA[@]}" 2>&1 | tee "$OUTDIR/gpu_checks.log"
rc=${PIPESTATUS[0]}
echo "run_gpu_checks.sh: exit $rc; report in $OUTDIR/gpu_checks.json"
exit "$rc"
