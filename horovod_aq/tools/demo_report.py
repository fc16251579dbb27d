"""What ``horovod-aq demo`` prints, from numbers alone (no runs, no files): the headline (the
paired accuracy gap to fp32 with its standard error, "within noise" under :data:`NOISE_SE`
standard errors, and the byte ratio) and the speed line, measured on an emulated cluster
(:func:`cluster_speed`, :func:`format_speed_measured`) or modelled from the bytes per step
(:func:`format_speed_model`). :mod:`horovod_aq.tools.demo` runs the demo."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: The headline calls a gap real from this many standard errors of the paired difference on;
#: under it, "within noise".
NOISE_SE = 2.0
#: Link rates (Mbit/s) of the model shown where no cluster can be timed.
MODEL_RATES_MBIT = (100.0, 1000.0)


def paired_gap(diffs: Sequence[float]) -> tuple[float, float | None]:
    """The mean of per-seed differences (points) and its standard error, sample std / √n
    (None for one seed: one difference has no spread)."""
    mean = float(np.mean(diffs))
    if len(diffs) < 2:
        return mean, None
    return mean, float(np.std(diffs, ddof=1) / np.sqrt(len(diffs)))


def gap_phrase(mean: float, se: float | None, *, label: str, base: str = "fp32") -> str:
    """What the gap says: "within noise" when it is under :data:`NOISE_SE` standard errors
    (or exactly zero), else its size and side; with one seed, that one seed cannot tell."""
    where = "above" if mean > 0 else "below"
    if se is None:
        return (f"{label} is {abs(mean):.1f} pt {where} {base} in test accuracy on one seed, "
                "which cannot tell a gap from seed noise (--seeds 0,1,2 gives a standard error)")
    if mean == 0 or abs(mean) < NOISE_SE * se:
        return f"{label} matches {base} within noise in test accuracy: {mean:+.2f} ± {se:.2f} pt"
    return (f"{label} is {abs(mean):.2f} ± {se:.2f} pt {where} {base} in test accuracy, "
            "beyond noise")


def format_headline(*, label: str, base: str, acc_base: Sequence[float],
                    acc_comp: Sequence[float], seeds: Sequence[int], sent_base: float,
                    sent_comp: float, steps: int, bits: float) -> str:
    """The demo's closing line: the paired accuracy gap with its standard error (accuracies in
    percent, one per seed, paired by seed) and the gradient bytes both runs sent (rank 0)."""
    mean, se = paired_gap([c - b for b, c in zip(acc_base, acc_comp)])
    seed_text = ", ".join(map(str, seeds))
    spread = ("" if se is None else
              f"mean ± standard error of the paired difference over seeds {seed_text}, each pair "
              f"from the same initial weights and sample order; within noise = under "
              f"{NOISE_SE:g} standard errors; ")
    mib = 2.0 ** 20
    return (f"demo done: {gap_phrase(mean, se, label=label, base=base)} ({spread}{base} "
            f"{np.mean(acc_base):.2f}%, {label} {np.mean(acc_comp):.2f}%); {label} sent "
            f"{sent_base / sent_comp:.1f}x fewer gradient bytes than {base} "
            f"({sent_comp / mib:.2f} vs {sent_base / mib:.2f} MiB over {steps} steps, rank 0 "
            f"telemetry; {bits:.2f} bits per coordinate)")


def _rate_text(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def cluster_speed(result: dict) -> dict:
    """The speed line's numbers from ``benchmarks/cluster.py --json``'s results: the cluster
    (hosts, Mbit/s), the model's parameters, and per mode of
    :data:`horovod_aq.tools.demo.CLUSTER_MODES` the median step (s) and the bytes out of each
    host per step, over the timed steps."""
    res = result["results"][0]
    s = res["summary"]
    return {"hosts": res["hosts"], "rate": res["rate"], "params": res["params"],
            "steps": s["defaults"]["steps"],
            "fp32_s": s["hvd_fp32"]["median"], "aq_s": s["defaults"]["median"],
            "fp32_bytes": s["hvd_fp32"]["tx_mean"], "aq_bytes": s["defaults"]["tx_mean"]}


def format_speed_measured(speed: dict) -> str:
    """The speed line from a timed emulated cluster (:func:`cluster_speed`)."""
    return (f"speed, measured: a training step on an emulated cluster of {speed['hosts']} hosts "
            f"linked at {_rate_text(speed['rate'])} (network namespaces shaped with tc, "
            f"horovodrun over Gloo; an MLP of {speed['params'] / 1e6:.2f}M parameters, "
            f"benchmarks/cluster.py) took {speed['aq_s']:.3f} s with horovod_aq.ALQ(bits=3) and "
            f"every other default against {speed['fp32_s']:.3f} s with Horovod's fp32 "
            f"allreduce: {speed['fp32_s'] / speed['aq_s']:.1f}x faster (medians of "
            f"{speed['steps']} steps each; {speed['aq_bytes'] / 1e6:.2f} vs "
            f"{speed['fp32_bytes'] / 1e6:.2f} MB out of each host per step)")


def format_speed_model(*, label: str, base: str, bytes_comp: float, bytes_base: float,
                       reason: str, rates: Sequence[float] = MODEL_RATES_MBIT) -> str:
    """The speed line where no cluster was timed: the bytes one rank sent per step (measured)
    and what they take on links of ``rates`` Mbit/s by bytes ÷ bandwidth (a model)."""
    from horovod_aq.packed.cost import transfer_seconds

    links = ", ".join(
        f"{1e3 * transfer_seconds(bytes_comp, r):.2f} vs "
        f"{1e3 * transfer_seconds(bytes_base, r):.2f} ms on {_rate_text(r)}" for r in rates)
    return (f"speed, modelled (not measured: {reason}): each rank sent {bytes_comp / 1e3:.1f} kB "
            f"of gradients per step with {label} against {bytes_base / 1e3:.1f} kB with {base} "
            f"(measured, rank 0 telemetry); bytes ÷ bandwidth puts the transfer at {links} per "
            f"step, {bytes_base / bytes_comp:.1f}x shorter (a model: latency, compute and their "
            "overlap left out; horovod_aq.packed.cost.transfer_seconds)")
