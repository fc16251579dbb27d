"""Train a small character-level GPT with AdamW and quantized gradients (Horovod or DDP).

    horovodrun -np 2 -H localhost:2 --gloo python examples/transformer_char.py \
        --compression alq --bits 3 --out runs/gpt_alq3              # Horovod packed optimizer
    torchrun --nproc-per-node 2 examples/transformer_char.py --ddp \
        --compression alq --bits 3 --out runs/gpt_ddp_alq3          # DDP + horovod_aq's hook

Baselines: ``--compression none`` (fp32: the packed optimizer's named allreduce, or under
``--ddp`` the hook's fp32 allreduce), ``--exchange stock --compression none|fp16`` (Horovod's
own ``hvd.DistributedOptimizer`` with ``hvd.Compression.none`` / ``hvd.Compression.fp16``),
``--ddp --ddp-hook allreduce|fp16|bf16|powersgd`` (DDP without a hook; PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook``; PyTorch's PowerSGD hook with error feedback and
warm start at ``--powersgd-rank``), ``--error-feedback off`` (the plain quantizer),
``--compression dqsgd --bits B`` (``horovod_aq.DQSGD(target_bits=B)``).

Workload (``examples/gpt.py``): a 3-layer GPT (d_model 128, 4 heads, context 64, 616k
parameters, GPT-2 initialisation, tied embeddings) on the characters of CPython's
``pydoc_data.topics`` (last 10 % validate). AdamW (lr ``--lr``, betas (0.9, 0.95), weight decay
``--weight-decay`` on matrices only), ``--warmup`` steps of linear warm-up then cosine decay to
``--min-lr-ratio``·lr, gradient clipping at ``--clip`` (of the averaged gradient), ``--steps``
steps of ``--batch-size`` windows per rank. The initial weights are those of ``--seed`` on
every rank; rank r samples windows from a generator seeded ``seed*1000 + r``.

Reported (rank 0 prints one line per evaluation; ``--out`` gets ``metrics.json`` and, for
horovod_aq's exchanges, ``telemetry.jsonl``): validation bits per character (bpc =
cross-entropy / ln 2) every ``--eval-every`` steps on ``--eval-windows`` fixed windows spread over
the validation text, and at the end on all 726 windows; the first evaluated step whose bpc is at
or below ``--target-bpc``, with its wall time (training only, evaluations excluded, and in all);
the bytes one rank sends per step: horovod_aq's telemetry (packed payloads by docs/protocol.md
§5.3), else the ring allreduce formula 2(P−1)/P·w·n (w = 4 bytes for fp32, 2 for fp16/bf16;
Horovod's stock path with a quantizer ships fp16), and for PowerSGD the fp32 ring allreduces of
its uncompressed tensors, P and Q matrices, read from the hook state every call.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (examples/common.py: compression flags, compressor factory)
import gpt  # noqa: E402  (examples/gpt.py: the model and the corpus)

from horovod_aq.packed import cost as xchg  # noqa: E402

DDP_HOOKS = ("horovod_aq", "allreduce", "fp16", "bf16", "powersgd")
#: DDP's bucket cap (MB) under PowerSGD: one bucket for the whole model. PyTorch's PowerSGD hook
#: issues its allreduces from future callbacks, which Gloo runs in network order; with several
#: buckets the ranks can issue them in different orders (docs/ddp.md §2). An explicit cap also
#: lifts DDP's 1 MiB first-bucket cap.
POWERSGD_BUCKET_MB = 10_000
#: Validation windows scored per forward pass in evaluations.
EVAL_BATCH = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common.compression_flags(p)
    p.add_argument("--ddp", action="store_true",
                   help="PyTorch DDP under torchrun (default: Horovod under horovodrun)")
    p.add_argument("--ddp-hook", choices=DDP_HOOKS, default="horovod_aq",
                   help="with --ddp: horovod_aq's hook (--compression), DDP's own allreduce, "
                        "PyTorch's fp16/bf16 compress hooks or PowerSGD")
    p.add_argument("--powersgd-rank", type=int, default=None,
                   help="PowerSGD's matrix_approximation_rank (needed with --ddp-hook powersgd)")
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="PowerSGD's start_powerSGD_iter (plain fp32 allreduces before)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=32, help="windows per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.1, help="on matrices only")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decay ends at this fraction of --lr")
    p.add_argument("--clip", type=float, default=1.0, help="max norm of the averaged gradient")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=128,
                   help="validation windows scored at each evaluation (the final one scores all)")
    p.add_argument("--target-bpc", type=float, default=None,
                   help="report the first evaluated step at or below this validation bpc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--out", default=None, help="directory for metrics.json and telemetry")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars")
    args = p.parse_args(argv)
    if args.ddp and args.exchange == "stock":
        p.error("--exchange stock is Horovod's compression= path; it has no DDP form")
    if not args.ddp and args.ddp_hook != "horovod_aq":
        p.error("--ddp-hook needs --ddp")
    if args.ddp_hook == "powersgd" and not args.powersgd_rank:
        p.error("--ddp-hook powersgd needs --powersgd-rank")
    if args.steps < 1 or args.eval_every < 1:
        p.error("--steps and --eval-every must be positive")
    return args


# ============================================================================ the two launchers
class Horovod:
    """Horovod: the packed optimizer, or Horovod's own with ``--exchange stock``."""

    def __init__(self, args: argparse.Namespace) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.hook, self.calls = None, []          # (DDP's; none here)

    def allreduce_sum(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(t, op=self.hvd.Sum, name=f"metric.{name}")

    def wrap(self, args, model: nn.Module, base: torch.optim.Optimizer, telemetry):
        """(module to call, optimizer, compressor or None, what the run is called)."""
        import horovod_aq.torch as aqt

        hvd = self.hvd
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = common.make_compressor(args, base)
        if args.exchange == "stock":
            stock = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=stock.get(args.compression, compression))
            name = {"none": "Horovod fp32 allreduce", "fp16": "Horovod Compression.fp16"}.get(
                args.compression, f"Horovod stock, {common.label(compression)} (fp16 wire)")
        else:
            opt = aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=compression, exchange=args.exchange,
                                           telemetry=telemetry,
                                           error_feedback=common.error_feedback(args))
            compression = opt.compression
            name = f"Horovod packed, {common.label(compression)}"
        self.stock = args.exchange == "stock"
        return model, opt, compression, name

    def step(self, opt, model: nn.Module, clip: float) -> None:
        opt.synchronize()                  # the averaged gradient, then clip it, then step
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        with opt.skip_synchronize():
            opt.step()

    def formula_wire(self, args) -> str | None:
        """The ring allreduce that stands for the stock path's bytes (no telemetry there)."""
        if not self.stock:
            return None
        return "allreduce_fp32" if args.compression == "none" else "allreduce_fp16"


