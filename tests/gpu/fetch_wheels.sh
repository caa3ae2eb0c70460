#!/usr/bin/env bash
# Fetch what the GPU host lacks, as cp312 manylinux wheels, into DIR (default .whl at the
# repository root, ignored by git): nixl-cu13 1.5.1 (its unused nixl_ep_cu13/ stripped:
# 56 -> 29 MiB), pyzmq, msgspec and xxhash. Run it on a machine with pip and network
# access, then carry DIR to the GPU host (run_gpu_checks.sh --wheels DIR installs them
# into a temporary directory).
#   tests/gpu/fetch_wheels.sh [DIR] [--cuda 12|13]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR="$REPO/.whl"
CUDA=13
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --cuda) CUDA="${2:?--cuda needs 12 or 13}"; shift 2 ;;
    *) DIR="$1"; shift ;;
  esac
done
case "$CUDA" in 12|13) ;; *) echo "fetch_wheels.sh: --cuda must be 12 or 13" >&2; exit 2 ;; esac
mkdir -p "$DIR"
PLATFORMS=()
for n in 2_28 2_27 2_26 2_24 2_17 2014 1; do
  case "$n" in 2014|1) PLATFORMS+=(--platform "manylinux${n}_x86_64") ;;
                *) PLATFORMS+=(--platform "manylinux_${n}_x86_64") ;; esac
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DIR" \
  "nixl-cu${CUDA}==1.5.1" pyzmq msgspec xxhash
# drop the expert-parallel kernels (nixl_ep_*): kvbridge never loads them, and they are half
# the wheel (the device tool carries at most 64 MiB)
python3 - "$DIR" <<'PYEOF'
import pathlib, sys, zipfile
for wheel in pathlib.Path(sys.argv[1]).glob("nixl_cu*.whl"):
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        if not any(n.startswith("nixl_ep_") for n in names):
            continue
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith("nixl_ep_"):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line + b"\n" for line in data.splitlines()
                                    if not line.startswith(b"nixl_ep_"))
                dst.writestr(info, data)
    tmp.replace(wheel)
    print(f"stripped nixl_ep_* from {wheel.name}")
PYEOF
du -sh "$DIR"
