"""How often a Gloo DDP rank aborts at exit, ending normally vs with ``destroy_and_exit``.

Each launch spawns two processes (``torch.multiprocessing.spawn``, Gloo over a file store, one
thread each) that train ``SmallCNN`` under plain DDP — no communication hook — for a few steps on
random data, three times, with a ``dist.barrier()`` after each, then end either with
``dist.destroy_process_group()`` and a normal return (``return``) or with
``horovod_aq.torch.ddp.destroy_and_exit()`` (``destroy_and_exit``). A launch fails when a process
exits non-zero; ``terminate called without an active exception`` in its stderr names PyTorch's
shutdown race (docs/ddp.md §6). The two endings alternate launch by launch, so both see the same
machine load.

    .venv/bin/python benchmarks/gloo_exit.py --launches 40      # ≈ 5 min here
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

ENDINGS = ("return", "destroy_and_exit")
RACE = "terminate called without an active exception"
TRAININGS, STEPS, BATCH = 3, 10, 32


def _rank(rank: int, store: str, ending: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.models import SmallCNN
    from horovod_aq.torch.process_exit import destroy_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for t in range(TRAININGS):
        torch.manual_seed(t)
        net = DDP(SmallCNN())
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for _ in range(STEPS):
            opt.zero_grad()
            F.cross_entropy(net(torch.randn(BATCH, 1, 28, 28)),
                            torch.randint(0, 10, (BATCH,))).backward()
            opt.step()
        dist.barrier()
    if ending == "destroy_and_exit":
        destroy_and_exit()
    dist.destroy_process_group()


def _launch(ending: str) -> None:
    """One launch (run in a child interpreter, so that its failure is only an exit status)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo_exit.") as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), ending), nprocs=2, join=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=40, help="launches per ending")
    p.add_argument("--launch", choices=ENDINGS, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="report path (default benchmarks/results/)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.launch:
        _launch(args.launch)
        return 0
    from tqdm import tqdm

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    counts = {e: {"failed": 0, "race": 0, "seconds": 0.0} for e in ENDINGS}
    for _ in tqdm(range(args.launches), desc="launch pairs"):
        for ending in ENDINGS:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, __file__, "--launch", ending], env=env,
                                  capture_output=True, text=True, timeout=300, check=False)
            counts[ending]["seconds"] += time.monotonic() - t0
            if proc.returncode != 0:
                counts[ending]["failed"] += 1
                counts[ending]["race"] += RACE in proc.stderr
    rows = [[e, args.launches, c["failed"], c["race"], f"{c['seconds'] / args.launches:.1f}"]
            for e, c in counts.items()]
    table = report.markdown_table(["ending", "launches", "failed", f"of which `{RACE}`",
                                   "s per launch"], rows)
    notes = [f"Each launch: 2 processes, plain DDP (no hook), SmallCNN, {TRAININGS} trainings × "
             f"{STEPS} steps, batch {BATCH}, barrier after each; endings alternate launch by "
             "launch"]
    text = report.header("Gloo DDP ranks aborting at exit: normal return vs destroy_and_exit",
                         notes) + "\n" + table + "\n"
    out = Path(args.out) if args.out else report.RESULTS / "gloo_exit.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