class DDP:
    """torch.distributed on CPU (Gloo, as this example runs it) and a DDP comm hook."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.calls: list[dict] = []            # PowerSGD: one entry per hook call

    def allreduce_sum(self, t: torch.Tensor, name: str) -> torch.Tensor:
        self.dist.all_reduce(t)
        return t

    def wrap(self, args, model: nn.Module, base: torch.optim.Optimizer, telemetry):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        from horovod_aq.torch import ddp as aqddp

        self.hook = args.ddp_hook
        if self.hook == "powersgd":
            net = DistributedDataParallel(model, bucket_cap_mb=POWERSGD_BUCKET_MB)
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=args.powersgd_start, use_error_feedback=True,
                warm_start=True, random_seed=args.seed)
            net.register_comm_hook(state, self._counted_powersgd)
            return net, base, None, f"DDP PowerSGD r={args.powersgd_rank}"
        net = DistributedDataParallel(model)          # broadcasts rank 0's weights
        if self.hook == "allreduce":
            return net, base, None, "DDP fp32 allreduce"
        if self.hook == "fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return net, base, None, "DDP fp16_compress_hook"
        if self.hook == "bf16":
            net.register_comm_hook(None, bf16_compress)
            return net, base, None, "DDP bf16_compress_hook"
        state = aqddp.register(net, common.make_compressor(args, base), exchange=args.exchange,
                               telemetry=telemetry, error_feedback=common.error_feedback(args),
                               optimizer=base)
        return net, base, state.compression, f"DDP hook, {common.label(state.compression)}"

    def _counted_powersgd(self, state, bucket):
        """PyTorch's powerSGD_hook, recording what this call allreduces: before
        ``start_powerSGD_iter`` the whole bucket; after it the P and Q matrices of this bucket
        (``state.p_memory_dict`` / ``q_memory_dict``) and the tensors left uncompressed (the
        call's increase of ``state.total_numel_after_compression`` minus P and Q)."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        compressed = state.iter >= state.start_powerSGD_iter
        before = state.total_numel_after_compression
        fut = powerSGD_hook.powerSGD_hook(state, bucket)
        entry = {"index": bucket.index(), "numel": bucket.buffer().numel(),
                 "compressed": compressed}
        if compressed:
            p = state.p_memory_dict[bucket.index()].numel()
            q = state.q_memory_dict[bucket.index()].numel()
            entry.update(p=p, q=q, uncompressed=state.total_numel_after_compression - before
                         - p - q)
        self.calls.append(entry)
        return fut

    def step(self, opt, model: nn.Module, clip: float) -> None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)    # DDP averaged in backward
        opt.step()

    def formula_wire(self, args) -> str | None:
        return {"allreduce": "allreduce_fp32", "fp16": "allreduce_fp16",
                "bf16": "allreduce_fp16"}.get(self.hook)

    def powersgd_bytes(self, first_call: int) -> float:
        """Bytes one rank sent in PowerSGD's calls from ``first_call`` on (fp32 ring)."""
        total = 0.0
        for c in self.calls[first_call:]:
            values = c["p"] + c["q"] + c["uncompressed"] if c["compressed"] else c["numel"]
            total += xchg.bytes_sent("allreduce_fp32", values, 0, 1, self.size)
        return total



