"""Who the ranks are and how they talk outside the kernel.

Transports use the :class:`Comm` protocol only. Two implementations:

* :class:`TorchComm`: a ``torch.distributed`` group, one process per rank (gloo on CPU, NCCL on
  CUDA, RCCL on ROCm). The production path.
* :class:`ThreadComm`: W ranks as W threads of one process, each with its own stream, sharing one
  GPU (or the CPU). Kernels of different processes on one GPU never run concurrently, so this is
  the supported way to run the ``ipc`` handshake on a single GPU: peers' buffers are plain device
  allocations and the kernel and handshake are exactly the multi-GPU ones.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from .errors import add_note

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only that one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveTimeout(RuntimeError):
    """A collective or rendezvous did not complete in time; ``late`` lists the ranks that had
    not arrived (empty when the backend cannot tell)."""

    def __init__(
        self, what: str, late: list[int], *, reason: str | None = None, abandoned: bool = False
    ) -> None:
        late_s = ", ".join(map(str, late)) if late else "unknown"
        super().__init__(f"{what} {reason or f'timed out; late ranks: {late_s}'}")
        #: ``abandoned``: this rank did not wait out its timeout; others had given up already.
        self.what, self.late, self.abandoned = what, late, abandoned


class CollectiveFailed(RuntimeError):
    """A collective or rendezvous failed before its timeout: the backend lost a connection
    (a peer's process died) or the store is unreachable. ``detail`` is the backend's error."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what} failed: {detail}")
        self.what, self.detail = what, detail


class Comm(Protocol):
    """The host-side collectives cpindex needs. Every rank calls them in the same order.

    Tensor collectives take ``timeout_s``: past it they raise :class:`CollectiveTimeout`
    naming the late ranks where the implementation can tell (in-process world; gloo).
    """

    rank: int
    world_size: int
    same_process: bool  # peers' device pointers are valid here as they are

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        """``out`` (``world_size * inp.numel()`` elements, contiguous) gets every rank's ``inp``."""

    def all_to_all_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        """Equal split along dim 0: ``out[s]`` gets rank ``s``'s ``inp[self.rank]``."""

    def barrier(self) -> None: ...

    def rendezvous(self, key: str, payload: str, timeout_s: float) -> list[str]:
        """Every rank's ``payload`` for the round named ``key`` (each rank names it alike),
        bounded by ``timeout_s``. A round has one outcome for all ranks: it completes for every
        rank or for none. A rank whose wait runs out abandons it; every rank that was or will
        be in it then raises :class:`CollectiveTimeout` naming the ranks that had not come, so
        no rank goes on to a collective its peers will never post. Connection failures raise
        :class:`CollectiveFailed`."""
        ...

    def forget(self, key: str) -> None:
        """Release this rank's part of a completed round (once every rank is past it)."""

    @property
    def counters(self) -> dict[str, int]:
        """Round numbers shared by every instance on this group in this process (rounds are
        named by them, so every rank must count alike)."""
        ...


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Backends disagree on fp8/bf16 support; bytes always travel.
    return t.contiguous().view(torch.uint8).view(-1)


#: Per process group (by name): round counters and tensor-collective arrivals, shared by every
#: TorchComm on the group, so two instances on one group count alike and name late ranks.
_GROUP_STATE: dict[str, dict[str, int]] = {}


