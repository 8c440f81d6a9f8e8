"""Run a function on N local processes joined in a process group, without ``torchrun``.

Used by the multi-process tests and ``bench/dcp_bench.py``: one process per rank (one per GPU
with NCCL), rendezvous over TCP on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from ckptzip.errors import DeviceUnavailableError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` new processes, each a member of a
    default process group of ``backend`` (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``).

    With NCCL, rank r uses GPU r. ``fn`` and ``args`` must be picklable (module-level function).
    An exception in any rank is raised here once all ranks have stopped.
    """
    if "nccl" in backend and torch.cuda.device_count() < world_size:
        raise DeviceUnavailableError(
            f"backend {backend!r} with {world_size} ranks needs {world_size} GPUs (one per rank), "
            f"found {torch.cuda.device_count()}; use fewer ranks or the gloo backend"
        )
    port = free_port()
    spawn(_run_rank, args=(world_size, port, backend, fn, args), nprocs=world_size, join=True)


def _run_rank(
    rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    else:
        # Ranks share the host's cores; without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # no rank tears its group down while another still talks to it (rank 0 also serves the
        # TCP store): a rank that left first made the other abort now and then in CI ("terminate
        # called without an active exception", SIGABRT), twice in about ten runs
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # done, the group torn down: leave without the interpreter's teardown, in which a C++ thread
    # torch left running aborted a rank now and then even after the barrier ("terminate called
    # without an active exception", SIGABRT, in one clean-clone CI run of about six); a rank that
    # raised left above, through spawn's error report
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
