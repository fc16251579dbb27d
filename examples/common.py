"""What the three MNIST examples share: flags, the compressor, telemetry, per-epoch reports, plots.

Framework-free (numpy + horovod_aq core); the examples pass framework objects in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

import horovod_aq
from horovod_aq import error_feedback_setting
from horovod_aq.packed import cost as xchg
from horovod_aq.telemetry import JsonlSink, Telemetry

#: ``--error-feedback`` values → ``error_feedback=`` of the packed entry points.
ERROR_FEEDBACK = {"auto": "auto", "on": True, "off": False}
COMPRESSIONS = ["alq", "alqn", "alqg", "amq", "amqn", "qsgd", "qsgdinf", "nuqsgd", "terngrad",
                "natural", "dqsgd", "fp16", "none"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The MNIST examples' flags: :func:`compression_flags` plus epochs, batch, lr, seed,
    threads and outputs."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    compression_flags(p)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank (scaled by the rank count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--out", default=None, help="directory for telemetry, metrics.json and plots")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def compression_flags(p: argparse.ArgumentParser) -> None:
    """The flags :func:`make_compressor` reads (with ``--seed``): --compression, --bits,
    --bucket-size, --norm, --error-feedback, --exchange."""
    p.add_argument("--compression", choices=COMPRESSIONS, default="alq")
    p.add_argument("--bits", type=int, default=3, help="bits per coordinate (1..8)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="coordinates per quantization bucket (default: the method's)")
    p.add_argument("--norm", choices=["l2", "linf"], default=None,
                   help="bucket scale (default: the method's)")
    p.add_argument("--error-feedback", choices=list(ERROR_FEEDBACK), nargs="?", const="on",
                   default="auto",
                   help="ECQ-SGD error compensation around the quantizer: auto (the packed "
                   "exchange's default: on for quantizers of <= 3 bits), on (--error-feedback "
                   "alone) or off")
    p.add_argument("--exchange", choices=["auto", "allgather", "two_phase", "stock"],
                   default="auto", help="packed exchange mode, or 'stock' for Horovod's own "
                   "optimizer with compression= (fp16 wire)")


def error_feedback(args: argparse.Namespace) -> bool | str:
    """``--error-feedback`` as the packed entry points' ``error_feedback=``."""
    return ERROR_FEEDBACK[args.error_feedback]


def make_compressor(args: argparse.Namespace, optimizer: Any = None) -> horovod_aq.Compressor:
    """The compressor of the flags, with error feedback as the packed exchange will use it for
    the local ``optimizer`` (so titles and reports name it; "auto" leaves it out under Adam and
    AdamW, docs/quantizers.md §5.11); on ``--exchange stock`` only ``--error-feedback on`` adds
    it (and Horovod's hook then refuses it, saying why)."""
    kwargs: dict[str, Any] = {"bits": args.bits, "seed": args.seed}
    if args.bucket_size is not None:
        kwargs["bucket_size"] = args.bucket_size
    if args.norm is not None:
        kwargs["norm"] = args.norm
    if args.compression in ("none", "fp16"):
        kwargs = {}
    comp = horovod_aq.from_name(args.compression, **kwargs)
    if args.exchange == "stock":
        return horovod_aq.ErrorFeedback(comp) if args.error_feedback == "on" else comp
    return error_feedback_setting.resolve(comp, error_feedback(args), optimizer)


def make_telemetry(args: argparse.Namespace, rank: int, framework: str) -> Telemetry:
    sinks: list = []
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "telemetry.jsonl")
        if os.path.exists(path):
            os.remove(path)
        sinks.append(JsonlSink(path))
        if args.tensorboard:
            try:
                sinks.append(horovod_aq.TensorBoardSink(os.path.join(args.out, "tb"), framework))
            except ImportError as exc:
                print(f"TensorBoard unavailable ({exc}); writing JSON lines only", file=sys.stderr)
    return Telemetry(sinks, log_every=0)


#: How the examples name a method in titles (``horovod_aq.METHODS`` keys → display names).
DISPLAY = {"alq": "ALQ", "alqn": "ALQ-N", "alqg": "ALQ-G", "amq": "AMQ", "amqn": "AMQ-N",
           "qsgd": "QSGD", "qsgdinf": "QSGDinf", "nuqsgd": "NUQSGD", "terngrad": "TernGrad",
           "natural": "natural dithering", "dqsgd": "DQSGD"}


def label(compression: Any) -> str:
    """What a run is called in titles: "fp32", "fp16", "ALQ 3-bit", "TernGrad (ternary)", and
    " + error feedback" for an ErrorFeedback."""
    quantizer = compression.quantizer
    if not quantizer.quantizes:
        return "fp16" if quantizer.method == "fp16" else "fp32"
    name = DISPLAY.get(quantizer.method, quantizer.method)
    text = f"{name} (ternary)" if quantizer.method == "terngrad" else f"{name} {quantizer.bits}-bit"
    return text + (" + error feedback" if compression.error_memory is not None else "")


def progress(it: Iterable, show: bool, desc: str) -> Iterable:
    """A tqdm progress bar when ``show`` (rank 0, unless --no-progress) and stderr is a terminal,
    else ``it`` itself. Under horovodrun stderr is a pipe that prefixes every line with its rank,
    so a redrawn bar would print a new prefixed line per update: the per-epoch lines are the
    progress there (``horovod-aq demo`` draws one bar of its own)."""
    if not show or not sys.stderr.isatty():
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, leave=False, dynamic_ncols=True)


