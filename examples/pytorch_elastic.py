r"""Elastic Horovod with quantized gradients: the world grows and shrinks while the CNN trains.

    printf 'localhost:2\n' > /tmp/aq_hosts
    printf '#!/bin/sh\ncat /tmp/aq_hosts\n' > /tmp/aq_discover.sh && chmod +x /tmp/aq_discover.sh
    horovodrun -np 2 --min-np 2 --max-np 3 --host-discovery-script /tmp/aq_discover.sh \
        --network-interface lo --gloo-timeout-seconds 120 \
        python examples/pytorch_elastic.py --compression alq --bits 3 --schedule 0,20 \
        --resize 30:3,30:2 --hosts-file /tmp/aq_hosts --out runs/elastic

On one host, elastic horovodrun needs ``--network-interface lo`` (without it, it waits for a
second host to agree on an interface); ``--gloo-timeout-seconds 120`` gives a new worker more
than Horovod's default 30 s to import PyTorch and join while the others wait for it.

On a cluster the discovery script lists the hosts that are up and ``--resize`` is not used;
here rank 0 rewrites the file the script prints to play that part: ``--resize 30:3,30:2`` asks
for 3 ranks after 30 steps, then for 2 again after 30 steps with 3, each time waiting until the
launcher acts on it. The launcher starts the third worker, or stops it, and every rank resumes
from the last ``state.commit()``. The worker that leaves ends the way Horovod 0.28.1 stops one
(``localhost[2] has been removed from elastic job``, exit status 134); horovodrun exits with 0.

What carries the compressor across a change of world (docs/horovod_compat.md § Elastic
Horovod): with the packed optimizer, Horovod's own pattern as written,
``hvd.elastic.TorchState(model, optimizer, ...)``: the optimizer's ``state_dict()`` holds the
compressor's table, version and step and never communicates, so Horovod's optimizer handler
saves it at every commit, also on a worker that joins. With Horovod's stock optimizer the state
holds no compressor: ``import horovod_aq.torch.elastic`` and
``hvd.elastic.TorchState(model, optimizer, compression=comp, ...)``. At every sync rank 0's
table, version and step (and the weights and optimizer state, as Horovod does) go to every
rank; each rank keeps its own random stream.

The global batch (``--global-batch``, default 96) is the same at every world size and split
evenly over the ranks, so a run that resizes sees the same samples in the same steps as one that
does not: their accuracies are comparable. ``--exchange stock`` (default) is Horovod's own
``hvd.DistributedOptimizer(compression=comp)``; the others are the packed
``horovod_aq.torch.DistributedOptimizer`` with that ``exchange=``, which plans its exchange again
at the first step in every new world (one INFO line per rank; docs/horovod_compat.md § Elastic
Horovod).

Rank 0 prints one line per epoch and every change of world; ``--out`` receives ``metrics.json``:
the world size and table version of every step, test accuracy, and every rank's fingerprint of
its weights and level table at the end (the replicas must be identical).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_net import Net, evaluate  # noqa: E402  (examples/torch_net.py)

import horovod_aq  # noqa: E402
import horovod_aq.torch as aqt  # noqa: E402
import horovod_aq.torch.elastic  # noqa: E402,F401  (the stock path's compression= in TorchState)
from horovod_aq.tools.datasets import load_mnist_5k  # noqa: E402

#: How long ``--resize`` waits for the launcher to act on a request, and how often it asks.
RESIZE_WAIT_S = 120.0
RESIZE_POLL_S = 0.2


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", default="alq", help="a horovod_aq.from_name name")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--schedule", default=None,
                   help='refit steps then the period, e.g. "0,20" (default: the method\'s)')
    p.add_argument("--exchange", choices=["stock", "auto", "allgather", "two_phase"],
                   default="stock", help="Horovod's optimizer with compression= (stock), or the "
                   "packed optimizer's exchange")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=96,
                   help="samples per step over all ranks (divisible by every world size)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resize", default="",
                   help="STEPS:SIZE,...: after STEPS steps at the current world size, rank 0 "
                        "asks for SIZE ranks by rewriting --hosts-file, and the ranks wait for "
                        "the change")
    p.add_argument("--hosts-file", default=None, help="the file the discovery script prints")
    p.add_argument("--out", default=None, help="directory for metrics.json")
    args = p.parse_args(argv)
    args.plan = [tuple(int(v) for v in item.split(":")) for item in args.resize.split(",") if item]
    if args.plan and not args.hosts_file:
        p.error("--resize needs --hosts-file (the file the discovery script prints)")
    return args


def fingerprint(model: torch.nn.Module, compression: horovod_aq.Compressor) -> str:
    """sha256 of the weights' bytes, the level table (values and version) and the compressor's
    step."""
    digest = hashlib.sha256()
    for p in model.state_dict().values():
        digest.update(p.detach().numpy().tobytes())
    if compression.quantizes:
        digest.update(compression.table.levels.tobytes())
        digest.update(str(compression.table.version).encode())
    digest.update(str(compression.step).encode())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)
    hvd.init()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the packed optimizer's one line per re-plan after a change of world
    logging.getLogger("horovod_aq.torch.optimizer").setLevel(logging.INFO)
    torch.manual_seed(args.seed)
    train, test = load_mnist_5k(seed=args.seed)
    xs, ys = torch.from_numpy(train.images[:, None]), torch.from_numpy(train.labels)
    xt, yt = torch.from_numpy(test.images[:, None]), torch.from_numpy(test.labels)
    steps_per_epoch = len(ys) // args.global_batch

    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    settings = {} if args.schedule is None else {"schedule": args.schedule}
    comp = horovod_aq.from_name(args.compression, bits=args.bits, seed=args.seed, **settings)

    def version() -> int:
        """The level table's version (-1: the compression has no table)."""
        return comp.table.version if comp.quantizes else -1

    # (world size, table version) of every step and the resize plan's progress: plain
    # objects, synced from rank 0
    progress = {"epoch": 0, "batch": 0, "steps": [], "plan_at": 0}
    if args.exchange == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp)
        state = hvd.elastic.TorchState(model, opt, compression=comp, **progress)
    else:
        opt = aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp, exchange=args.exchange)
        state = hvd.elastic.TorchState(model, opt, **progress)    # Horovod's pattern as written
        # what the optimizer quantizes with (at <= 3 bits error_feedback="auto" wraps comp in
        # ErrorFeedback), for the fingerprint
        comp = opt.compression

    def on_reset() -> None:
        if hvd.rank() == 0:
            print(f"world changed: {hvd.size()} ranks at step {len(state.steps)} (table "
                  f"v{version()}, compressor step {comp.step})", flush=True)

    state.register_reset_callbacks([on_reset])

    def resize_due() -> bool:
        """Whether the next ``--resize`` entry is due: its steps were trained at the size the
        entry before it asked for (any size for the first)."""
        if state.plan_at >= len(args.plan):
            return False
        steps, _ = args.plan[state.plan_at]
        size = hvd.size()
        if state.plan_at and size != args.plan[state.plan_at - 1][1]:
            return False          # the last request has not happened yet
        sizes = [s for s, _ in state.steps]
        changed = next((i + 1 for i in range(len(sizes) - 1, -1, -1) if sizes[i] != size), 0)
        return len(sizes) - changed >= steps

    def resize(size: int) -> None:
        """Play the cluster: from now on the discovery script prints ``size`` slots. Then every
        rank polls for the launcher's notice (``state.check_host_updates()``, a collective that
        raises HostsUpdatedInterrupt on every rank together), so that the world changes at this
        step; a fixed number of polls, so that every rank gives up together."""
        if hvd.rank() == 0:
            tmp = args.hosts_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"localhost:{size}\n")
            os.replace(tmp, args.hosts_file)
        for _ in range(int(RESIZE_WAIT_S / RESIZE_POLL_S)):
            time.sleep(RESIZE_POLL_S)
            state.check_host_updates()
        raise RuntimeError(f"asked for {size} ranks, and the launcher did not act on it within "
                           f"{RESIZE_WAIT_S:.0f} s: does --host-discovery-script print "
                           f"--hosts-file ({args.hosts_file})?")

    @hvd.elastic.run
    def run(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            order = torch.randperm(len(ys), generator=torch.Generator().manual_seed(
                args.seed * 1000 + state.epoch))
            t0 = time.perf_counter()
            while state.batch < steps_per_epoch:
                size, rank = hvd.size(), hvd.rank()
                per_rank = args.global_batch // size
                start = state.batch * args.global_batch + rank * per_rank
                idx = order[start:start + per_rank]
                opt.zero_grad()
                F.cross_entropy(model(xs[idx]), ys[idx]).backward()
                opt.step()           # adaptive levels refit on schedule by themselves
                state.batch += 1
                state.steps = state.steps + [(size, version())]
                due = resize_due()
                state.plan_at += int(due)
                state.commit()       # a change of world interrupts here (HostsUpdatedInterrupt)
                if due:
                    resize(args.plan[state.plan_at - 1][1])
            loss, acc = evaluate(model, xt, yt)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch + 1}: {hvd.size()} ranks, test loss {loss:.4f}, "
                      f"test accuracy {100 * acc:.2f}%, table v{version()}, "
                      f"{time.perf_counter() - t0:.1f}s", flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    run(state)

    loss, acc = evaluate(model, xt, yt)
    prints = hvd.allgather_object(fingerprint(model, comp), name="example.fingerprints")
    result = {"steps": [list(s) for s in state.steps], "test_acc": acc, "test_loss": loss,
              "fingerprints": prints, "table_version": version(), "compressor_step": comp.step,
              "ranks": hvd.size(), "compression": args.compression, "bits": args.bits,
              "exchange": args.exchange, "seed": args.seed,
              "error_feedback": isinstance(comp, horovod_aq.ErrorFeedback)}
    if hvd.rank() == 0:
        sizes = [s for s, _ in state.steps]
        changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
        print(f"done: world sizes {' -> '.join(map(str, changes))}, test accuracy "
              f"{100 * acc:.2f}%, replicas identical: {len(set(prints)) == 1}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "metrics.json"), "w") as f:
                json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