def bf16_compress(process_group, bucket):     # (no annotation: DDP checks a string one)
    """PyTorch's ``bf16_compress_hook`` under another name. DDP refuses a hook *named*
    ``bf16_compress_hook`` unless CUDA with NCCL ≥ 2.10 (or XPU) is present
    (``DistributedDataParallel._check_comm_hook``), although Gloo on CPU allreduces bfloat16;
    the hook itself is unchanged: cast the bucket to bfloat16 divided by P, allreduce, cast
    back."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


# ============================================================================ training
class ByteMeter:
    """Bytes one rank sent since the last :meth:`take`: horovod_aq's telemetry where the run has
    it, PowerSGD's recorded calls, else ``steps`` ring allreduces of the gradient by formula."""

    def __init__(self, launcher, telemetry, wire: str | None, numel: int) -> None:
        self.launcher, self.telemetry, self.wire, self.numel = launcher, telemetry, wire, numel
        self._tele = telemetry.totals()["bytes_sent"]
        self._calls = 0

    def take(self, steps: int) -> float:
        if self.wire is not None:
            sent = steps * xchg.bytes_sent(self.wire, self.numel, 0, 1, self.launcher.size)
        elif self.launcher.hook == "powersgd":
            sent = self.launcher.powersgd_bytes(self._calls)
        else:
            now = self.telemetry.totals()["bytes_sent"]
            sent, self._tele = now - self._tele, now
        self._calls = len(self.launcher.calls)
        return float(sent)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    launcher = DDP(args) if args.ddp else Horovod(args)
    rank, size = launcher.rank, launcher.size
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")

    corpus = gpt.load_corpus()
    cfg = gpt.GPTConfig(vocab_size=corpus.vocab_size, context=args.context,
                        d_model=args.d_model, n_head=args.n_head, n_layer=args.n_layer)
    model = gpt.build(cfg, args.seed)
    numel = sum(p.numel() for p in model.parameters())
    base = torch.optim.AdamW(gpt.param_groups(model, args.weight_decay), lr=args.lr,
                             betas=(args.beta1, args.beta2))
    telemetry = common.make_telemetry(args, rank, framework="torch")
    net, opt, compression, name = launcher.wrap(args, model, base, telemetry)
    init_fingerprint = gpt.fingerprint(model)        # after the broadcast: the same everywhere
    meter = ByteMeter(launcher, telemetry, launcher.formula_wire(args), numel)
    fp32_per_step = xchg.bytes_sent("allreduce_fp32", numel, 0, 1, size)

    batches = gpt.Batches(corpus.train, args.context, args.batch_size, seed=args.seed, rank=rank)
    vx, vy = gpt.val_windows(corpus.val, args.context)
    sub = gpt.subset(len(vx), args.eval_windows)

    def val_bpc(x, y, tag):
        return gpt.evaluate(model, x, y, rank=rank, size=size, batch=EVAL_BATCH,
                            allreduce_sum=lambda t: launcher.allreduce_sum(t, tag))

    curve: list[dict[str, float]] = []
    target: dict[str, float] | None = None
    train_seconds = eval_seconds = bytes_total = loss_sum = 0.0
    last_eval, last_lr = 0, 0.0             # the learning rate of the last step taken

    def record(step: int) -> None:
        nonlocal eval_seconds, bytes_total, loss_sum, last_eval, target
        sent = meter.take(step - last_eval)
        bytes_total += sent
        t0 = time.perf_counter()
        bpc = val_bpc(vx[sub], vy[sub], "val_subset")
        losses = launcher.allreduce_sum(torch.tensor([loss_sum, float(step - last_eval)],
                                                     dtype=torch.float64), "train_loss")
        eval_seconds += time.perf_counter() - t0
        train_loss = float(losses[0] / losses[1]) if step > last_eval else float("nan")
        point = {"step": step, "val_bpc": bpc, "train_loss": train_loss,
                 "train_seconds": train_seconds, "seconds": train_seconds + eval_seconds,
                 "bytes_sent": bytes_total, "lr": last_lr}
        curve.append(point)
        if target is None and args.target_bpc is not None and bpc <= args.target_bpc:
            target = {"step": step, "train_seconds": train_seconds,
                      "seconds": point["seconds"], "val_bpc": bpc}
        loss_sum, last_eval = 0.0, step
        if rank == 0:
            per_step = sent / max(1, step - (curve[-2]["step"] if len(curve) > 1 else 0))
            print(f"step {step:4d}/{args.steps}  val bpc {bpc:.4f}  train loss {train_loss:.4f}"
                  f"  lr {point['lr']:.2e}  {per_step / 1e3:.1f} kB/step "
                  f"({per_step / fp32_per_step:.3f} of fp32)  {point['seconds']:.1f}s",
                  flush=True)

    if rank == 0:
        print(f"== {name}: GPT {numel:,} parameters, {size} ranks, {args.steps} steps, "
              f"corpus {corpus.fingerprint} ==", flush=True)
    record(0)
    for step in range(args.steps):
        t0 = time.perf_counter()
        lr = gpt.lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        last_lr = lr
        x, y = batches.next()
        opt.zero_grad()
        loss = gpt.loss_fn(net, x, y)
        loss.backward()
        launcher.step(opt, model, args.clip)
        loss_sum += loss.item()
        train_seconds += time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            record(step + 1)

    t0 = time.perf_counter()
    final = val_bpc(vx, vy, "val_full")
    eval_seconds += time.perf_counter() - t0
    tele = telemetry.totals()
    result = {
        "label": name, "ddp": args.ddp, "ddp_hook": args.ddp_hook if args.ddp else None,
        "exchange": args.exchange, "compression": args.compression, "bits": args.bits,
        "error_feedback": args.error_feedback,
        "compressor": common.label(compression) if compression is not None else None,
        "powersgd_rank": args.powersgd_rank if args.ddp_hook == "powersgd" else None,
        "seed": args.seed, "ranks": size, "steps": args.steps, "numel": numel,
        "val_bpc": final, "val_windows": len(vx), "eval_windows": len(sub),
        "target_bpc": args.target_bpc, "time_to_target": target,
        "bytes_per_step": bytes_total / args.steps, "bytes_fp32_per_step": fp32_per_step,
        "bits_per_coordinate": tele["bits_per_coordinate"] or None,
        "train_seconds": train_seconds, "seconds": train_seconds + eval_seconds,
        "corpus": corpus.fingerprint, "init_fingerprint": init_fingerprint,
    }
    if rank == 0:
        reached = (f"step {target['step']} ({target['train_seconds']:.1f}s training, "
                   f"{target['seconds']:.1f}s in all)" if target else "not reached")
        print(f"final val bpc {final:.4f} (all {len(vx)} windows)  "
              f"{result['bytes_per_step'] / 1e3:.1f} kB/step/rank "
              f"({result['bytes_per_step'] / fp32_per_step:.4f} of fp32)  "
              f"target {args.target_bpc}: {reached}  {result['seconds']:.1f}s", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "metrics.json"), "w") as f:
                json.dump({"summary": result, "curve": curve, "args": vars(args)}, f, indent=1)
    telemetry.close()
    return result


if __name__ == "__main__":
    if main()["ddp"]:
        from horovod_aq.torch import ddp as aqddp

        aqddp.destroy_and_exit()   # PyTorch's Gloo shutdown race at exit: docs/ddp.md §6
