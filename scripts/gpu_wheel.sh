#!/usr/bin/env bash
# Build, on any Linux x86_64 machine (no GPU needed), a Horovod wheel with NCCL for another
# machine's Python and torch, to install there with no network:
#   a venv with that Python -> PyPI's CUDA build of that torch -> a CUDA toolkit from PyPI's
#   NVIDIA packages (scripts/cuda_toolkit.py) -> Horovod built from the PyPI sdist with
#   scripts/patches/ applied: PyTorch only, HOROVOD_GPU_OPERATIONS=NCCL, Gloo, no MPI (nothing
#   to match on the target), CUDA kernels for --cc, debug info stripped -> OUT/ with the wheels
#   of Horovod's runtime dependencies for that Python.
#
# Usage: scripts/gpu_wheel.sh --python VERSION|PATH --torch VERSION [--out DIR] [--cc LIST]
#   --python  the target's Python: 3.12, or an interpreter (found: pythonX.Y on PATH, then pyenv)
#   --torch   the target's torch version, e.g. 2.11.0 (`python -c 'import torch;
#             print(torch.__version__)'` there; PyPI's wheel of it must be the same CUDA build)
#   --out     where the wheels go (default: .gpu_wheels at the repository root, which git ignores
#             and the device tool carries: run(carry=[".gpu_wheels"]))
#   --cc      compute capabilities of the CUDA kernels (default 80,90: A100, H100/H200)
# Environment: HOROVOD_AQ_CACHE (default ~/.cache/horovod_aq: the build venv, the toolkit, logs),
#   TORCH_INDEX_URL (take torch from this index instead of PyPI).
# On the target: pip install --no-index --find-links .gpu_wheels horovod
# (benchmarks/gpu_check.sh does). docs/gpu.md § Building Horovod for the GPU.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=versions.env
source "$ROOT/scripts/versions.env"
TARGET_PY="" TORCH="" OUT="$ROOT/.gpu_wheels" CC="80,90"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET_PY="$2"; shift 2 ;;
    --torch) TORCH="$2"; shift 2 ;;
    --out) OUT="$(realpath -m "$2")"; shift 2 ;;
    --cc) CC="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu_wheel: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
say() { printf '[gpu_wheel] %s\n' "$*" >&2; }
die() { printf '[gpu_wheel] ERROR: %s\n' "$*" >&2; exit 1; }
[ -n "$TARGET_PY" ] && [ -n "$TORCH" ] || die "give --python and --torch (see --help)"

# ---------------------------------------------------------------- the target's Python
# the first that runs: the path given, pythonX.Y on PATH (a pyenv shim may not), pyenv's newest X.Y
INTERP=""
for candidate in "$TARGET_PY" "python$TARGET_PY" \
    $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$TARGET_PY"*/bin/python 2>/dev/null | sort -rV); do
  if "$candidate" -c 'import venv' >/dev/null 2>&1; then INTERP="$candidate"; break; fi
done
[ -n "$INTERP" ] \
  || die "no Python $TARGET_PY here: install it (e.g. pyenv install $TARGET_PY) or pass --python /path/to/python"
PYVER="$("$INTERP" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

# ---------------------------------------------------------------- build venv with that torch
CACHE="${HOROVOD_AQ_CACHE:-$HOME/.cache/horovod_aq}"
VENV="$CACHE/gpu-wheel/venv-py$PYVER-torch$TORCH"
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$INTERP" -m venv "$VENV"; }
PY="$VENV/bin/python"
pip_quiet() { "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
say "installing torch $TORCH (CUDA build) and the build tools into $VENV"
pip_quiet install -q "torch==$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
pip_quiet install -q numpy setuptools wheel packaging "$CMAKE_PIP_SPEC"
TORCH_FULL="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null \
  || die "torch $TORCH_FULL from this index is a CPU build; set TORCH_INDEX_URL to a CUDA index"
CUDA_HOME="$("$PY" "$ROOT/scripts/cuda_toolkit.py" --dest "$CACHE/cuda")"

# ---------------------------------------------------------------- Horovod
PATCH="$ROOT/scripts/patches/horovod-${HOROVOD_VERSION}.patch"
BUILD="$(mktemp -d "${TMPDIR:-/tmp}/gpu-wheel-XXXXXX")"
trap 'rm -rf "$BUILD"' EXIT
pip_quiet download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" \
  || die "could not download the horovod==$HOROVOD_VERSION sdist from PyPI"
tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
patch -d "$BUILD/horovod-$HOROVOD_VERSION" -p1 --quiet < "$PATCH"
mkdir -p "$CACHE/logs"
LOG="$CACHE/logs/gpu-wheel-py$PYVER-torch$TORCH_FULL.log"
say "building Horovod $HOROVOD_VERSION for Python $PYVER, torch $TORCH_FULL, CUDA kernels for $CC (log: $LOG)"
# NCCL and the CUDA runtime are torch's own, found at run time through the rpath (--ldflags).
# CUDA_HOME: torch's cpp_extension, which Horovod's CMake asks whether torch has CUDA.
if ! env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_GPU_OPERATIONS=NCCL \
    HOROVOD_CUDA_HOME="$CUDA_HOME" HOROVOD_NCCL_HOME="$CUDA_HOME" HOROVOD_NCCL_LINK=SHARED \
    CUDA_HOME="$CUDA_HOME" \
    HOROVOD_BUILD_CUDA_CC_LIST="$CC" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    LDFLAGS="$("$PY" "$ROOT/scripts/cuda_toolkit.py" --ldflags)" \
    MAKEFLAGS="-j$(nproc)" HOROVOD_CMAKE="$VENV/bin/cmake" PATH="$VENV/bin:$PATH" \
    "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$BUILD/dist" \
    "$BUILD/horovod-$HOROVOD_VERSION" >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  die "Horovod build failed; full log: $LOG"
fi

# ---------------------------------------------------------------- strip, collect, check
WHEEL="$(ls "$BUILD"/dist/horovod-*.whl)"
"$PY" -m wheel unpack -d "$BUILD/unpacked" "$WHEEL" >/dev/null
find "$BUILD/unpacked" -name '*.so' -exec strip --strip-debug {} +
mkdir -p "$OUT"
rm -f "$OUT"/horovod-*-cp"${PYVER/./}"-*.whl
"$PY" -m wheel pack -d "$OUT" "$BUILD"/unpacked/horovod-* >/dev/null
say "Horovod's runtime dependencies for Python $PYVER (this venv's Python: the target's)"
pip_quiet download -q --only-binary :all: -d "$OUT" "$(ls "$OUT"/horovod-*-cp"${PYVER/./}"-*.whl)"
echo "torch $TORCH_FULL" > "$OUT/TARGET-py$PYVER.txt"
"$PY" - "$OUT" <<'EOF'
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
wheel = max(out.glob("horovod-*.whl"), key=lambda p: p.stat().st_mtime)
names = zipfile.ZipFile(wheel).namelist()
assert any(n.startswith("horovod/torch/mpi_lib_v2") for n in names), "no torch extension"
EOF
say "ready: $OUT ($(du -sh "$OUT" | cut -f1)); on the target: pip install --no-index --find-links $OUT horovod"
