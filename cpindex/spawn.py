"""Processes joined in one ``torch.distributed`` group on this machine, for the CLI and tests."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """An unused TCP port on the loopback interface, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_entry(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:  # CPU ranks share the cores: without this, W processes oversubscribe them W times
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn_processes(
    world_size: int,
    fn: Callable[..., None],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float | None = None,
) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one
    ``torch.distributed`` group (loopback rendezvous). ``fn`` must be importable (top level).

    With ``timeout_s``, processes still running after that many seconds are killed and
    ``TimeoutError`` is raised (a test that would hang fails instead)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _process_entry,
        args=(world_size, free_port(), backend, fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ctx.join(timeout=None if deadline is None else 0.2):
        if deadline is not None and time.monotonic() > deadline:
            alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(
                f"spawn_processes: rank(s) {alive} still running after {timeout_s} s; killed"
            )
