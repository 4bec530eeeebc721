"""One spawned rank's process group, ended without running gloo's teardown."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


@contextlib.contextmanager
def rank_process_group(backend: str, **init_kwargs: Any) -> Iterator[None]:
    """Run a rank's body in a process group; when every rank is done, end the process.

    Why the process ends here: with gloo on torch 2.13 a rank now and then aborted in the
    group's teardown ("terminate called without an active exception", SIGABRT), both inside
    ``destroy_process_group`` and when the interpreter finalised without it: gloo's threads
    still hold work objects whose tensors need the GIL (pytorch/pytorch#179291,
    pytorch/gloo#155). The CI run of the full suite lost a two-rank test to it, and here it
    took 1 to 6 of every 15 to 25 two-rank runs for a while. So after a barrier (no rank is
    still in a collective) the process leaves with ``os._exit`` and the OS closes the sockets.

    Use it only in a process that exists to be one rank (an ``mp.spawn`` or ``torchrun``
    worker), with all results written and telemetry flushed inside the block. An exception
    propagates untouched, so the spawner reports it.
    """
    dist.init_process_group(backend, **init_kwargs)
    yield
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
