#!/usr/bin/env bash
# GPU checks of kvbridge with its KV in GPU memory: VRAM registration, VRAM->VRAM READ and
# WRITE between two processes (every byte verified; GB/s and the fixed cost per transfer
# of kvbridge, of raw NIXL doing what one request does, and of a device copy; the UCX
# protocol selected), CUDA IPC between two processes on one GPU, the nixl connector end
# to end with the engines' KV on the GPU (pull, push, TP 1 -> 2, every block verified),
# torch-mix64-v1 digests on the device against a CPU copy, and `kvbridge demo --device
# cuda` for every connector, model preset and TP 1 -> 2, 2 -> 1, PP 2 -> 1.
#
# NOT part of the test suite (CI has no GPU). Run it on a host with an NVIDIA GPU, from
# anywhere:   tests/gpu/run_gpu_checks.sh [--wheels DIR] [--out DIR] [--python PY]
#                                         [--budget S] [--dry-run-cpu] [-- GPU_CHECKS_ARGS]
#
# Needs on the GPU host: python3 (3.12) with torch built for CUDA, numpy and msgpack. What
# is missing comes as wheels in DIR (default: .whl at the repository root, ignored by git),
# installed into a temporary directory (nothing else on the host changes). Fetch them on
# a machine with pip and network access, from the repository root:
#   tests/gpu/fetch_wheels.sh .whl [--cuda 13]
# (nixl-cu13==1.5.1 pyzmq msgspec xxhash, the NIXL wheel stripped of nixl_ep_*: ~31 MiB.)
#
# Writes OUT/gpu_checks.json (the report), OUT/gpu_checks.log (everything printed) and
# OUT/gpu.md (the table; a GPU run also copies it to docs/gpu.md, to commit). OUT defaults
# to $OUT if set, else ./gpu-checks-out. Prints one table at the end. Exit code:
# gpu_checks.py's (0 all passed, 1 a check failed, 2 no CUDA / usage), 3 set-up failed
# (a module of kvbridge does not import: the missing library is named), 124 over
# --budget (default 290 s, so the whole run stays under 5 minutes).
# --dry-run-cpu runs the transfers, cost, connector, stores and demos checks on host memory, the KV
# guarded against host reads as GPU memory is: the script's own logic, no GPU.
set -u -o pipefail

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEELS="$REPO/.whl"
OUTDIR="${OUT:-$PWD/gpu-checks-out}"
PY=python3
BUDGET=290
EXTRA=()
DRY=
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --out) OUTDIR="${2:?--out needs a directory}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --dry-run-cpu) EXTRA+=(--checks transfers,cost,connector,stores,demos --device cpu --quick --iters 2
                           --jobs 1); DRY=1; shift ;;
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

# set-up check: every module of kvbridge imports (so every library it imports is here:
# torch, numpy, msgpack, msgspec, pyzmq, xxhash, NIXL), with what to do when one is missing
"$PY" - <<'PYEOF' || exit 3
import importlib, pkgutil, sys
import kvbridge
hints = {"torch": "torch with CUDA on the host", "zmq": "a pyzmq wheel in --wheels",
         "msgspec": "a msgspec wheel in --wheels", "xxhash": "an xxhash wheel in --wheels",
         "msgpack": "msgpack on the host", "numpy": "numpy on the host"}
missing = {}
for info in pkgutil.walk_packages(kvbridge.__path__, "kvbridge."):
    name = info.name
    # vLLM's adapter needs vLLM; the tests are not the product; mooncake's client module
    # needs Mooncake's wheel, which the demos check reports as not run when it is absent
    if name.startswith(("kvbridge.tests", "kvbridge.integrations.vllm", "kvbridge.build")):
        continue
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = (exc.name or "?").split(".")[0]
        if top in ("vllm", "mooncake", "matplotlib", "triton"):
            continue
        missing.setdefault(top, name)
    except Exception as exc:
        missing.setdefault(f"{name} ({type(exc).__name__}: {exc})", name)
try:
    from kvbridge.backends.nixl import load_nixl_api, loaded_nixl
    load_nixl_api()
    print("nixl:", loaded_nixl())
except Exception as exc:
    missing["NIXL"] = f"a nixl-cu13/nixl-cu12 wheel matching torch's CUDA in --wheels: {exc}"
if missing:
    print("run_gpu_checks.sh: missing:\n  " + "\n  ".join(
        f"{top}: {hints.get(top, 'needed by ' + str(where))}" for top, where in missing.items()),
        file=sys.stderr)
    sys.exit(1)
print("python", sys.version.split()[0], "- every kvbridge module imports")
PYEOF

cd "$REPO" || exit 3
# a GPU run writes docs/gpu.md (commit it); a dry run only its own copy in OUT
DOC=("--doc" "$OUTDIR/gpu.md")
timeout "$BUDGET" "$PY" "$REPO/tests/gpu/gpu_checks.py" --json "$OUTDIR/gpu_checks.json" \
    "${DOC[@]}" "${EXTRA[@]}" 2>&1 | tee "$OUTDIR/gpu_checks.log"
rc=${PIPESTATUS[0]}
if [ -z "$DRY" ] && [ -s "$OUTDIR/gpu.md" ]; then cp "$OUTDIR/gpu.md" "$REPO/docs/gpu.md"; fi
echo "run_gpu_checks.sh: exit $rc; report in $OUTDIR/gpu_checks.json and $OUTDIR/gpu.md"
exit "$rc"