class EpochMeter:
    """Per-epoch numbers. Bytes come from the packed optimizer's telemetry (deltas of its
    totals); on the stock path (no telemetry) they are Horovod's fp16 ring allreduce of every
    gradient (fp32 for NoCompression)."""

    def __init__(self, telemetry: Telemetry, compression: horovod_aq.Compressor, *, numel: int,
                 ranks: int) -> None:
        self.telemetry, self.compression = telemetry, compression
        self.numel, self.ranks = numel, ranks
        self._before = telemetry.totals()

    def record(self, epoch: int, train_loss: float, test_loss: float, test_acc: float,
               seconds: float, steps: int) -> dict[str, float]:
        totals = self.telemetry.totals()
        delta = {k: totals[k] - self._before[k] for k in totals}
        self._before = totals
        if delta["steps"]:
            bytes_sent, bytes_fp32 = delta["bytes_sent"], delta["bytes_fp32"]
            bits = (8.0 * delta["payload_bytes"] / delta["numel_quantized"]
                    if delta["numel_quantized"]
                    else (16.0 if self.compression.method == "fp16" else 32.0))
        else:
            wire = "allreduce_fp32" if self.compression.method == "none" else "allreduce_fp16"
            bytes_sent = steps * xchg.bytes_sent(wire, self.numel, 0, 1, self.ranks)
            bytes_fp32 = steps * xchg.bytes_sent("allreduce_fp32", self.numel, 0, 1, self.ranks)
            bits = 32.0 if wire == "allreduce_fp32" else 16.0
        comp = self.compression
        return {"epoch": epoch, "train_loss": float(train_loss), "test_loss": float(test_loss),
                "test_acc": float(test_acc), "seconds": float(seconds),
                "bits_per_coordinate": bits, "bytes_sent": float(bytes_sent),
                "bytes_fp32": float(bytes_fp32),
                "table_version": int(comp.table.version) if comp.quantizes else -1}


def _mb(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def print_epoch(h: dict[str, float]) -> None:
    ratio = h["bytes_fp32"] / h["bytes_sent"] if h["bytes_sent"] else float("nan")
    print(f"epoch {h['epoch']:2d}  train loss {h['train_loss']:.4f}  test loss {h['test_loss']:.4f}"
          f"  test acc {100 * h['test_acc']:5.2f}%  {h['bits_per_coordinate']:.2f} bits/coord  "
          f"sent {_mb(h['bytes_sent'])} vs fp32 {_mb(h['bytes_fp32'])} ({ratio:.1f}x less)  "
          f"{h['seconds']:.1f}s", flush=True)


def summary(args: argparse.Namespace, history: list[dict[str, float]], telemetry: Telemetry,
            compression: horovod_aq.Compressor, ranks: int) -> dict[str, Any]:
    sent = sum(h["bytes_sent"] for h in history)
    fp32 = sum(h["bytes_fp32"] for h in history)
    last = history[-1]
    return {"compression": args.compression, "bits": args.bits, "label": label(compression),
            "exchange": args.exchange,
            "ranks": ranks, "epochs": len(history), "test_acc": last["test_acc"],
            "test_loss": last["test_loss"], "bytes_sent": sent, "bytes_fp32": fp32,
            "compression_ratio": fp32 / sent if sent else float("nan"),
            "bits_per_coordinate": float(np.mean([h["bits_per_coordinate"] for h in history])),
            "seconds": sum(h["seconds"] for h in history),
            "table_version": last["table_version"]}


def local_gradient(model: Any, loss_fn: Callable[[Any], Any]) -> np.ndarray:
    """A flat numpy gradient of ``loss_fn(model_copy)`` for the level plot, computed on a copy of
    the PyTorch model so that the distributed optimizer's hooks (collectives) do not fire."""
    import copy

    clone = copy.deepcopy(model)
    loss_fn(clone).backward()
    grads = [p.grad.detach().reshape(-1).numpy() for p in clone.parameters() if p.grad is not None]
    return np.concatenate(grads[::-1])


def finish(args: argparse.Namespace, result: dict[str, Any], history: list[dict[str, float]],
           compression: horovod_aq.Compressor, gradient: np.ndarray | None = None) -> None:
    """Rank 0: print the summary, write metrics.json and plots under ``args.out``."""
    name = label(compression)
    print(f"\n== {name}, {result['ranks']} ranks, {result['epochs']} epochs "
          f"({args.exchange} exchange) ==")
    print(f"test accuracy {100 * result['test_acc']:.2f}%  (loss {result['test_loss']:.4f})")
    print(f"sent {_mb(result['bytes_sent'])} of gradients; an fp32 allreduce would send "
          f"{_mb(result['bytes_fp32'])}: {result['compression_ratio']:.1f}x less "
          f"({result['bits_per_coordinate']:.2f} bits per coordinate)")
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump({"summary": result, "epochs": history}, f, indent=2)
    try:
        from horovod_aq.tools import plots
    except ImportError:
        return
    files = [plots.plot_curves({name: history},
                               os.path.join(args.out, "curves.png"),
                               title=f"MNIST subset, {result['ranks']} ranks")]
    if compression.quantizes and gradient is not None:
        files.append(plots.plot_levels(
            compression.table.levels, os.path.join(args.out, "levels.png"), gradient=gradient,
            bucket_size=compression.bucket_size,
            title=f"{name} levels (table v{compression.table.version}) over the normalized "
                  "gradient"))
    print("wrote " + ", ".join(files + [os.path.join(args.out, "metrics.json")]))
