"""PNG plots (matplotlib, optional): level tables over the gradient density, training curves,
normalized variance over training.

* :func:`plot_levels` — like Figure 6 of the ALQ paper: the density of bucket-normalized
  gradient coordinates r = v_i/‖v_b‖ with the level table drawn as vertical lines.
* :func:`plot_curves` — loss and accuracy per epoch for one or more runs.
* :func:`plot_steps` — loss and test accuracy against the training step for runs compared
  side by side (``horovod-aq demo``: fp32 and ALQ from the same seed).
* :func:`plot_variance` — normalized quantization variance over training per method (Figure 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: Matplotlib is imported lazily with a non-interactive backend (no display on servers).
_BACKEND = "Agg"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib "
                          "(or horovod-aq[examples])") from None
    matplotlib.use(_BACKEND, force=True)
    import matplotlib.pyplot as plt

    return plt


def normalized_coordinates(gradient: np.ndarray, bucket_size: int) -> np.ndarray:
    """r_i = v_i/‖v_b‖₂ for every coordinate of every nonzero bucket (tail bucket included)."""
    g = np.asarray(gradient, dtype=np.float64).ravel()
    nb = -(-g.size // bucket_size)
    padded = np.zeros(nb * bucket_size)
    padded[:g.size] = g
    v = padded.reshape(nb, bucket_size)
    norms = np.linalg.norm(v, axis=1)
    r = np.divide(v, norms[:, None], out=np.zeros_like(v), where=norms[:, None] > 0)
    real = (np.arange(nb * bucket_size) < g.size).reshape(nb, bucket_size)
    return r[real & (norms[:, None] > 0)]


def plot_levels(levels: np.ndarray, path: str, *, gradient: np.ndarray | None = None,
                bucket_size: int | None = None, title: str = "Level table") -> str:
    """Draw ``levels`` (vertical lines) over the histogram of the normalized gradient.

    The x axis is zoomed to where the gradient's mass and the inner levels are (the outer levels
    ±1 are marked at the edges); the y axis is the density on a log scale.
    """
    plt = _pyplot()
    levels = np.asarray(levels, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    span = max(float(np.max(np.abs(levels[1:-1]))) * 1.25 if levels.size > 2 else 1.0, 1e-3)
    if gradient is not None and bucket_size:
        r = normalized_coordinates(gradient, bucket_size)
        if r.size:
            span = max(span, float(np.quantile(np.abs(r), 0.999)))
            span = min(span, 1.0)
            bins = np.linspace(-span, span, 201)
            ax.hist(r, bins=bins, density=True, color="#9ecae1", label="normalized gradient r")
            ax.set_yscale("log")
    for i, lv in enumerate(levels):
        x = float(np.clip(lv, -span, span))
        ax.axvline(x, color="#d62728", lw=1.2, ls="-" if abs(lv) < 1 else ":",
                   label="levels" if i == 0 else None)
    ax.set_xlim(-span * 1.02, span * 1.02)
    ax.set_xlabel("normalized coordinate r = v_i / ||v_bucket||  (dotted: levels ±1 off-scale)")
    ax.set_ylabel("density (log scale)")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(runs: Mapping[str, Sequence[Mapping[str, float]]], path: str, *,
                title: str = "Training") -> str:
    """Loss (train and test) and test accuracy per epoch; ``runs`` maps a label to its epochs."""
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, hist in runs.items():
        epochs = [h["epoch"] for h in hist]
        ax_loss.plot(epochs, [h["train_loss"] for h in hist], marker="o", label=f"{label} train")
        ax_loss.plot(epochs, [h["test_loss"] for h in hist], marker="s", ls="--",
                     label=f"{label} test")
        ax_acc.plot(epochs, [100 * h["test_acc"] for h in hist], marker="o", label=label)
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy loss")
    ax_loss.legend()
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("test accuracy (%)")
    ax_acc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (shorter at the start), same length."""
    c = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_steps(runs: Mapping[str, Sequence[Mapping[str, object]]], path: str, *,
               title: str = "Training", smooth: int = 20) -> str:
    """Left: training loss per step (thin) and its ``smooth``-step moving average (thick), test
    loss at the end of each epoch (markers); right: test accuracy at the end of each epoch.
    ``runs`` maps a label to its epochs as the examples record them: ``step`` (the global step
    at the epoch's end), ``step_loss`` (that epoch's per-step losses), ``test_loss``,
    ``test_acc``. Epochs without ``step_loss`` are drawn from ``train_loss`` at ``step``."""
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, hist) in enumerate(runs.items()):
        color = colors[k % len(colors)]
        ends = [int(h["step"]) for h in hist]
        per_step = [float(v) for h in hist for v in h.get("step_loss", ())]
        if per_step and len(per_step) == ends[-1]:
            loss = np.asarray(per_step)
            steps = np.arange(1, loss.size + 1)
            ax_loss.plot(steps, loss, color=color, lw=0.6, alpha=0.35)
            ax_loss.plot(steps, _moving_average(loss, smooth), color=color, lw=1.8,
                         label=f"{label} train ({smooth}-step mean)")
        else:
            ax_loss.plot(ends, [h["train_loss"] for h in hist], color=color, marker="o",
                         label=f"{label} train")
        ax_loss.plot(ends, [h["test_loss"] for h in hist], color=color, marker="s", ls="--",
                     label=f"{label} test")
        ax_acc.plot(ends, [100 * float(h["test_acc"]) for h in hist], color=color, marker="o",
                    label=label)
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("cross-entropy loss")
    ax_loss.set_yscale("log")
    ax_loss.legend(fontsize="small")
    ax_acc.set_xlabel("training step")
    ax_acc.set_ylabel("test accuracy (%)")
    ax_acc.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_variance(series: Mapping[str, tuple[Sequence[int], Sequence[float]]], path: str, *,
                  title: str = "Normalized variance over training") -> str:
    """``series`` maps a method to (steps, E‖Q(g)−g‖²/‖g‖²); log y axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (steps, values) in series.items():
        ax.plot(list(steps), list(values), marker=".", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("normalized variance  E||Q(g)-g||^2 / ||g||^2")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
