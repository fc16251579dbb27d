"""Deprecated: level-table agreement moved to :mod:`horovod_aq.refit`, the handshake to
:mod:`horovod_aq.packed.protocol`."""

import warnings

from horovod_aq.packed.protocol import (  # noqa: F401
    ConfigMismatchError,
    check_handshake,
    handshake_vector,
)
from horovod_aq.refit import *  # noqa: F401,F403
from horovod_aq.refit import _mpi_comms  # noqa: F401

warnings.warn("horovod_aq.sync moved to horovod_aq.refit (and horovod_aq.packed.protocol)",
              DeprecationWarning, stacklevel=2)
