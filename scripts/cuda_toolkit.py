"""Assemble a CUDA toolkit directory from PyPI's NVIDIA packages, for building Horovod with NCCL.

Horovod's build (``HOROVOD_GPU_OPERATIONS=NCCL``) wants a CUDA home: ``bin/nvcc`` for its CUDA
kernels, the runtime's headers and ``lib64/libcudart_static.a``, and NCCL's ``nccl.h`` and
``libnccl.so``. No CUDA installation or CUDA base image is needed: the same pieces are on PyPI,

* the toolkit, at the CUDA version of the installed torch (``torch.version.cuda``, major.minor):
  ``nvidia-cuda-nvcc``, ``-runtime``, ``-crt``, ``-cccl`` and ``nvidia-nvvm``, installed with
  ``pip install --target DEST/packages``. CUDA 13 only: for CUDA 12, PyPI's
  ``nvidia-cuda-nvcc-cu12`` holds ptxas but no nvcc, and the script says so;
* NCCL: the ``nvidia-nccl-cu<major>`` package torch's CUDA build already depends on (the same
  library torch loads at run time), or installed beside the toolkit where the environment has
  none.

The packages spread their files over ``nvidia/<name>/{bin,include,lib,nvvm}``; this script links
them into one tree, ``DEST/home/{bin,include,lib64,nvvm}`` (``lib`` is ``lib64``), which is what
``nvcc.profile`` (paths relative to ``bin/``) and CMake's ``FindCUDAToolkit`` expect, with the
unversioned ``lib<x>.so`` links a linker looks for. Prints the home's path. Idempotent. Run it
with the Python of the environment Horovod is built for (it reads that torch)::

    CUDA_HOME=$(.venv/bin/python scripts/cuda_toolkit.py --dest ~/.cache/horovod_aq/cuda)
    HOROVOD_CUDA_HOME=$CUDA_HOME HOROVOD_NCCL_HOME=$CUDA_HOME HOROVOD_NCCL_LINK=SHARED \
        LDFLAGS=$(.venv/bin/python scripts/cuda_toolkit.py --ldflags) ...

See docs/gpu.md § Building Horovod for the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

#: The toolkit's PyPI packages by CUDA major version ({minor}: torch's CUDA minor version).
#: CUDA 13 only: PyPI's CUDA 12 compiler package (nvidia-cuda-nvcc-cu12) holds ptxas, not nvcc.
TOOLKIT_PACKAGES = {
    "13": ["nvidia-cuda-nvcc=={v}.*", "nvidia-cuda-runtime=={v}.*", "nvidia-cuda-crt=={v}.*",
           "nvidia-cuda-cccl=={v}.*", "nvidia-nvvm=={v}.*"],
}
#: NCCL's PyPI package by CUDA major version (a dependency of torch's CUDA build).
NCCL_PACKAGE = "nvidia-nccl-cu{major}"
#: Where, relative to a Horovod extension (``site-packages/horovod/<framework>/``), the libraries
#: it needs at run time live: NCCL and the CUDA runtime of torch's own packages (the CUDA 13 and
#: the CUDA 12 layouts), so that Horovod loads the very libraries torch loads, on any machine.
RUNTIME_RPATH = ("$ORIGIN/../../nvidia/nccl/lib", "$ORIGIN/../../nvidia/cu13/lib",
                 "$ORIGIN/../../nvidia/cuda_runtime/lib")
#: The folders of a package that make up the home (``lib`` goes to ``lib64``).
PARTS = {"bin": "bin", "include": "include", "lib": "lib64", "nvvm": "nvvm"}


def say(message: str) -> None:
    print(f"[cuda_toolkit] {message}", file=sys.stderr)


def torch_cuda_version() -> str:
    """The installed torch's CUDA version, major.minor (exits with advice on a CPU build)."""
    try:
        import torch
    except ImportError:
        sys.exit("cuda_toolkit: torch is not installed in this environment; install its CUDA "
                 "build first (scripts/setup.sh --gpu does)")
    if not torch.version.cuda:
        sys.exit(f"cuda_toolkit: torch {torch.__version__} is a CPU build; install a CUDA build "
                 "(PyPI's torch wheel for Linux x86_64 is one)")
    return ".".join(torch.version.cuda.split(".")[:2])


