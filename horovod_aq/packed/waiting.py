"""Waiting for a collective without spinning on a core, and with a deadline (docs/protocol.md
§15), for every transport: Horovod handles, mpi4py requests, ``torch.distributed`` works.

Horovod 0.28.1's ``synchronize`` (``WaitAndClear`` in ``horovod/torch/mpi_ops_v2.cc``) loops on
``std::this_thread::yield()`` until the collective finishes, so a rank waiting for a slow network
keeps a core busy; where ranks share cores (several ranks per CPU host) that time is taken from
the ranks still encoding or decoding. :func:`wait_until` polls ``done()`` with a sleep that
doubles from ``POLL_MIN_S`` up to ``POLL_MAX_S`` (at most ~1 ms of added latency). After the
stall timeout it raises :class:`ExchangeStalledError` naming the
collective: Horovod's stall inspector only warns, and a rank in another collective would
otherwise hang every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Default seconds a packed exchange waits for one collective before raising
#: :class:`ExchangeStalledError` (generous: a slow first step compiles kernels and connects).
DEFAULT_STALL_TIMEOUT_S = 300.0
#: Environment override of the stall timeout (seconds; 0 or less: wait forever).
STALL_TIMEOUT_ENV = "HOROVOD_AQ_STALL_TIMEOUT_S"


def stall_timeout_s(value: Any = None) -> float | None:
    """The stall timeout in seconds: ``value`` if given, else ``$HOROVOD_AQ_STALL_TIMEOUT_S``,
    else :data:`DEFAULT_STALL_TIMEOUT_S`; None (wait forever) for 0 or less."""
    if value is None:
        text = os.environ.get(STALL_TIMEOUT_ENV, "").strip()
        try:
            value = float(text) if text else DEFAULT_STALL_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{STALL_TIMEOUT_ENV} must be a number of seconds, got "
                             f"{text!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"stall_timeout_s must be a number of seconds or None, got {value!r}")
    value = float(value)
    if value != value:
        raise ValueError("stall_timeout_s must not be NaN")
    return value if value > 0 else None


def stalled_message(collective: str, *, bucket: str | None, step: int | None, doing: str,
                    timeout_s: float) -> str:
    """The message of :class:`ExchangeStalledError` (``step`` None: not named)."""
    where = f" of bucket {bucket}" if bucket else ""
    when = "" if step is None else f" at step {step}"
    return (f"horovod_aq: collective '{collective}'{where} did not complete within "
            f"{timeout_s:g} s{when} while this rank was {doing}. The other ranks are "
            "presumably in a different collective (they ran a different number of steps or "
            "backward passes, stepped another optimizer, skipped a step, called hvd.join(), "
            "or stopped). Every rank must run the same steps on the same optimizers; raise "
            f"stall_timeout_s (or ${STALL_TIMEOUT_ENV}) if the exchange is only slow")


class ExchangeStalledError(RuntimeError):
    """A collective of the packed exchange did not complete within the stall timeout.

    Attributes: ``collective`` (its name), ``bucket``, ``step``, ``doing`` (what this rank was
    doing), ``timeout_s``. Horovod's stall inspector only warns; the packed exchange ends the
    wait on every rank that is stuck, so a mismatched rank ends the job instead of hanging.
    """

    def __init__(self, collective: str, *, bucket: str | None, step: int | None, doing: str,
                 timeout_s: float) -> None:
        self.collective, self.bucket, self.step = collective, bucket, step
        self.doing, self.timeout_s = doing, timeout_s
        super().__init__(stalled_message(collective, bucket=bucket, step=step, doing=doing,
                                         timeout_s=timeout_s))


#: Poll interval bounds (seconds) while waiting for a collective.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3

#: What a rank is doing in a collective, by the start of its name (docs/protocol.md §6), for
#: :class:`ExchangeStalledError`.
DOING = (("aq.handshake", "comparing settings with the other ranks at the first exchange"),
         ("aq.stats.", "gathering refit statistics"),
         ("aq.lv.", "receiving the refitted level table"),
         ("aq.efstate.", "gathering error-feedback memory for a checkpoint"),
         ("aq.trainable.", "agreeing with the other ranks on which parameters train"))
EXCHANGING = "waiting for the gradient exchange"


def doing(collective: str) -> str:
    """What a rank waiting in ``collective`` is doing, in words."""
    for prefix, words in DOING:
        if collective.startswith(prefix):
            return words
    return EXCHANGING


@dataclass(frozen=True)
class Deadline:
    """How long one wait may last and what a stalled wait reports.

    ``timeout_s``: seconds (None: wait forever; :func:`stall_timeout_s` resolves the
    setting); ``step``: the step to name in the error (a callable: read when it is raised)."""

    timeout_s: float | None
    step: Callable[[], int | None] = lambda: None

    def stalled(self, collective: str, bucket: str | None = None,
                what: str | None = None) -> ExchangeStalledError:
        return ExchangeStalledError(collective, bucket=bucket, step=self.step(),
                                    doing=what or doing(collective), timeout_s=self.timeout_s)


#: Wait forever (transports used without a stall setting).
FOREVER = Deadline(None)


def wait_until(done: Callable[[], bool], deadline: Deadline, collective: str,
               bucket: str | None = None, what: str | None = None) -> None:
    """Return once ``done()`` is true, polling with doubling sleeps; past
    ``deadline.timeout_s`` raise :class:`ExchangeStalledError` for ``collective``."""
    delay = POLL_MIN_S
    end = None if deadline.timeout_s is None else time.monotonic() + deadline.timeout_s
    while not done():
        if end is not None and time.monotonic() > end:
            raise deadline.stalled(collective, bucket, what)
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


__all__ = ["DEFAULT_STALL_TIMEOUT_S", "DOING", "Deadline", "ExchangeStalledError", "FOREVER",
           "POLL_MAX_S", "POLL_MIN_S", "STALL_TIMEOUT_ENV", "doing", "stall_timeout_s",
           "stalled_message", "wait_until"]
