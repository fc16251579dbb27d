"""``horovod_aq.torch.process_exit.destroy_and_exit``: the group is destroyed, output is flushed,
the exit status is the one asked for, and nothing after the call runs (no atexit handler)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch, torch.distributed as dist
    from horovod_aq.torch.process_exit import destroy_and_exit
    store = {store!r}
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    atexit.register(lambda: print("atexit ran"))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda: (sys.stderr.write("destroyed; "), destroy())
    print("sum", float(t.sum()), "initialized", dist.is_initialized(), end="")   # no newline
    sys.stderr.write("to stderr")
    destroy_and_exit({code})
    print("after the call")
""")


def _run(code: int, store: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(code=code, store=store)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_exit_status_flush_and_nothing_after(tmp_path):
    for code in (0, 3):
        proc = _run(code, str(tmp_path / f"store{code}"))
        assert proc.returncode == code, proc.stderr[-2000:]
        assert proc.stdout == "sum 3.0 initialized True", proc.stdout
        assert proc.stderr.endswith("to stderrdestroyed; "), proc.stderr[-2000:]


def test_without_a_group():
    proc = subprocess.run([sys.executable, "-c",
                           "from horovod_aq.torch.process_exit import destroy_and_exit\n"
                           "print('no group', end='')\ndestroy_and_exit(5)"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert (proc.returncode, proc.stdout) == (5, "no group"), proc.stderr[-2000:]