def pip_install(target: Path, specs: list[str]) -> None:
    """``pip install --target`` into the environment-independent folder ``target``."""
    say(f"installing {' '.join(specs)} into {target}")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                           "--disable-pip-version-check", "--no-deps", "--upgrade", "--target",
                           str(target), *specs], stderr=subprocess.PIPE, text=True, check=False)
    for line in done.stderr.splitlines():   # not a local index's "Location ... is ignored"
        if not line.startswith("WARNING: Location '"):
            print(line, file=sys.stderr)
    if done.returncode:
        sys.exit(f"cuda_toolkit: pip could not install {specs} (exit {done.returncode})")


def package_roots(site: Path) -> list[Path]:
    """The ``nvidia/<name>`` folders under one site-packages-like folder."""
    base = site / "nvidia"
    return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def environment_nccl() -> Path | None:
    """The folder of the environment's NCCL package (``nvidia/nccl``), None if it has none."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def link_tree(source: Path, dest: Path) -> None:
    """Link every entry of ``source`` into ``dest``, merging folders both sides have."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        out = dest / entry.name
        if out.is_symlink() and out.resolve() == entry.resolve():
            continue
        if entry.is_dir() and (out.exists() or out.is_symlink()):
            if out.is_symlink():   # a folder another package gave too: make it a real folder
                earlier = out.resolve()
                out.unlink()
                link_tree(earlier, out)
            link_tree(entry, out)
        else:
            if out.is_symlink() or out.exists():
                out.unlink()
            out.symlink_to(entry)


def unversioned_links(lib: Path) -> None:
    """``libx.so`` → ``libx.so.N`` where only the versioned library is there."""
    for entry in sorted(lib.glob("lib*.so.*")):
        plain = lib / (entry.name.split(".so.")[0] + ".so")
        if not plain.exists() and not plain.is_symlink():
            plain.symlink_to(entry.name)


def assemble(dest: Path, version: str | None = None) -> Path:
    """The steps of the module docstring, for CUDA ``version`` (default: torch's); returns the
    home."""
    version = version or torch_cuda_version()
    major = version.split(".")[0]
    if major == "12":
        sys.exit(f"cuda_toolkit: torch is built for CUDA {version}, and PyPI's CUDA 12 compiler "
                 "package holds ptxas but no nvcc: install torch's CUDA 13 build "
                 "(TORCH_CUDA_INDEX in scripts/versions.env), or build Horovod with your own "
                 "CUDA 12 toolkit (docs/gpu.md §2)")
    if major not in TOOLKIT_PACKAGES:
        sys.exit(f"cuda_toolkit: CUDA {version} is not supported (CUDA 13 only): install "
                 "torch's CUDA 13 build (TORCH_CUDA_INDEX in scripts/versions.env)")
    packages = dest / f"packages-{version}"
    home = dest / f"cuda-{version}"
    specs = [s.format(v=version) for s in TOOLKIT_PACKAGES[major]]
    nccl = environment_nccl()
    if nccl is None:   # one pip call: a second --target install would replace nvidia/
        specs.append(NCCL_PACKAGE.format(major=major))
        nccl = packages / "nvidia" / "nccl"
    stamp = packages / ".installed"
    if not stamp.is_file() or stamp.read_text() != " ".join(specs):
        pip_install(packages, specs)
        stamp.write_text(" ".join(specs))
    roots = [r for r in package_roots(packages) if r.name != "nccl"] + [nccl]
    for root in roots:
        for part, into in PARTS.items():
            if (root / part).is_dir():
                link_tree(root / part, home / into)
    unversioned_links(home / "lib64")
    if not (home / "lib").exists():
        (home / "lib").symlink_to("lib64")
    for needed in ("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart_static.a",
                   "include/nccl.h", "lib64/libnccl.so"):
        if not (home / needed).exists():
            sys.exit(f"cuda_toolkit: {home / needed} is missing after installing {specs}; "
                     "report this with `pip list` of the environment")
    return home


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path,
                        help="folder for the packages and the assembled home (a cache)")
    parser.add_argument("--cuda", default=None,
                        help="CUDA major.minor, e.g. 12.6 (default: the installed torch's)")
    parser.add_argument("--ldflags", action="store_true",
                        help="only print the linker flags of the run-time library path "
                             "(RUNTIME_RPATH) for Horovod's build")
    args = parser.parse_args()
    if args.ldflags:
        print("-Wl,-rpath," + ":".join(RUNTIME_RPATH))
        return
    if args.dest is None:
        parser.error("--dest is required (or --ldflags)")
    home = assemble(args.dest.expanduser().resolve(), args.cuda)
    say(f"CUDA home: {home}")
    print(home)


if __name__ == "__main__":
    main()
