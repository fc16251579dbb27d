"""The installed Horovod is built with scripts/patches/: what the patch changes in Horovod's
Python code, seen from outside (the C++ hunks are exercised by every launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("horovod")

#: In a fresh interpreter: refuse every import of a framework (recording it), then ask
#: Horovod's build checks, as horovodrun does before each launch (in a forked process, which
#: inherits the refusal).
_CHECK = """
import importlib.abc, json, os, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "torch"):
            open(os.environ["REFUSED"], "a").write(name + "\\n")
            raise ImportError("refused by the test: " + name)
        return None
sys.meta_path.insert(0, Refuse())
from horovod.common import util
print(json.dumps({"gloo": util.gloo_built(), "mpi": util.mpi_built()}))
"""


def test_horovodrun_checks_its_build_without_importing_a_framework(tmp_path):
    """horovodrun asks gloo_built() / mpi_built() at every launch, importing the first framework
    extension that imports in a forked process: TensorFlow costs about 9 s of CPU there, torch
    about 3 s. The patch reads the answers from torch's extension library alone (HorovodBasics,
    about 0.5 s), so no framework is imported and the answers stay those of the build (both
    controllers)."""
    refused = tmp_path / "refused.txt"
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "REFUSED": str(refused)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert not refused.exists(), (
        f"Horovod's build check imported {refused.read_text().split()}: the installed Horovod "
        "lacks the patch's build check (scripts/patches/); run make setup")
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"gloo": True, "mpi": True}