class TorchComm:
    """:class:`Comm` over a ``torch.distributed`` process group (default: the world group).

    Bounded waits: with gloo (CPU tensors) each tensor collective is waited on with the
    timeout, and every rank counts its arrivals in the group's store so a timeout names the
    ranks that never came. With NCCL/RCCL the collective is enqueued on the stream and the
    host does not wait; a missing peer is caught by the backend's watchdog (the process
    group's ``timeout``), which the caller sets when creating the group.

    :meth:`rendezvous` runs through the group's key-value store (``torch.distributed``'s
    default store, under a per-group prefix) on every backend: a handful of small requests to
    the store per round, host only, no collective posted. Without a reachable store object it
    falls back to an unbounded ``all_gather_object``.
    """

    same_process = False

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "group: torch.distributed is not initialized (init_process_group first)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        name = getattr(self.group, "group_name", "world")
        self._state = _GROUP_STATE.setdefault(name, {"arrivals": 0})
        self._store = None
        try:  # private but long-standing; without it waits are unbounded and name no ranks
            base = dist.distributed_c10d._get_default_store()
            self._store = dist.PrefixStore(f"cpindex/{name}/", base)
        except Exception:
            self._store = None

    @property
    def counters(self) -> dict[str, int]:
        return self._state

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def rendezvous(self, key: str, payload: str, timeout_s: float) -> list[str]:
        st = self._store
        if st is None:
            return self.all_gather_object(payload)
        k, w = f"rv/{key}", self.world_size
        what = f"rendezvous {key!r}"
        try:
            st.set(f"{k}/{self.rank}", payload)
            waited_out = False
            if st.add(f"{k}/n", 1) < w:
                try:
                    st.wait([f"{k}/o"], timedelta(seconds=timeout_s))
                except dist.DistStoreError:
                    waited_out = True  # or the store is gone: compare_set below tells
            # The first rank to decide fixes the outcome for all: the last to arrive says "ok",
            # a rank whose wait ran out first says "gone" (and arrivals after it see "gone").
            # A rank woken by the outcome just reads it back (compare_set keeps a set value).
            outcome = st.compare_set(f"{k}/o", "", "gone" if waited_out else "ok")
            if outcome == b"ok":
                values = st.multi_get([f"{k}/{r}" for r in range(w)])
                return [v.decode() for v in values]
            late = [r for r in range(w) if not st.check([f"{k}/{r}"])]
        except dist.DistError as e:
            raise CollectiveFailed(what, f"{type(e).__name__}: {e}") from None
        if waited_out:
            raise CollectiveTimeout(what, late)
        raise CollectiveTimeout(
            what,
            late,
            reason="was abandoned: another rank's wait ran out before this rank came",
            abandoned=True,
        )

    def forget(self, key: str) -> None:
        """Drop this rank's part of a finished round from the store (rank 0 also drops the
        round's counter and outcome). Safe once every rank has entered a later round."""
        st = self._store
        if st is None:
            return
        k = f"rv/{key}"
        try:
            st.delete_key(f"{k}/{self.rank}")
            if self.rank == 0:
                st.delete_key(f"{k}/n")
                st.delete_key(f"{k}/o")
        except dist.DistError:
            pass  # a failing store shows up in the next round, with its error

    def _bounded(self, what: str, start: Callable[[], Any], timeout_s: float | None) -> None:
        if timeout_s is None or self.backend != "gloo":
            start()
            return
        self._state["arrivals"] += 1
        mine = self._state["arrivals"]
        if self._store is not None:
            self._store.add(f"arrivals/{self.rank}", 1)
        work = start()
        t0 = time.monotonic()
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if time.monotonic() - t0 < 0.9 * timeout_s:  # not a timeout: a lost connection
                raise CollectiveFailed(what, str(e)) from None
            late = []
            if self._store is not None:
                counts = [self._store.add(f"arrivals/{r}", 0) for r in range(self.world_size)]
                late = [r for r, c in enumerate(counts) if c < mine]
            raise CollectiveTimeout(what, late) from None

    def all_gather_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        bounded = timeout_s is not None and self.backend == "gloo"
        self._bounded(
            "all-gather",
            lambda: _all_gather_single(
                _bytes(out), _bytes(inp), group=self.group, async_op=bounded
            ),
            timeout_s,
        )

    def all_to_all_into(
        self, out: torch.Tensor, inp: torch.Tensor, timeout_s: float | None = None
    ) -> None:
        bounded = timeout_s is not None and self.backend == "gloo"
        self._bounded(
            "all-to-all",
            lambda: dist.all_to_all_single(
                _bytes(out), _bytes(inp), group=self.group, async_op=bounded
            ),
            timeout_s,
        )

    def barrier(self) -> None:
        dist.barrier(group=self.group)


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
    if on_gpu and not torch.version.hip and os.environ.get("CUDA_MODULE_LOADING") != "EAGER":
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
