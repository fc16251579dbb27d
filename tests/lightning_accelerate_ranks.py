"""One rank of tests/test_lightning_accelerate.py, launched with ``torchrun --nproc-per-node 2``.

Four trainings in this order, each from the same seed on the bundled MNIST subset
(``horovod_aq.tools.datasets.load_mnist_5k``), each rank on its own shard:

1. ``lightning_alq``: a Lightning ``Trainer`` with the ALQ 3-bit hook. Its state is built before
   any process group exists (Lightning's ``DDPStrategy`` creates the group), as docs/ddp.md
   § "Lightning and Accelerate" shows.
2. ``lightning_fp32``: the same Trainer without the hook (DDP's fp32 allreduce).
3. ``accelerate_fp32`` and 4. ``accelerate_alq``: an ``Accelerator(cpu=True)`` loop; the hook is
   registered on the model ``accelerator.prepare`` returns.

Lightning runs from torchrun's environment (no spawning of its own); Accelerate reads the same
environment (``accelerate launch`` is torchrun underneath). Every rank pickles, per run, its
test accuracy, final weights, level table and telemetry step count to ``<out>/rank<r>.pkl``.

Usage: torchrun --nproc-per-node 2 tests/lightning_accelerate_ranks.py OUT_DIR STEPS
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import horovod_aq
from horovod_aq.tools.datasets import load_mnist_5k
from horovod_aq.torch import ddp as aqddp

SEED = 0
BATCH = 32          # per rank
LR = 0.1


def mlp() -> torch.nn.Module:
    """784 → 64 → 10 (51k parameters): two DDP buckets' worth of layers, cheap on one core."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def data():
    train, test = load_mnist_5k(seed=SEED)
    return (TensorDataset(torch.from_numpy(train.images), torch.from_numpy(train.labels)),
            torch.from_numpy(test.images), torch.from_numpy(test.labels))


def outcome(net: torch.nn.Module, xt, yt, state, seconds: float) -> dict:
    with torch.no_grad():
        accuracy = float((net(xt).argmax(1) == yt).float().mean())
    result = {"accuracy": accuracy, "seconds": seconds,
              "params": np.concatenate([p.detach().cpu().numpy().ravel()
                                        for p in net.parameters()])}
    if state is not None:
        table = state.compression.quantizer.table
        result.update(version=table.version, levels=np.asarray(table.levels).copy(),
                      steps=state.telemetry.totals()["steps"], buckets=len(state.buckets))
    return result


# ---------------------------------------------------------------- Lightning
class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class QuantizedHook(L.Callback):
    """Registers the hook on the DDP model Lightning built: Lightning's own
    ``DDPStrategy(ddp_comm_state=, ddp_comm_hook=)`` registers hooks only on CUDA devices."""

    def __init__(self, state: aqddp.QuantizedHookState) -> None:
        self.state = state

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(self.state, aqddp.quantized_hook)


def lightning_run(quantized: bool, steps: int, train, xt, yt) -> dict:
    L.seed_everything(SEED, verbose=False)
    module = Classifier()
    state = None
    callbacks = []
    if quantized:
        # before the process group exists: the state is lazy
        state = aqddp.QuantizedHookState(horovod_aq.ALQ(bits=3),
                                         named_parameters=module.named_parameters())
        callbacks.append(QuantizedHook(state))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps,
                        strategy=DDPStrategy(process_group_backend="gloo"),
                        callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True)
    started = time.monotonic()
    trainer.fit(module, loader)
    return outcome(module.net, xt, yt, state, time.monotonic() - started)


# ---------------------------------------------------------------- Accelerate
def accelerate_run(quantized: bool, steps: int, train, xt, yt) -> dict:
    set_seed(SEED)
    accelerator = Accelerator(cpu=True)
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    state = None
    if quantized:
        state = aqddp.QuantizedHookState(horovod_aq.ALQ(bits=3),
                                         named_parameters=net.named_parameters())
        model.register_comm_hook(state, aqddp.quantized_hook)
    started, step = time.monotonic(), 0
    while step < steps:
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            step += 1
            if step == steps:
                break
    return outcome(net, xt, yt, state, time.monotonic() - started)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    train, xt, yt = data()
    results = {"group_before_lightning": dist.is_available() and dist.is_initialized()}
    results["lightning_alq"] = lightning_run(True, steps, train, xt, yt)
    results["lightning_fp32"] = lightning_run(False, steps, train, xt, yt)
    results["accelerate_fp32"] = accelerate_run(False, steps, train, xt, yt)
    results["accelerate_alq"] = accelerate_run(True, steps, train, xt, yt)
    results["world"] = dist.get_world_size()
    with open(os.path.join(out, f"rank{dist.get_rank()}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
    aqddp.destroy_and_exit()   # PyTorch's Gloo shutdown race at exit: docs/ddp.md §6
