"""horovod_aq.torch.DistributedOptimizer as a drop-in for hvd.DistributedOptimizer, on 2 real ranks.

What a Horovod script does with its optimizer must work unchanged with ours: the checkpoint
pattern (rank 0 loads, ``hvd.broadcast_optimizer_state`` spreads it), ``zero_grad(set_to_none=)``,
Horovod's whole constructor signature (``op``, ``gradient_predivide_factor``,
``backward_passes_per_step``, ``groups``/``num_groups``, ``sparse_as_dense``), Horovod's
compression classes and ours passed as classes, and Horovod's warnings. Without quantization the
result must be bitwise Horovod's own (the pass-through hands every gradient to Horovod's
allreduce). All checks run in one launch per controller.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_torch, tiny_model

BUCKET = 64
FUSION_BYTES = 4000   # the tiny model spans several fused buckets
#: Refits at the ends of steps 0 and 2.
SCHEDULE = "0,2,0"


def _batch(torch, rank, step, n=8):
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 20, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _weights(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


def _train(torch, model, opt, rank, steps, *, bpps=1, first=0, zero=None):
    import torch.nn.functional as F

    for step in range(first, first + steps):
        if zero is None:
            opt.zero_grad()
        else:
            opt.zero_grad(set_to_none=zero)
        for k in range(bpps):
            x, y = _batch(torch, rank, step * bpps + k)
            F.cross_entropy(model(x), y).backward()
        opt.step()


def _alq():
    import horovod_aq

    return horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=5, schedule=SCHEDULE)


def _ef():
    import horovod_aq

    return horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=2, bucket_size=BUCKET, seed=5),
                                    alpha=0.3, beta=0.8)


def _base(torch, kind, model):
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if kind == "sgd" else 0.9)


# ---------------------------------------------------------------- checks (inside the ranks)
def resume_layouts():
    """Horovod's checkpoint pattern: ``state_dict()`` on rank 0 only after 3 steps (with error
    feedback, the default at 3 bits, after ``consolidate_state_dict()`` on every rank, so that
    it holds every rank's memory), loaded on rank 0 only (or on every rank, from every rank's
    own save), then hvd.broadcast_parameters + hvd.broadcast_optimizer_state. The resumed step
    must be bitwise the uninterrupted run's 4th step, with the compressor's step, table version
    and levels of the checkpoint on every rank. "rank0-local": error feedback saved without
    consolidating: rank 0 gets its memory back, the others restart theirs from zero, the
    replicas agree."""
    import io

    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    out = {}
    cases = [("rank0", "momentum", _alq), ("rank0", "sgd", _alq), ("rank0", "adam", _alq),
             ("rank0", "momentum", _ef), ("rank0-local", "momentum", _ef),
             ("all", "momentum", _alq)]
    for layout, kind, make in cases:
        key = f"{layout}-{kind}-{make.__name__}"
        model = tiny_model(torch, 0)
        comp = make()
        opt = aqt.DistributedOptimizer(_base(torch, kind, model), model.named_parameters(), comp,
                                       fusion_bytes=FUSION_BYTES)
        _train(torch, model, opt, rank, 3)
        if layout == "rank0":   # every rank (error_feedback="auto" wraps ALQ 3-bit too)
            opt.consolidate_state_dict(to=0)
        buf = io.BytesIO()
        if layout == "all" or rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        saved = (comp.step, comp.quantizer.table.version, comp.quantizer.table.levels.tobytes())
        memory = _pending_memory_norm(comp) if make is _ef else None
        _train(torch, model, opt, rank, 1, first=3)
        reference = _weights(model)

        model2 = tiny_model(torch, 10 + rank)   # other weights on every rank
        comp2 = make()
        # Content names: a second optimizer for the same model in the same process has the
        # same bucket names (and so finds its error-feedback memory in the checkpoint).
        opt2 = aqt.DistributedOptimizer(_base(torch, kind, model2), model2.named_parameters(),
                                        comp2, fusion_bytes=FUSION_BYTES)
        if layout == "all" or rank == 0:
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=False)
            model2.load_state_dict(ckpt["model"])
            opt2.load_state_dict(ckpt["opt"])
        hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt2, root_rank=0)
        after = (comp2.step, comp2.quantizer.table.version,
                 comp2.quantizer.table.levels.tobytes())
        memory2 = _pending_memory_norm(comp2) if make is _ef else None
        _train(torch, model2, opt2, rank, 1, first=3)
        out[key] = {"saved": saved, "after": after, "identical": _same(_weights(model2), reference),
                    "weights": _weights(model2), "memory": (memory, memory2)}
    return out


def _pending_memory_norm(comp) -> float:
    """‖h‖ of an ErrorFeedback's memory, loaded or in use (a loaded memory is installed at the
    first gradient)."""
    return float(np.sqrt(sum(np.sum(np.square(h, dtype=np.float64))
                             for h in comp.error_memory.local_state().values())))


def fresh_start():
    """broadcast_optimizer_state on a fresh start (every rank's state empty) runs no exchange and
    counts no compressor step: the first refit is fitted to the first real gradients, exactly as
    in a run without the broadcast."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    out = {}
    for kind in ("adam", "momentum"):
        levels, grads = [], []
        for broadcast in (True, False):
            model = tiny_model(torch, 0)
            comp = _alq()
            opt = aqt.DistributedOptimizer(_base(torch, kind, model), model.named_parameters(),
                                           comp, fusion_bytes=FUSION_BYTES)
            if broadcast:
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
                out[f"{kind}-step-after-broadcast"] = comp.step
                out[f"{kind}-state-initialized"] = len(opt.state_dict()["state"]) > 0
            import torch.nn.functional as F

            x, y = _batch(torch, rank, 0)
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            grads.append({k: p.grad.numpy().copy() for k, p in model.named_parameters()})
            with opt.skip_synchronize():
                opt.step()
            levels.append((comp.table.version, comp.table.levels.tobytes(), comp.step))
            out[f"{kind}-carrier-left"] = any("horovod_aq" in g for g in opt.param_groups)
        out[f"{kind}-levels-same"] = levels[0] == levels[1]
        out[f"{kind}-version"] = levels[0][0]
        out[f"{kind}-grads-same"] = _same(grads[0], grads[1])
    return out


def zero_grad_set_to_none():
    """zero_grad(set_to_none=True/False) as torch takes it; same training as zero_grad()."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    results = {}
    for zero in (None, True, False):
        model = tiny_model(torch, 0)
        opt = aqt.DistributedOptimizer(_base(torch, "momentum", model), model.named_parameters(),
                                       horovod_aq.QSGD(bits=3, bucket_size=BUCKET, seed=1),
                                       fusion_bytes=FUSION_BYTES)
        _train(torch, model, opt, rank, 3, zero=zero)
        results[zero] = _weights(model)
        opt.zero_grad(set_to_none=True)
        results[f"none-{zero}"] = all(p.grad is None for p in model.parameters())
    return {"true": _same(results[None], results[True]),
            "false": _same(results[None], results[False]),
            "cleared": results["none-None"] and results["none-True"]}


def load_refused_unchanged():
    """load_state_dict of a state saved with other bits raises and changes nothing."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    states = {}
    for bits, lr in ((4, 0.2), (3, 0.05)):
        model = tiny_model(torch, bits)
        comp = horovod_aq.QSGD(bits=bits, bucket_size=BUCKET, seed=1)
        opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                       model.named_parameters(), comp,
                                       fusion_bytes=FUSION_BYTES)
        _train(torch, model, opt, rank, 1)
        states[bits] = (model, comp, opt)
    model, comp, opt = states[3]
    foreign = states[4][2].state_dict()
    before = {k: v["momentum_buffer"].clone() for k, v in opt.state.items()}
    fingerprint = comp.fingerprint().tolist()
    try:
        opt.load_state_dict(foreign)
        error = None
    except ValueError as exc:
        error = str(exc)
    unchanged = (all(torch.equal(v["momentum_buffer"], before[k]) for k, v in opt.state.items())
                 and opt.param_groups[0]["lr"] == 0.05
                 and comp.fingerprint().tolist() == fingerprint)
    _train(torch, model, opt, rank, 1, first=1)   # the optimizer still works (and handshakes)
    return {"error": error, "unchanged": unchanged, "step": comp.step}


