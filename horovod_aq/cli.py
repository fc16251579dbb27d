"""Deprecated: moved to :mod:`horovod_aq.tools.cli`."""
import sys
import warnings

from horovod_aq.tools import cli as _moved

warnings.warn("horovod_aq.cli moved to horovod_aq.tools.cli", DeprecationWarning,
              stacklevel=2)
if __name__ == "__main__":  # python -m horovod_aq.cli still runs
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
