"""The stall deadline of the TensorFlow exchange (docs/protocol.md §15, docs/keras.md).

Horovod's TensorFlow ops block inside their kernels until the collective completes, in a traced
step as in an eager call, so there is no handle to poll as on PyTorch. One
:class:`~horovod_aq.packed.watchdog.Watchdog` per process keeps the deadline instead:

* the packed exchange graph arms it with the step's collectives before its first one (the
  agreement on what trains) and disarms it after its step end (which holds the refit's
  collectives), through two host ops (:func:`arm_in_graph`, :func:`disarm_in_graph`); the eager
  transport of refits, handshakes and checkpoints arms it around each collective
  (:func:`armed`);
* when a wait stays armed past ``stall_timeout_s`` (default ``$HOROVOD_AQ_STALL_TIMEOUT_S``,
  else 300 s), the watchdog logs the :class:`~horovod_aq.packed.waiting.ExchangeStalledError`
  naming the collectives, the step and what the rank was doing, and shuts Horovod down on this
  rank: every blocked op returns Horovod's "shut down" error, and the ranks it was waiting with
  fail too instead of hanging. The eager paths (the eager tape, the eager transport) raise the
  ExchangeStalledError itself (:func:`translate`); inside a ``tf.function`` or Keras ``fit``
  the step raises TensorFlow's error with Horovod's message, after the logged one.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator, Sequence

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.packed.waiting import EXCHANGING, Deadline, ExchangeStalledError, stall_timeout_s
from horovod_aq.packed.watchdog import Watchdog

#: How many collective names an armed wait lists before "…".
SHOWN = 3
#: How long a rank that raises after a stall, or exits, waits for the watchdog's shutdown of
#: Horovod to finish (two threads must not shut Horovod down at once).
SETTLE_S = 60.0

_watchdog: Watchdog | None = None


def _shut_down(error: ExchangeStalledError) -> None:
    hvd.shutdown()


def watchdog() -> Watchdog:
    """This process's watchdog (created at first use)."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(_shut_down)
        # before Horovod's own shutdown at exit (atexit runs the later registration first)
        atexit.register(_watchdog.settle, SETTLE_S)
    return _watchdog


def default_deadline() -> Deadline:
    """The eager transport's deadline: ``$HOROVOD_AQ_STALL_TIMEOUT_S``, else 300 s."""
    return Deadline(stall_timeout_s())


def listed(collectives: Sequence[str]) -> str:
    """The names of what a wait waits for, in one string."""
    shown = ", ".join(collectives[:SHOWN])
    return shown + (f" and {len(collectives) - SHOWN} more" if len(collectives) > SHOWN else "")


def arm_in_graph(deadline: Deadline, collectives: Sequence[str]) -> tf.Tensor:
    """A host op that arms the watchdog for ``collectives`` when the graph runs; its int64
    token goes to :func:`disarm_in_graph`."""
    names = listed(collectives)

    def arm() -> np.int64:
        return np.int64(watchdog().arm(deadline, names, what=EXCHANGING))
    return tf.reshape(tf.numpy_function(arm, [], tf.int64, stateful=True, name="aq_arm"), [])


def disarm_in_graph(token: tf.Tensor) -> tf.Tensor:
    """The host op that disarms the watchdog armed by :func:`arm_in_graph`."""
    def disarm(value: np.int64) -> np.bool_:
        watchdog().disarm(int(value))
        return np.bool_(True)
    return tf.numpy_function(disarm, [token], tf.bool, stateful=True, name="aq_disarm")


@contextlib.contextmanager
def armed(deadline: Deadline, collective: str) -> Iterator[None]:
    """Watch one eager collective; a Horovod error after a stall becomes the
    ExchangeStalledError (:func:`translate`)."""
    token = watchdog().arm(deadline, collective)
    try:
        yield
    except tf.errors.OpError as err:
        raise translate(err) from err
    finally:
        watchdog().disarm(token)


def translate(err: Exception) -> Exception:
    """The ExchangeStalledError when the watchdog stalled (``err`` then is Horovod's error after
    the shutdown), else ``err``."""
    stalled = watchdog().stalled
    if stalled is None:
        return err
    watchdog().settle(SETTLE_S)
    return stalled


__all__ = ["SETTLE_S", "SHOWN", "armed", "arm_in_graph", "default_deadline", "disarm_in_graph",
           "listed", "translate", "watchdog"]
