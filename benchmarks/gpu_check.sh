#!/usr/bin/env bash
# GPU check, for a bare CUDA machine (torch with CUDA, triton, numba, scipy, pytest, hypothesis;
# no Horovod, no TensorFlow). One call runs every GPU-side test and throughput check:
#   1. tests/test_triton_kernels.py and tests/test_triton_entropy.py compiled for the GPU
#      (TRITON_INTERPRET unset): byte-exact against the numpy oracle, all bit widths, ragged
#      buckets, fp16/bf16/fp32, the rANS entropy coder;
#   1b. tests/test_triton_compensated.py compiled for the GPU: error feedback fused into the
#      encode (payload, new memory, its finiteness and norm bitwise the oracle's; the torch wire
#      with it bitwise the unfused steps; large inputs; the send's one host synchronisation);
#   2. benchmarks/gpu_check.py: PTX instruction check, encode/decode_average throughput against
#      a device-to-device copy (16M and 64M float32, 2/3/4/8 bits), the fused error-feedback
#      encode (64M float32, 2/3/4 bits, against the copy and the unfused steps), the rANS
#      entropy coder (16M and 64M symbols, beside DietGPU's 250-410 GB/s on A100), a
#      single-process packed step;
#   3. benchmarks/gpu_check_ddp.py: the DDP hook over NCCL (bit-exact against the oracle,
#      markers, step time against DDP's fp32 allreduce, host syncs and device kernels per
#      step), then the same with two ranks sharing
#      GPU 0 over Gloo (CUDA tensors), the multi-rank averages on a one-GPU machine;
#   4. Horovod with NCCL: installed from .gpu_wheels/ (scripts/gpu_wheel.sh builds it on a CPU
#      machine for this machine's Python and torch; run(carry=[".gpu_wheels"]) brings it) unless
#      one is installed, then benchmarks/gpu_check_horovod.py under horovodrun -np 1: the packed
#      optimizer on CUDA tensors bit-exact against the oracle, its host synchronisations and
#      device kernels per step, its step time next to Horovod's fp32 optimizer;
#   5. benchmarks/kernels.py --entropy on the machine's CPU, one thread (a quiet machine: the
#      fixed-width and entropy-coded CPU kernels, docs/format.md §12).
# Every step runs even when an earlier one failed, each under its own time limit, so one call
# gives every number; the exit status is 1 if any step failed. Reports go to OUTDIR (default
# benchmarks/results): gpu.md, gpu_ddp.md, gpu_ddp_shared.md, gpu_horovod.md,
# kernels_entropy_gpu_host.md, and gpu_check.log (the whole output, with each step's exit status
# and seconds). Runs 1 and 2 took 86 and 164 s on one H200 before the Horovod and shared-GPU
# steps (each test step compiles its kernel variants once: about 1-2 s each).
#
#     benchmarks/gpu_check.sh [OUTDIR]
#     PYTHON=python3 benchmarks/gpu_check.sh "$OUT"      # on the device machine
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
OUTDIR=${1:-benchmarks/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
"$PYTHON" -c 'import sys, torch
sys.exit(0 if torch.cuda.is_available() else
         "no CUDA device: on CPU run python benchmarks/gpu_check.py --dry-run instead")' || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
  | tee -a "$LOG"

failed=()
start=$SECONDS
# step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output into the log
step() {
  local name=$1 limit=$2 began=$SECONDS rc
  shift 2
  echo "=== $name (limit $limit s): $*" | tee -a "$LOG"
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - began)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

# (the dry run of gpu_check.py is a CPU test: the next step runs the real one)
step triton-tests 220 "$PYTHON" -m pytest tests/test_triton_kernels.py \
  tests/test_triton_entropy.py -q -p no:cacheprovider -o addopts= -rfE --durations=5 \
  -k "not gpu_check_dry_run"
step triton-ef-tests 240 "$PYTHON" -m pytest tests/test_triton_compensated.py -q \
  -p no:cacheprovider -o addopts= -rfE --durations=5 -k "not compiles_for_the_gpu"
step gpu-check 190 "$PYTHON" benchmarks/gpu_check.py --out "$OUTDIR/gpu.md"
step gpu-check-ddp 90 "$PYTHON" benchmarks/gpu_check_ddp.py --out "$OUTDIR/gpu_ddp.md"
step gpu-check-ddp-shared 120 "$PYTHON" benchmarks/gpu_check_ddp.py --share-gpu 2 \
  --timing-steps 5 --out "$OUTDIR/gpu_ddp_shared.md"
# Horovod: the carried wheel for this Python (with the dependencies carried beside it, into
# HOROVOD_SITE, first on PYTHONPATH), unless a Horovod with NCCL is installed already
export HOROVOD_SITE=${HOROVOD_SITE:-/tmp/horovod_site}
export PYTHONPATH="$HOROVOD_SITE:$PYTHONPATH"
install_horovod() {
  "$PYTHON" -c 'import horovod.torch as h, sys; sys.exit(0 if h.nccl_built() else 1)' 2>/dev/null \
    && { echo "Horovod with NCCL is installed"; return 0; }
  local tag
  tag="cp$("$PYTHON" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
  ls .gpu_wheels/horovod-*-"$tag"-*.whl >/dev/null 2>&1 || {
    echo "no Horovod wheel for $tag in .gpu_wheels/: on a CPU machine run scripts/gpu_wheel.sh" \
         "--python X.Y --torch VERSION (this machine's, docs/gpu.md) and carry .gpu_wheels"
    return 1; }
  cat .gpu_wheels/TARGET-*.txt 2>/dev/null
  "$PYTHON" -m pip install -q --no-index --no-compile --find-links .gpu_wheels \
    --target "$HOROVOD_SITE" horovod \
    && "$PYTHON" -c 'import horovod.torch as h; assert h.nccl_built(), "built without NCCL"; print("installed", h.__file__)'
}
export -f install_horovod
export PYTHON
step horovod-install 120 bash -c install_horovod
step gpu-check-horovod 180 "$PYTHON" -m horovod.runner.launch --gloo -np 1 -H localhost:1 \
  "$PYTHON" benchmarks/gpu_check_horovod.py --out "$OUTDIR/gpu_horovod.md"
step cpu-entropy-kernels 90 "$PYTHON" benchmarks/kernels.py --entropy --sizes 1M,16M \
  --bits 2,3,4 --repeats 2 --output "$OUTDIR/kernels_entropy_gpu_host.md"

echo "total: $((SECONDS - start)) s; failed: ${failed[*]:-none}" | tee -a "$LOG"
[ "${#failed[@]}" -eq 0 ]
