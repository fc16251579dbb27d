"""Deprecated: the cost model moved to :mod:`horovod_aq.packed.cost`, the bucket plan to
:mod:`horovod_aq.packed.plan`."""

import warnings

from horovod_aq.codec import HEADER_SIZE as HEADER_BYTES  # noqa: F401
from horovod_aq.packed.cost import *  # noqa: F401,F403
from horovod_aq.packed.cost import payload_bytes  # noqa: F401
from horovod_aq.packed.plan import (  # noqa: F401
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    layout_digest,
    plan_buckets,
)

warnings.warn("horovod_aq.exchange moved to horovod_aq.packed.cost / horovod_aq.packed.plan",
              DeprecationWarning, stacklevel=2)
