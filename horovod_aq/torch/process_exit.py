"""Leaving a ``torch.distributed`` Gloo process without PyTorch's shutdown abort.

PyTorch's Gloo backend (checked with torch 2.13) keeps its worker threads after
``destroy_process_group``. A worker thread that drops the last reference to a finished
collective while the interpreter is finalizing must take the GIL to release the Python objects
the work captured; at that point CPython ends the thread by unwinding it through a ``noexcept``
destructor, and the process aborts: ``terminate called without an active exception``, SIGABRT,
exit code 134. It happens with plain DDP and no communication hook at all: 4 of 60 two-process
launches, none of 60 ending with :func:`destroy_and_exit` (benchmarks/gloo_exit.py), docs/ddp.md
§6.
Leaving through ``os._exit`` skips interpreter finalization, so no thread can race it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def destroy_and_exit(code: int = 0) -> NoReturn:
    """Destroy the default process group (if any), flush, and end the process with ``code``.

    The last call of a rank's program: ``atexit`` handlers and interpreter finalization do not
    run (files you wrote and closed are on disk; open ones are not flushed), so write results
    and close files before. ``torchrun`` and ``torch.multiprocessing.spawn`` see ``code`` as
    the exit status.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # a closed or broken stream: nothing left to flush
            pass
    os._exit(code)


__all__ = ["destroy_and_exit"]
