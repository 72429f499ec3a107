"""The one-process world: W ranks as W threads of one process, each with its own stream, sharing
one GPU (or the CPU).

Kernels of different processes on one GPU never run concurrently, so this is the supported way
to run the ``ipc`` handshake on a single GPU: peers' buffers are plain device allocations and the
kernel and handshake are exactly the multi-GPU ones. :class:`ThreadComm` is its
:class:`cpindex.comm.Comm`.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .comm import Bound, CollectiveTimeout, Comm, _bytes
from .errors import add_note

T = TypeVar("T")


class _Round:
    """One :meth:`ThreadWorld.rendezvous` round."""

    def __init__(self, world_size: int) -> None:
        self.slots: list[Any] = [None] * world_size
        self.arrived: set[int] = set()
        self.read = 0
        self.outcome: str | None = None  # "ok" or "gone"


class ThreadWorld:
    """Shared state of W in-process ranks (see :func:`run_threads`)."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._rounds = [0] * world_size
        self._abandoned: str | None = None  # why the world was aborted, if it was
        self._cond = threading.Condition()
        self._rv: dict[str, _Round] = {}
        self.counters: list[dict[str, int]] = [{"arrivals": 0} for _ in range(world_size)]

    def rendezvous(self, rank: int, key: str, obj: Any, timeout_s: float) -> list[Any]:
        """:meth:`Comm.rendezvous` for the in-process ranks. Unlike :meth:`exchange`, a round
        that runs out of time leaves the world usable (later rounds work)."""
        with self._cond:
            r = self._rv.setdefault(key, _Round(self.world_size))
            r.slots[rank] = obj
            r.arrived.add(rank)
            if len(r.arrived) == self.world_size and r.outcome is None:
                r.outcome = "ok"
                self._cond.notify_all()
            waited_out = not self._cond.wait_for(
                lambda: r.outcome is not None or self._abandoned is not None, timeout_s
            )
            if r.outcome is None:
                r.outcome = "gone"  # by timeout or by an aborted world: gone for every rank
                self._cond.notify_all()
            late = sorted(set(range(self.world_size)) - r.arrived)
            if r.outcome == "ok":
                out = list(r.slots)
                r.read += 1
                if r.read == self.world_size:
                    del self._rv[key]  # abandoned rounds stay, for the ranks still to come
                return out
        what = f"in-process rendezvous {key!r}"
        if self._abandoned is not None:
            raise CollectiveTimeout(what, late, reason=self._abandoned)
        if waited_out:
            raise CollectiveTimeout(what, late)
        raise CollectiveTimeout(
            what,
            late,
            reason="was abandoned: another rank's wait ran out before this rank came",
            abandoned=True,
        )

    def exchange(self, rank: int, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """Everyone's ``obj``; raises :class:`CollectiveTimeout` naming the ranks that had not
        arrived when the wait ran out (the world is then broken for good)."""
        self._rounds[rank] += 1
        mine = self._rounds[rank]
        self._slots[rank] = obj
        wait = timeout_s if timeout_s is not None else self.timeout_s
        try:
            self._barrier.wait(wait)
            out = list(self._slots)
            self._barrier.wait(wait)  # nobody overwrites a slot before everyone has read it
        except threading.BrokenBarrierError:
            late = [r for r in range(self.world_size) if self._rounds[r] < mine]
            raise CollectiveTimeout("in-process exchange", late, reason=self._abandoned) from None
        return out

    def abort(self, rank: int | None = None, error: BaseException | None = None) -> None:
        """Break every pending and future exchange (a rank failed: nobody waits for it)."""
        with self._cond:
            if self._abandoned is None:
                who = f"rank {rank} failed ({type(error).__name__})" if rank is not None else ""
                self._abandoned = f"abandoned: {who or 'the world was aborted'}"
            self._cond.notify_all()
        self._barrier.abort()


def _ready_event(t: torch.Tensor) -> torch.cuda.Event | None:
    if t.device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def _wait(events: Sequence[torch.cuda.Event | None]) -> None:
    for ev in events:
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


class ThreadComm:
    """:class:`Comm` for one rank of a :class:`ThreadWorld`; tensor collectives are device
    copies ordered with events, so they behave like stream-ordered NCCL calls."""

    same_process = True

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.world_size = world.world_size
        #: Set by :func:`cpindex.comm.bounded`, and not needed here: every exchange of the
        #: world is bounded by its own timeout already (a one-process world is a harness whose
        #: ranks may load kernels for longer than a call's timeout).
        self.bound: Bound | None = None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._world.exchange(self.rank, obj)

    def _exchange_tensors(
        self,
        inp: torch.Tensor,
        copy: Callable[[list[torch.Tensor]], None],
        timeout_s: float | None,
    ) -> None:
        peers = self._world.exchange(self.rank, (inp, _ready_event(inp)), timeout_s)
        _wait([ev for _, ev in peers])
        copy([t for t, _ in peers])
        # Peers may reuse their input only after every rank has copied from it.
        _wait(self._world.exchange(self.rank, _ready_event(inp), timeout_s))

    def all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        dst = _bytes_view(out).view(self.world_size, -1)

        def copy(ins: list[torch.Tensor]) -> None:
            for s, t in enumerate(ins):
                dst[s].copy_(_bytes(t))

        self._exchange_tensors(inp, copy, timeout_s)

    def all_to_all_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        dst = _bytes_view(out).view(self.world_size, -1)

        def copy(ins: list[torch.Tensor]) -> None:
            for s, t in enumerate(ins):
                dst[s].copy_(_bytes(t).view(self.world_size, -1)[self.rank])

        self._exchange_tensors(inp, copy, timeout_s)

    def barrier(self) -> None:
        self._world.exchange(self.rank, None)

    def rendezvous(self, key: str, payload: str, timeout_s: float) -> list[str]:
        return self._world.rendezvous(self.rank, key, payload, timeout_s)

    def forget(self, key: str) -> None:
        """Nothing to drop: a completed in-process round is gone once every rank read it."""

    @property
    def counters(self) -> dict[str, int]:
        return self._world.counters[self.rank]


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("out: collectives write into contiguous tensors only")
    return t.view(torch.uint8).view(-1)


def run_threads(
    world_size: int,
    fn: Callable[[Comm], T],
    *,
    device: torch.device | str | None = None,
    timeout_s: float = 120.0,
) -> list[T]:
    """Runs ``fn(comm)`` as ``world_size`` in-process ranks, each on its own stream of ``device``
    (CUDA) or on the CPU. Returns the ranks' results. If ranks fail, raises the first rank's own
    exception, with every other rank's failure attached as a note.

    On a GPU each rank gets a stream on its own hardware work queue (see :func:`rank_streams`);
    use these streams, not ones of your own, for the ranks' work. Run with
    ``CUDA_MODULE_LOADING=EAGER`` (``python -m cpindex`` sets it): a kernel loaded lazily while
    a push spins can deadlock the world (docs/design.md, rule 3); a warning says so otherwise."""
    world = ThreadWorld(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    dev = torch.device(device) if device is not None else None
    on_gpu = dev is not None and dev.type == "cuda"
    lazy = os.environ.get("CUDA_MODULE_LOADING") != "EAGER"
    if on_gpu and world_size > 1 and not torch.version.hip and lazy:  # one rank: nobody spins
        warnings.warn(
            "one-process world with lazy CUDA module loading: the first launch of any kernel "
            "while a peer's push spins can synchronize the context and deadlock. Set "
            "CUDA_MODULE_LOADING=EAGER before CUDA starts, or launch every kernel the ranks use "
            "between pushes once before the first push (docs/design.md)",
            stacklevel=2,
        )
    streams, release = rank_streams(dev, world_size) if on_gpu else ([], lambda: None)

    def body(rank: int) -> None:
        try:
            if on_gpu:
                torch.cuda.set_device(dev)
                with torch.cuda.stream(streams[rank]):
                    results[rank] = fn(ThreadComm(world, rank))
                    torch.cuda.current_stream().synchronize()
            else:
                results[rank] = fn(ThreadComm(world, rank))
        except BaseException as e:  # surfaced below, with the rank
            errors[rank] = e
            world.abort(rank, e)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"cpindex-rank{r}") for r in range(world_size)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        release()
    # A rank's own exception beats the BrokenBarrierError it caused in the others.
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return results
    own = [(r, e) for r, e in failed if not isinstance(e, CollectiveTimeout)]
    first = (own or failed)[0][1]
    for r, e in failed:
        if e is not first:
            add_note(first, f"rank {r} failed too: {type(e).__name__}: {e}")
    raise first


def rank_streams(
    device: torch.device, n: int
) -> tuple[list[torch.cuda.Stream], Callable[[], None]]:
    """``n`` streams of ``device`` on ``n`` different hardware work queues, and a function that
    destroys them.

    Streams that share a queue are not independent: a rank's push kernel spins until its peers'
    kernels of the same call run, and a peer's kernel queued behind this rank's *next* work on a
    shared queue never starts (a deadlock until the timeout). Torch's pool streams can share
    queues (its pool interleaves priorities), so the ranks get streams created back to back,
    which the driver spreads over its queues round-robin (CUDA_DEVICE_MAX_CONNECTIONS, default 8;
    ROCm: GPU_MAX_HW_QUEUES, default 4). Without the fused kernel (nothing to deadlock), pool
    streams are used.
    """
    hip = torch.version.hip is not None
    var, default = ("GPU_MAX_HW_QUEUES", 4) if hip else ("CUDA_DEVICE_MAX_CONNECTIONS", 8)
    try:
        queues = int(os.environ.get(var, default))
    except ValueError:
        raise ValueError(f"{var}={os.environ[var]!r}: expected a whole number") from None
    if n > queues:
        raise ValueError(
            f"world_size={n} ranks on one GPU need {n} hardware work queues, but {var}={queues}; "
            f"set {var}>={n} in the environment before CUDA starts"
        )
    from .kernels import KernelUnavailable, load

    try:
        mod = load(device)
    except KernelUnavailable:
        return [torch.cuda.Stream(device) for _ in range(n)], lambda: None
    handles = [mod.stream_create() for _ in range(n)]
    streams = [torch.cuda.ExternalStream(h, device=device) for h in handles]

    def release() -> None:
        for h in handles:
            mod.stream_destroy(h)

    return streams, release


def in_turn(comm: Comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on one rank at a time, in rank order, with every rank waiting at a barrier
    meanwhile (collective). In the one-process world CUDA graph capture must go this way:
    captures from several threads at once fail, and entering capture synchronizes the device."""
    result: Any = None
    for turn in range(comm.world_size):
        comm.barrier()
        if turn == comm.rank:
            result = fn()
    comm.barrier()
    return result