def _horovod_style(torch, hvd, factory, compression, *, op, factor=1.0, bpps=2, steps=3,
                   **kwargs):
    """What a Horovod example script does (pytorch_mnist.py, pytorch_imagenet_resnet50.py)."""
    model = tiny_model(torch, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = factory(optimizer, named_parameters=model.named_parameters(),
                        compression=compression, backward_passes_per_step=bpps, op=op,
                        gradient_predivide_factor=factor, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    _train(torch, model, optimizer, hvd.rank(), steps, bpps=bpps)
    return model, optimizer


def horovod_signature():
    """Horovod's signature with Horovod's meaning: without quantization bitwise the weights of
    hvd.DistributedOptimizer (op Average/Sum, gradient_predivide_factor, bpps=2, groups, fp16);
    with ALQ the Horovod-style call trains, and Adasum is refused on every rank."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt

    out = {}
    cases = {"avg": (hvd.Compression.none, horovod_aq.NoCompression(), hvd.Average, 1.0, {}),
             "avg-f2": (hvd.Compression.none, hvd.Compression.none, hvd.Average, 2.0, {}),
             "sum": (hvd.Compression.none, horovod_aq.NoCompression(), hvd.Sum, 1.0, {}),
             "fp16-f2": (hvd.Compression.fp16, horovod_aq.FP16(), hvd.Average, 2.0, {}),
             "fp16-class": (hvd.Compression.fp16, hvd.Compression.fp16, hvd.Average, 1.0, {}),
             "groups": (hvd.Compression.none, horovod_aq.NoCompression(), hvd.Average, 1.0,
                        {"groups": 2})}
    for name, (theirs, ours, op, factor, kw) in cases.items():
        m1, _ = _horovod_style(torch, hvd, hvd.DistributedOptimizer, theirs, op=op,
                               factor=factor, **kw)
        m2, o2 = _horovod_style(torch, hvd, aqt.DistributedOptimizer, ours, op=op,
                                factor=factor, **kw)
        out[name] = _same(_weights(m1), _weights(m2))
        out[f"{name}-steps"] = o2.compression.step
    for use_adasum in (False, True):
        try:
            model, opt = _horovod_style(
                torch, hvd, aqt.DistributedOptimizer,
                horovod_aq.ALQ(bits=3, bucket_size=BUCKET, schedule=SCHEDULE),
                op=hvd.Adasum if use_adasum else hvd.Average, factor=2.0)
            out[f"adasum-{use_adasum}"] = {
                "step": opt.compression.step, "version": opt.compression.table.version,
                "weights": {k: v.tobytes() for k, v in _weights(model).items()}}
        except ValueError as exc:
            out[f"adasum-{use_adasum}"] = str(exc)
    model = tiny_model(torch, 0)
    fallback = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters(), horovod_aq.NoCompression(),
                                        op=hvd.Adasum)
    out["adasum-fallback"] = hasattr(fallback, "_starting_models")   # Horovod's Adasum class
    return out


def sum_and_predivide_quantized():
    """Quantized buckets: op=Sum is bitwise 2x the average on 2 ranks, and
    gradient_predivide_factor leaves the average unchanged; small tensors take Horovod's
    allreduce with its op and pre/post-scaling."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    grads = {}
    for name, op, factor in (("avg", hvd.Average, 1.0), ("sum", hvd.Sum, 1.0),
                             ("f4", hvd.Average, 4.0)):
        model = tiny_model(torch, 0)
        opt = aqt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            horovod_aq.QSGD(bits=3, bucket_size=BUCKET, seed=3), op=op,
            gradient_predivide_factor=factor, fusion_bytes=FUSION_BYTES,
            small_tensor_threshold=100)
        x, y = _batch(torch, rank, 0)
        F.cross_entropy(model(x), y).backward()
        local = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.synchronize()
        grads[name] = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
        small = [k for k, p in model.named_parameters() if p.numel() < 100]
        grads[f"{name}-horovod"] = {
            k: hvd.allreduce(local[k], op=op, prescale_factor=1 / factor if op == hvd.Average
                             else 1.0, postscale_factor=factor if op == hvd.Average else 1.0,
                             name=f"test.small.{name}.{k}").numpy() for k in small}
        grads["small"] = small
    big = [k for k in grads["avg"] if k not in grads["small"]]
    return {
        "sum-big": all(np.array_equal(grads["sum"][k], 2 * grads["avg"][k]) for k in big),
        "f4-big": all(np.array_equal(grads["f4"][k], grads["avg"][k]) for k in big),
        "small": {name: all(np.array_equal(grads[name][k], grads[f"{name}-horovod"][k])
                            for k in grads["small"]) for name in ("avg", "sum", "f4")},
        "n_small": len(grads["small"]), "n_big": len(big)}


def groups_and_sparse():
    """groups=n / lists / num_groups map onto buckets that never mix two groups; sparse
    gradients (with and without sparse_as_dense) give the dense average on every path."""
    import warnings

    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    out = {}
    layouts = {"none": lambda ps: {}, "n2": lambda ps: {"groups": 2},
               "list": lambda ps: {"groups": [[ps["0.weight"], ps["2.weight"]]]}}
    for name, groups in layouts.items():
        model = tiny_model(torch, 0)   # 0.weight, 0.bias, 2.weight, 2.bias (a new one: hooks)
        kw = groups(dict(model.named_parameters()))
        opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(),
                                       horovod_aq.QSGD(bits=3, bucket_size=BUCKET), **kw)
        out[name] = sorted(sorted(b[3]) for b in opt.buckets)
        x, y = _batch(torch, rank, 0)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = tiny_model(torch, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(),
                                       horovod_aq.QSGD(bits=3, bucket_size=BUCKET), num_groups=2)
    out["num_groups"] = sorted(sorted(b[3]) for b in opt.buckets)
    out["num_groups_warning"] = [w.category.__name__ for w in caught
                                 if "num_groups" in str(w.message)]

    sparse = {}
    for label, comp in (("none", horovod_aq.NoCompression()),
                        ("qsgd", horovod_aq.QSGD(bits=8, bucket_size=BUCKET, seed=2))):
        for dense in (False, True):
            torch.manual_seed(0)
            emb = torch.nn.Embedding(40, 8, sparse=True)
            opt = aqt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                           emb.named_parameters(), comp, sparse_as_dense=dense)
            idx = torch.tensor([rank, 5, 7 + 3 * rank])
            emb(idx).sum().backward()
            local = emb.weight.grad.to_dense().clone()
            opt.synchronize()
            grad = emb.weight.grad
            exact = hvd.allreduce(local, op=hvd.Average, name=f"test.sparse.{label}.{dense}")
            sparse[f"{label}-{dense}"] = (float((grad.to_dense() - exact).abs().max()),
                                          grad.is_sparse)
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
    out["sparse"] = sparse
    return out


