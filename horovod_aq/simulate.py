"""Deprecated: moved to :mod:`horovod_aq.tools.simulate`."""
import sys
import warnings

from horovod_aq.tools import simulate as _moved

warnings.warn("horovod_aq.simulate moved to horovod_aq.tools.simulate", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
