"""Test-session set-up.

Triton is imported first when it is installed: TensorFlow and Triton each bring an LLVM that
registers command-line options, and loading Triton's after TensorFlow's aborts the process
("LLVM ERROR: inconsistency in registered CommandLine options"), while the other order works.
The suite imports both (``test_kernels_tf.py``, ``test_triton_kernels.py``) in one process.

Triton fixes at import whether kernels run in its interpreter, so ``TRITON_INTERPRET=1`` is set
before that import on machines without CUDA (as ``test_triton_kernels.py`` itself does): the
Triton kernels then run on CPU tensors. With CUDA and ``TRITON_INTERPRET`` unset they compile for
the GPU (``benchmarks/gpu_check.sh``).

A (test, launch) pair whose launch does not run the test's check is not collected
(``tests/launches.py``).
"""

import importlib.util
import os

import pytest

from tests import launches

if importlib.util.find_spec("triton") is not None:
    import torch

    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0") or not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime  # noqa: F401


def pytest_collection_modifyitems(config, items):
    launches.deselect(items, config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    launches.begin()
    result = yield
    launches.verify(item)
    return result