def class_compression():
    """compression=horovod_aq.ALQ (the class, as Horovod users write hvd.Compression.fp16): our
    optimizer instantiates it with default settings; Horovod's stock optimizer calls
    ALQ.compress on one shared instance, which refits."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    model = tiny_model(torch, 0)
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), horovod_aq.ALQ)
    _train(torch, model, opt, rank, 2)
    ours = (type(opt.compression).__name__, opt.compression.bits, opt.compression.step,
            opt.compression.table.version)

    model = tiny_model(torch, 0)
    stock = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=horovod_aq.ALQ)
    shared = horovod_aq.ALQ.shared()
    _train(torch, model, stock, rank, 2)   # the step hook ends each step: refit at step 0
    return {"ours": ours, "shared_same": shared is horovod_aq.ALQ.shared(),
            "shared_step": shared.step,
            "shared_version": shared.table.version,
            "shared_levels": shared.table.levels.tobytes(),
            "weights": {k: v.tobytes() for k, v in _weights(model).items()}}


def warnings_like_horovod():
    """Misuse warns with Horovod's category; the stock and packed paths emit no stray warning
    for tensors smaller than one quantization bucket (warnings are errors here)."""
    import warnings

    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    categories = {}
    for name, factory, comp in (("horovod", hvd.DistributedOptimizer, hvd.Compression.none),
                                ("ours", aqt.DistributedOptimizer,
                                 horovod_aq.QSGD(bits=3, bucket_size=BUCKET))):
        model = tiny_model(torch, 0)
        opt = factory(torch.optim.SGD(model.parameters(), lr=0.1),
                      named_parameters=model.named_parameters(), compression=comp)
        x, y = _batch(torch, rank, 0)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()   # without skip_synchronize(): exchanged again, with a warning
        categories[name] = sorted({w.category.__name__ for w in caught
                                   if "skip_synchronize" in str(w.message)})
    errors = {}
    for name in ("stock", "packed"):
        model = tiny_model(torch, 0)   # every tensor (and fused bucket) < 1024 coordinates
        comp = horovod_aq.ALQ(bits=3, bucket_size=1024, schedule="0,1,0")
        if name == "stock":
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=comp)
        else:
            opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters(), comp,
                                           fusion_bytes=FUSION_BYTES)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                _train(torch, model, opt, rank, 2)   # steps 0 and 1 record statistics
            errors[name] = None
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"categories": categories, "errors": errors}


def wrapped_twice():
    """Wrapping an optimizer that is already a DistributedOptimizer (ours or Horovod's),
    positionally as Horovod users write it, says so instead of a TypeError about positional
    arguments of an internal class."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt

    model = tiny_model(torch, 0)
    out = {}
    for name, inner in (("ours", aqt.DistributedOptimizer), ("horovod", hvd.DistributedOptimizer)):
        wrapped = inner(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                        horovod_aq.QSGD(bits=3) if name == "ours" else hvd.Compression.none)
        try:
            aqt.DistributedOptimizer(wrapped, model.named_parameters(), horovod_aq.QSGD(bits=3))
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, str(exc))
    return out


