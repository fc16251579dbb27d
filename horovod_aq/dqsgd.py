"""Deprecated: DQSGD moved to :mod:`horovod_aq.compressors.dqsgd` (``horovod_aq.DQSGD``)."""

import sys
import warnings

from horovod_aq.compressors import dqsgd as _moved

warnings.warn("horovod_aq.dqsgd moved to horovod_aq.compressors.dqsgd", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
