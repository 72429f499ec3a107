"""Processes joined in one ``torch.distributed`` group on this machine, for the CLI and tests.

:func:`spawn_processes` starts W fresh processes, waits for them, and turns their failures into
one :class:`RanksFailed` in the parent: each failed rank sends its error back over a pipe (no
files are written), and the error that explains the run (a rank's own, not a peer's reaction
to it) comes first.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import CPIndexError, add_note

#: After the first rank fails, how long the others may take to report their own errors before
#: they are stopped (a peer blocked in a collective would otherwise wait for its timeout).
GRACE_S = 1.0

#: Errors that are a rank's reaction to a peer's failure rather than a cause of their own.
_REACTIONS = (
    "PeerTimeoutError",
    "PeerConnectionError",
    "BrokenInstanceError",
    "CollectiveTimeout",
    "CollectiveFailed",
    "DistError",
    "DistNetworkError",
    "DistBackendError",
    "DistStoreError",
)


@dataclass(frozen=True)
class RankFailure:
    """What one spawned rank reported (plain strings: any exception crosses the pipe)."""

    rank: int
    type_name: str
    message: str
    traceback: str
    #: Bad input or a refusal (``ValueError``, ``TypeError``, ``cpindex.CPIndexError``), which a
    #: one-line message explains, as opposed to a bug, which needs its traceback.
    expected: bool
    at: float  # when it was raised (``time.time()``; ranks share the machine's clock)

    def line(self) -> str:
        first = self.message.strip().splitlines()
        return f"rank {self.rank}: {self.type_name}: {first[0] if first else ''}".rstrip()


class RanksFailed(RuntimeError):
    """Spawned ranks failed. ``failures`` lists every report, the one that explains the run
    first (``primary``); the message is its first line, the traceback is attached as a note."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        self.primary = failures[0]
        super().__init__(self.primary.line())
        if self.primary.traceback:
            add_note(self, f"rank {self.primary.rank}'s traceback:\n{self.primary.traceback}")
        if len(failures) > 1:
            add_note(self, "other ranks failed too: " + "; ".join(f.line() for f in failures[1:]))


def free_port() -> int:
    """An unused TCP port on the loopback interface, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(rank: int, e: BaseException) -> RankFailure:
    names = {c.__name__ for c in type(e).__mro__}
    expected = isinstance(e, (ValueError, TypeError, CPIndexError)) and not names & set(_REACTIONS)
    return RankFailure(
        rank, type(e).__name__, str(e), traceback.format_exc(), expected, time.time()
    )


def _process_entry(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, conn
) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:  # CPU ranks share the cores: without this, W processes oversubscribe them W times
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        failure = _report(rank, e)
    except BaseException as e:
        failure = _report(rank, e)
    else:
        dist.destroy_process_group()
        return
    # Reported before the group goes down (the peers' lost-connection errors come later), and
    # no traceback on stderr: the parent decides what to print.
    conn.send(failure)
    conn.close()
    os._exit(1)


def _exit_failure(rank: int, code: int) -> RankFailure:
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return RankFailure(rank, "ProcessExit", f"the process {how}", "", False, time.time())


def _primary_first(failures: list[RankFailure]) -> list[RankFailure]:
    """The failure that explains the run first: a refusal of bad input before a bug, a bug
    before a reaction to a peer's failure (a lost connection, a timeout) or a bare exit; the
    earliest first within each kind."""

    def kind(f: RankFailure) -> int:
        if f.type_name in _REACTIONS or f.type_name == "ProcessExit":
            return 2
        return 0 if f.expected else 1

    return sorted(failures, key=lambda f: (kind(f), f.at))


def spawn_processes(
    world_size: int,
    fn: Callable[..., None],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float | None = None,
) -> None:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one
    ``torch.distributed`` group (loopback rendezvous). ``fn`` must be importable (top level).

    A rank that raises (or exits non-zero) fails the run: the others get :data:`GRACE_S` to
    report their own errors, then are stopped, and :class:`RanksFailed` is raised. With
    ``timeout_s``, processes still running after that many seconds are killed and
    ``TimeoutError`` is raised (a test that would hang fails instead). A rank that ends its
    process itself with exit status 0 (``os._exit(0)``) counts as done."""
    import multiprocessing.connection as mpc

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_process_entry,
            args=(rank, world_size, port, backend, fn, args, send),
            name=f"cpindex-rank{rank}",
            daemon=False,  # a rank may start processes of its own (the kernel build)
        )
        p.start()
        send.close()  # the child holds the only sending end: EOF once it is gone
        procs.append(p)
        conns.append(recv)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failures: list[RankFailure] = []
    reported: set[int] = set()
    give_up_at: float | None = None  # the grace period's end, once a rank has failed
    try:
        running = dict(enumerate(procs))
        open_conns = dict(enumerate(conns))
        while running:
            now = time.monotonic()
            if give_up_at is not None and now > give_up_at:
                break
            if deadline is not None and now > deadline:
                alive = sorted(running)
                raise TimeoutError(
                    f"spawn_processes: rank(s) {alive} still running after {timeout_s} s; killed"
                )
            waits = [*open_conns.values(), *(p.sentinel for p in running.values())]
            ends = [t for t in (give_up_at, deadline) if t is not None]
            mpc.wait(waits, timeout=max(0.0, min(ends) - now) if ends else None)
            for rank, c in list(open_conns.items()):
                if c.poll():
                    try:
                        failures.append(c.recv())
                        reported.add(rank)
                    except EOFError:
                        del open_conns[rank]
            for rank, p in list(running.items()):
                if p.exitcode is None:
                    continue
                del running[rank]
                c = open_conns.pop(rank, None)
                while c is not None and c.poll():  # a report sent just before the exit
                    try:
                        failures.append(c.recv())
                        reported.add(rank)
                    except EOFError:
                        break
                if p.exitcode != 0 and rank not in reported:
                    failures.append(_exit_failure(rank, p.exitcode))
            if failures and give_up_at is None:
                give_up_at = time.monotonic() + GRACE_S
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
    if failures:
        raise RanksFailed(_primary_first(failures))
