"""Deprecated: moved to :mod:`horovod_aq.tools.plots`."""
import sys
import warnings

from horovod_aq.tools import plots as _moved

warnings.warn("horovod_aq.plots moved to horovod_aq.tools.plots", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
