#!/usr/bin/env bash
# Build an image and test it, from the repository root:
#   docker/build.sh cpu|gpu [TAG]      (default tag: horovod_aq:cpu or horovod_aq:gpu)
# 1. docker build -f docker/Dockerfile[.gpu] (BuildKit; needs the base image python:3.11-slim-
#    bookworm from a registry or the local cache: `docker pull` it, or load it, first);
# 2. self-test in the image, no GPU needed: `horovod-aq doctor` (versions, controllers, a codec
#    round trip), and for the GPU image Horovod's NCCL build and torch's CUDA build;
# 3. GPU image on a host with a GPU (nvidia-smi works and Docker has the NVIDIA Container
#    Toolkit): `nvidia-smi` in the container, then benchmarks/gpu_check.sh inside it, its
#    reports written to docker-gpu-check/ here.
# Exit status: the first failing step's. docker/README.md § Build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KIND=${1:?usage: docker/build.sh cpu|gpu [TAG]}
case "$KIND" in
  cpu) FILE=docker/Dockerfile ;;
  gpu) FILE=docker/Dockerfile.gpu ;;
  *) echo "docker/build.sh: cpu or gpu, not '$KIND'" >&2; exit 2 ;;
esac
TAG=${2:-horovod_aq:$KIND}
say() { printf '[docker/build] %s\n' "$*" >&2; }

say "building $TAG from $FILE"
DOCKER_BUILDKIT=1 docker build -f "$FILE" -t "$TAG" .

say "self-test: horovod-aq doctor"
docker run --rm --shm-size=1g "$TAG" horovod-aq doctor
if [ "$KIND" = gpu ]; then
  say "self-test: Horovod with NCCL, torch's CUDA build"
  docker run --rm "$TAG" python -c '
import torch, horovod.torch as hvd
assert torch.version.cuda, "torch is a CPU build"
assert hvd.nccl_built(), "Horovod was built without NCCL"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", hvd.nccl_built())'
  if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    say "GPU host: benchmarks/gpu_check.sh in the container (reports: docker-gpu-check/)"
    mkdir -p docker-gpu-check
    docker run --rm --gpus all --ipc=host -v "$PWD/docker-gpu-check:/out" "$TAG" \
      bash -c 'nvidia-smi && benchmarks/gpu_check.sh /out'
  else
    say "no GPU on this host: the GPU checks were not run"
  fi
fi
say "ok: $TAG"
