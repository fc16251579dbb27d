"""Deprecated: moved to :mod:`horovod_aq.tools.launcher`."""
import sys
import warnings

from horovod_aq.tools import launcher as _moved

warnings.warn("horovod_aq.launcher moved to horovod_aq.tools.launcher", DeprecationWarning,
              stacklevel=2)
if __name__ == "__main__":  # python -m horovod_aq.launcher still runs
    sys.exit(_moved._rank_main(sys.argv[1]))
sys.modules[__name__] = _moved
