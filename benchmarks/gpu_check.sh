#!/usr/bin/env bash
# GPU check of the Triton kernels, for a bare CUDA machine (torch with CUDA, triton, numba, scipy,
# pytest, hypothesis; no Horovod, no TensorFlow):
#   1. tests/test_triton_kernels.py compiled for the GPU (TRITON_INTERPRET unset): byte-exact
#      against the numpy oracle, all bit widths, ragged buckets, fp16/bf16/fp32;
#   2. benchmarks/gpu_check.py: PTX instruction check, encode/decode_average throughput against
#      a device-to-device copy (16M and 64M float32, 2/3/4/8 bits), the rANS entropy coder
#      (tests/test_triton_entropy.py first; 16M and 64M symbols against DietGPU's 250-410 GB/s
#      on A100), a single-process packed step.
# The report goes to benchmarks/results/gpu.md, or to the path given as the first argument.
# About 4-6 minutes on one H100/H200, most of it Triton compiling the kernel variants.
#
#     benchmarks/gpu_check.sh [REPORT.md]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
unset TRITON_INTERPRET
PYTHON=${PYTHON:-python}
"$PYTHON" -c 'import sys, torch
sys.exit(0 if torch.cuda.is_available() else
         "no CUDA device: on CPU run python benchmarks/gpu_check.py --dry-run instead")'
start=$SECONDS
"$PYTHON" -m pytest tests/test_triton_kernels.py tests/test_triton_entropy.py -q -p no:cacheprovider
echo "tests: $((SECONDS - start)) s"
"$PYTHON" benchmarks/gpu_check.py --out "${1:-benchmarks/results/gpu.md}"
"$PYTHON" benchmarks/gpu_check_ddp.py --out benchmarks/results/gpu_ddp.md
echo "total: $((SECONDS - start)) s"