def _readme_torch_snippet() -> str:
    """The README's PyTorch block (the first ```python block that wraps with horovod_aq.torch)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    return next(b for b in blocks if "horovod_aq.torch.DistributedOptimizer" in b)


#: The README's PyTorch snippet, read here (in pytest) and run as written in the ranks.
README_TORCH = _readme_torch_snippet()


def readme_snippet():
    """The README's PyTorch block runs as written after a setup that builds ``model``, ``opt``,
    ``loss_fn`` and ``data`` (different initial weights and data on every rank): it must train
    (loss falls), end with the same weights on every rank, and refit on schedule by itself."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    torch.manual_seed(100 + hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = F.cross_entropy
    gen = torch.Generator().manual_seed(hvd.rank())
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    data = []
    for _ in range(120):
        x = torch.randn(16, 20, generator=gen)
        data.append((x, (x @ w).argmax(1)))
    x0, y0 = data[0]
    with torch.no_grad():
        before = loss_fn(model(x0), y0).item()
    ns = {"model": model, "opt": opt, "loss_fn": loss_fn, "data": data}
    exec(README_TORCH, ns)  # noqa: S102  (the README's text, as a user runs it)
    with torch.no_grad():
        after = loss_fn(model(x0), y0).item()
    comp = ns["opt"].compression
    return {"weights": _weights(model), "before": before, "after": after,
            "steps": comp.step, "version": comp.table.version}


