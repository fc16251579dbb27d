"""Deprecated: moved to :mod:`horovod_aq.tools.datasets`."""
import sys
import warnings

from horovod_aq.tools import datasets as _moved

warnings.warn("horovod_aq.datasets moved to horovod_aq.tools.datasets", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
