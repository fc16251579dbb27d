"""The GPU build's pieces that run without a GPU (docs/gpu.md §2-§3): the CUDA toolkit folder
``scripts/cuda_toolkit.py`` assembles from PyPI's packages, ``scripts/gpu_wheel.sh``'s argument
checks, and the dry runs of ``benchmarks/gpu_check_horovod.py`` under ``horovodrun`` (CPU
tensors) and of both GPU checks on the GPU's code path in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda_toolkit():
    spec = importlib.util.spec_from_file_location("cuda_toolkit",
                                                  ROOT / "scripts" / "cuda_toolkit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, name: str, files: dict[str, str]) -> Path:
    """A fake ``nvidia/<name>`` package folder holding ``files`` (relative path → text)."""
    for rel, text in files.items():
        path = root / "nvidia" / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "nvidia" / name


def test_packages_merge_into_one_home(tmp_path):
    """CUDA 12's layout: one folder per package, sharing include/crt; libraries get their
    unversioned names; a second run changes nothing."""
    ct = _cuda_toolkit()
    site = tmp_path / "packages"
    _package(site, "cuda_nvcc", {"bin/nvcc": "nvcc", "include/crt/host_config.h": "a",
                                 "nvvm/libdevice/libdevice.10.bc": "bc"})
    _package(site, "cuda_runtime", {"include/cuda_runtime.h": "rt", "include/crt/extra.h": "b",
                                    "lib/libcudart.so.12": "so", "lib/libcudart_static.a": "a"})
    nccl = _package(tmp_path / "env", "nccl", {"include/nccl.h": "n", "lib/libnccl.so.2": "so"})
    home = tmp_path / "home"
    for _ in range(2):
        for root in ct.package_roots(site) + [nccl]:
            for part, into in ct.PARTS.items():
                if (root / part).is_dir():
                    ct.link_tree(root / part, home / into)
        ct.unversioned_links(home / "lib64")
    assert (home / "bin" / "nvcc").read_text() == "nvcc"
    assert {p.name for p in (home / "include" / "crt").iterdir()} == {"host_config.h", "extra.h"}
    assert not (home / "include" / "crt").is_symlink()    # merged, not one package's folder
    assert (home / "lib64" / "libcudart.so").resolve() == (
        site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12").resolve()
    assert os.readlink(home / "lib64" / "libnccl.so") == "libnccl.so.2"
    assert (home / "include" / "nccl.h").read_text() == "n"
    assert (home / "nvvm" / "libdevice" / "libdevice.10.bc").read_text() == "bc"


def test_refuses_a_cpu_torch_and_unsupported_cuda(tmp_path):
    ct = _cuda_toolkit()
    import torch

    if torch.version.cuda is None:
        with pytest.raises(SystemExit, match="CPU build"):
            ct.torch_cuda_version()
    with pytest.raises(SystemExit, match="CUDA 11.8 is not supported"):
        ct.assemble(tmp_path, "11.8")
    with pytest.raises(SystemExit, match="holds ptxas but no nvcc"):
        ct.assemble(tmp_path, "12.8")
    assert set(ct.TOOLKIT_PACKAGES) == {"13"}
    assert "nvidia-cuda-nvcc=={v}.*" in ct.TOOLKIT_PACKAGES["13"]


def test_gpu_wheel_script_says_what_it_needs():
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheel.sh")], capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 1 and "give --python and --torch" in run.stderr
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheel.sh"), "--python", "2.1",
                          "--torch", "2.11.0"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 1 and "no Python 2.1 here" in run.stderr


def _gpu_check(tmp_path: Path, script: str, *flags: str, ranks: int = 0) -> str:
    """The report of ``benchmarks/<script>`` run with ``flags`` (under ``horovodrun`` with
    ``ranks`` Gloo ranks, else alone), which must exit 0."""
    out = tmp_path / "report.md"
    launch = [str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np", str(ranks),
              "-H", f"localhost:{ranks}"] if ranks else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*launch, sys.executable, str(ROOT / "benchmarks" / script), *flags, "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out.read_text()


@pytest.mark.slow     # two Horovod ranks and six small trainings: the slow matrix
def test_gpu_check_horovod_dry_run_passes(tmp_path):
    text = _gpu_check(tmp_path, "gpu_check_horovod.py", "--dry-run", "--timing-steps", "2",
                      ranks=2)
    assert text.count("| PASS |") == 6 and "FAIL" not in text
    assert "payloads vs codec.encode," in text and "payloads vs codec.encode_entropy" in text
    assert "packed ALQ 3-bit, entropy-coded wire" in text


@pytest.mark.slow     # two Horovod ranks in Triton's interpreter, six tiny trainings
def test_gpu_check_horovod_on_the_gpus_code_path_passes(tmp_path):
    # --interpret: the packed optimizer's GPU path (Triton's kernels, the settling wire, the
    # entropy coder's reads) in Triton's interpreter under horovodrun, bit-exact
    text = _gpu_check(tmp_path, "gpu_check_horovod.py", "--interpret", ranks=2)
    assert "Triton's kernels in its interpreter" in text
    assert text.count("| PASS |") == 6 and "FAIL" not in text


@pytest.mark.slow     # two DDP ranks in Triton's interpreter, five tiny trainings
def test_gpu_check_ddp_on_the_gpus_code_path_passes(tmp_path):
    text = _gpu_check(tmp_path, "gpu_check_ddp.py", "--interpret")
    assert "Triton's kernels in its interpreter" in text
    assert text.count("| PASS |") == 5 and "FAIL" not in text


def test_step_costs_count_what_the_sync_debug_mode_reports():
    """The CUDA-only counting of gpu_check_ddp.step_costs (host syncs by source line, the report
    rows), driven by a stand-in for torch.cuda that warns like the sync debug mode."""
    import types
    import warnings

    from benchmarks import gpu_check_ddp as g

    mode = []
    cuda = types.SimpleNamespace(synchronize=lambda: None, set_sync_debug_mode=mode.append)
    fake = types.SimpleNamespace(cuda=cuda)

    def step():   # two synchronising calls per step when the mode is "warn"
        if mode[-1] == "warn":
            for _ in range(2):
                warnings.warn("called a synchronizing CUDA operation", UserWarning)
    syncs = g.host_syncs(fake, step, 3)
    assert syncs["per_step"] == 2.0 and mode == ["warn", "default"]
    assert sum(syncs["where"].values()) == 6
    assert all(k.startswith("test_gpu_build.py:") for k in syncs["where"])
    costs = {"median": 0.0125, "syncs": syncs, "kernels": {"per_step": 41.0, "top": {"k": 9}}}
    time_row, count_row = g.cost_rows("packed", costs, buckets=4)
    assert time_row == "| packed | 12.50 ms |"
    assert count_row.startswith("| packed | 2.0 | `test_gpu_build.py:")
    assert count_row.endswith("| 41.0 | 4 | `k` ×9 |")
    assert len(g.COST_HEADER[0].split("|")) == len(count_row.split("|"))
    assert g.cost_rows("fp32", {"median": 0.002, "syncs": None, "kernels": None}) == (
        "| fp32 | 2.00 ms |", None)