CHECKS = [resume_layouts, fresh_start, zero_grad_set_to_none, load_refused_unchanged,
          horovod_signature, sum_and_predivide_quantized, groups_and_sparse, class_compression,
          warnings_like_horovod, wrapped_twice, readme_snippet]


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]))
def launch(request):
    return run_local(CHECKS, np=2, controller=request.param, timeout=600)


# ---------------------------------------------------------------- tests
@pytest.mark.multiprocess
def test_the_readme_pytorch_snippet_trains_as_written(launch):
    r0, r1 = launch.get(readme_snippet)
    assert _same(r0["weights"], r1["weights"])          # broadcast + identical averages
    assert r0["steps"] == r1["steps"] == 120
    assert r0["version"] == r1["version"] >= 2          # ALQ refitted at steps 0 and 100
    assert r0["after"] < 0.7 * r0["before"]


@pytest.mark.multiprocess
def test_broadcast_optimizer_state_resumes_every_layout(launch):
    results = launch.get(resume_layouts)
    for key in results[0]:
        for r in results:
            assert r[key]["after"] == r[key]["saved"], key   # step, version and levels
            if not key.startswith("rank0-local"):
                assert r[key]["identical"], key             # = the uninterrupted 4th step
            assert _same(r[key]["weights"], results[0][key]["weights"]), key
        assert results[0][key]["saved"][0] == 3
    full = [r["rank0-momentum-_ef"]["memory"] for r in results]
    assert all(saved > 0 and after == saved for saved, after in full), full
    local = [r["rank0-local-momentum-_ef"]["memory"] for r in results]
    assert local[0][0] > 0 and local[0][1] == local[0][0], local   # rank 0's own memory back
    assert all(saved > 0 and after == 0.0 for saved, after in local[1:]), local


