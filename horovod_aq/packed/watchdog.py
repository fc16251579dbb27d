"""The stall deadline of waits that cannot poll (docs/protocol.md §15).

The PyTorch paths wait for a collective by polling its handle (:func:`~horovod_aq.packed.
waiting.wait_until`), so a wait past the stall timeout raises at once. TensorFlow's Horovod ops
block inside their kernels — in a traced step or an eager call — with nothing to poll. There a
:class:`Watchdog` keeps the deadline instead:

1. before the waits start, the framework **arms** it with what it is about to wait for (the
   collectives' names, the step, what the rank is doing), and **disarms** it when they are done;
2. a waiting that stays armed past its timeout is stalled: the watchdog's thread builds the
   :class:`~horovod_aq.packed.waiting.ExchangeStalledError` that names it, logs it (ERROR),
   keeps it (:attr:`Watchdog.stalled`) and calls ``expire(error)`` once; the framework ends its
   blocked waits there (TensorFlow shuts Horovod down on this rank, so every blocked op returns
   an error, which its eager paths turn back into the kept error).

This module imports no framework.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from horovod_aq.packed.waiting import Deadline, ExchangeStalledError

logger = logging.getLogger(__name__)


class Watchdog:
    """Deadlines of armed waits, watched by one daemon thread (started at the first arm).

    ``expire(error)`` ends this rank's blocked waits; it is called once, from the watchdog's
    thread, with the first stalled wait's error."""

    def __init__(self, expire: Callable[[ExchangeStalledError], Any]) -> None:
        self._expire = expire
        #: token → (monotonic end, deadline, collective, bucket, what)
        self._armed: dict[int, tuple[float, Deadline, str, str | None, str | None]] = {}
        self._tokens = itertools.count(1)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: The error of the wait that stalled (None: none did).
        self.stalled: ExchangeStalledError | None = None
        #: Set once ``expire`` has returned.
        self._expired = threading.Event()

    def arm(self, deadline: Deadline, collective: str, bucket: str | None = None,
            what: str | None = None) -> int:
        """Start the clock of a wait (step 1); returns the token :meth:`disarm` takes (0: the
        deadline has no timeout, nothing is watched)."""
        if deadline.timeout_s is None or self.stalled is not None:
            return 0
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = (time.monotonic() + deadline.timeout_s, deadline, collective,
                                  bucket, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="horovod_aq.watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return token

    def disarm(self, token: int) -> None:
        """The wait of ``token`` is over (step 1)."""
        if token:
            with self._cond:
                self._armed.pop(token, None)

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                due = min(self._armed.values(), key=lambda entry: entry[0], default=None)
                if due is not None and due[0] <= now:
                    break
                self._cond.wait(None if due is None else due[0] - now)
            _, deadline, collective, bucket, what = due
            self.stalled = error = deadline.stalled(collective, bucket, what)
            self._armed.clear()
        logger.error("%s", error)    # step 2
        try:
            self._expire(error)
        except Exception:   # noqa: BLE001 — the stall is what to report
            logger.exception("horovod_aq: ending the stalled waits failed")
        finally:
            self._expired.set()

    def settle(self, timeout_s: float | None = None) -> None:
        """After a stall, wait until ``expire`` has returned (at most ``timeout_s``): what ends
        the blocked waits (TensorFlow: Horovod's shutdown) must not race the caller's own next
        steps (e.g. Horovod's shutdown at exit)."""
        if self.stalled is not None:
            self._expired.wait(timeout_s)


__all__ = ["Watchdog"]