@pytest.mark.multiprocess
def test_broadcast_optimizer_state_on_a_fresh_start_counts_no_step(launch):
    for r in launch.get(fresh_start):
        for kind in ("adam", "momentum"):
            assert r[f"{kind}-step-after-broadcast"] == 0
            assert r[f"{kind}-state-initialized"]
            assert r[f"{kind}-levels-same"] and r[f"{kind}-version"] == 1
            assert r[f"{kind}-grads-same"]
            assert not r[f"{kind}-carrier-left"]


@pytest.mark.multiprocess
def test_zero_grad_set_to_none(launch):
    for r in launch.get(zero_grad_set_to_none):
        assert r == {"true": True, "false": True, "cleared": True}


@pytest.mark.multiprocess
def test_load_state_dict_with_other_bits_changes_nothing(launch):
    for r in launch.get(load_refused_unchanged):
        assert r["error"] is not None and "bits" in r["error"], r
        assert r["unchanged"]
        assert r["step"] == 2


@pytest.mark.multiprocess
def test_horovod_signature_and_passthrough_match_horovod(launch):
    results = launch.get(horovod_signature)
    for r in results:
        for name in ("avg", "avg-f2", "sum", "fp16-f2", "fp16-class", "groups"):
            assert r[name], name                 # bitwise hvd.DistributedOptimizer's weights
            assert r[f"{name}-steps"] == 3
        trained = r["adasum-False"]
        assert isinstance(trained, dict) and trained["step"] == 3 and trained["version"] == 2
        message = r["adasum-True"]
        assert isinstance(message, str) and "Adasum" in message and "hvd.Average" in message
        assert r["adasum-fallback"]
    assert results[0]["adasum-False"]["weights"] == results[1]["adasum-False"]["weights"]


@pytest.mark.multiprocess
def test_sum_and_predivide_on_quantized_buckets(launch):
    for r in launch.get(sum_and_predivide_quantized):
        assert r["n_small"] == 2 and r["n_big"] == 2
        assert r["sum-big"] and r["f4-big"]
        assert r["small"] == {"avg": True, "sum": True, "f4": True}


@pytest.mark.multiprocess
def test_groups_map_onto_buckets_and_sparse_gradients(launch):
    for r in launch.get(groups_and_sparse):
        assert r["none"] == [["0.bias", "0.weight", "2.bias", "2.weight"]]
        assert r["n2"] == r["num_groups"] == [["0.bias", "0.weight"], ["2.bias", "2.weight"]]
        assert r["list"] == [["0.bias", "2.bias"], ["0.weight", "2.weight"]]
        assert r["num_groups_warning"] == ["DeprecationWarning"]
        for key, (err, is_sparse) in r["sparse"].items():
            assert is_sparse, key                       # handed back sparse, as Horovod does
            assert err < (1e-6 if key.startswith("none") else 0.1), (key, err)


@pytest.mark.multiprocess
def test_compressor_class_as_compression(launch):
    results = launch.get(class_compression)
    for r in results:
        # the class's default, ALQ 3-bit, in the ErrorFeedback that error_feedback="auto" adds
        assert r["ours"] == ("ErrorFeedback", 3, 2, 1)
        assert r["shared_same"] and r["shared_version"] == 1 and r["shared_step"] == 2
    assert results[0]["shared_levels"] == results[1]["shared_levels"]
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.multiprocess
def test_warnings_like_horovod_and_no_stray_std_warning(launch):
    for r in launch.get(warnings_like_horovod):
        assert r["categories"] == {"horovod": ["UserWarning"], "ours": ["UserWarning"]}
        assert r["errors"] == {"stock": None, "packed": None}


@pytest.mark.multiprocess
def test_wrapping_a_wrapped_optimizer_says_so(launch):
    for r in launch.get(wrapped_twice):
        for name in ("ours", "horovod"):
            kind, message = r[name]
            assert kind == "TypeError" and "already a DistributedOptimizer" in message, r
            assert "positional" not in message


def test_small_tensor_threshold_is_validated():
    import horovod.torch as hvd
    import torch

    import horovod_aq
    import horovod_aq.torch as aqt

    model = torch.nn.Linear(3, 2)
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="small_tensor_threshold"):
            aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     model.named_parameters(), horovod_aq.QSGD(bits=3),
                                     small_tensor_threshold=bad)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters(), horovod_aq.QSGD(bits=3),
                                 op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(TypeError, match=r"horovod_aq\.ALQ\(bits=3\)"):
        aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters(), horovod_aq.Compressor)
