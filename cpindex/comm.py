"""How the ranks talk outside the kernel: the :class:`Comm` protocol and its errors.

Transports use :class:`Comm` only. :class:`TorchComm` implements it over a ``torch.distributed``
group, one process per rank (gloo on CPU, NCCL on CUDA, RCCL on ROCm): the production path.
The one-process world (:mod:`cpindex.world`) implements it with W threads of one process.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

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
    (a peer's process died) or the store is unreachable. ``detail`` is the backend's error;
    ``dead`` the ranks whose processes are known to be gone (empty when none is known)."""

    def __init__(self, what: str, detail: str, dead: list[int] | None = None) -> None:
        super().__init__(f"{what} failed: {detail}")
        self.what, self.detail, self.dead = what, detail, list(dead or [])


class PeerAborted(CollectiveFailed):
    """A rendezvous left because rank ``rank`` gave up the work it belongs to (its construction
    failed there) and said so with :func:`abort`: ``reason`` is its error."""

    def __init__(self, what: str, rank: int, reason: str) -> None:
        super().__init__(what, f"rank {rank} failed: {reason}")
        self.rank, self.reason = rank, reason


#: The round scopes :func:`abort` closes: those only construction uses (never a call's, which
#: another instance of the group may be about to take).
ABORT_SCOPES = ("objects", "gate")


@dataclass(frozen=True)
class Bound:
    """The deadline of a comm's untimed rounds (``all_gather_object``, ``barrier``) while
    :func:`bounded` holds."""

    timeout_s: float


@contextlib.contextmanager
def bounded(comm: Any, timeout_s: float) -> Iterator[None]:
    """While inside: ``comm``'s ``all_gather_object`` and ``barrier`` are rendezvous rounds
    bounded by ``timeout_s`` (a late or dead rank raises :class:`CollectiveTimeout` or
    :class:`CollectiveFailed`, never a hang). A comm without a ``bound`` attribute (a caller's
    own) is used as it is."""
    if not hasattr(comm, "bound"):
        yield
        return
    saved = comm.bound
    comm.bound = Bound(timeout_s)
    try:
        yield
    finally:
        comm.bound = saved


def abort(comm: Any, reason: str) -> None:
    """Tell the peers that this rank gave up the construction under way: the next round of
    each of :data:`ABORT_SCOPES`, where a peer may wait for this rank, ends for every rank in
    :class:`PeerAborted` naming it (best effort: a store that is gone cannot carry it, and
    the peers then time out)."""
    fn = getattr(comm, "abort", None)
    if fn is not None:
        with contextlib.suppress(Exception):
            fn(reason)


def process_id() -> list[Any]:
    """What identifies this process on its machine: host name, PID namespace and PID."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return [socket.gethostname(), ns, os.getpid()]


def process_gone(ident: list[Any] | None) -> bool:
    """Whether the process :func:`process_id` named is known to be gone (it exited or was
    killed; a zombie counts). False where this process cannot tell (another machine)."""
    if not ident or list(ident[:2]) != process_id()[:2]:
        return False
    pid = int(ident[2])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


class Comm(Protocol):
    """The host-side collectives cpindex needs. Every rank calls them in the same order.

    Tensor collectives take ``timeout_s``: past it they raise :class:`CollectiveTimeout`
    naming the late ranks where the implementation can tell (in-process world; gloo).
    """

    rank: int
    world_size: int
    same_process: bool  # peers' device pointers are valid here as they are
    #: Set by :func:`bounded` (optional: a comm without it keeps its own waits).
    bound: Bound | None

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


def _first_line(e: BaseException) -> str:
    # torch's errors can carry a C++ stack trace after the first line
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def _store_failed(what: str, e: BaseException, dead: list[int] | None = None) -> CollectiveFailed:
    """A store request failed: its host (the process that created the group's store, global
    rank 0's with ``init_process_group``'s default rendezvous) is gone or unreachable."""
    return CollectiveFailed(
        what,
        "the group's key-value store is unreachable; its host (global rank 0's process, "
        f"unless a launcher hosts the store) may be gone ({_first_line(e)})",
        dead,
    )


#: Per process group (the group object: a group rebuilt under the same name starts afresh):
#: round counters and tensor-collective arrivals, shared by every TorchComm on the group, so two
#: instances on one group count alike and name late ranks.
_GROUP_STATE: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
#: Per process group: why its backend may hold a half-done collective (one that failed or timed
#: out on this rank), after which no collective may be posted on it again.
_GROUP_BROKEN: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
#: How long a failed collective waits for a peer's death to show before naming no one.
DEATH_GRACE_S = 0.5


def _payload(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _unpayload(text: str) -> Any:
    # The same trust as torch's all_gather_object, which pickles too: the group's own ranks.
    return pickle.loads(base64.b64decode(text))


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
    falls back to an unbounded ``all_gather_object``. Under :func:`bounded` (construction,
    reset) ``all_gather_object`` and ``barrier`` are such rounds too, so no wait there is
    unbounded and none posts a collective; a rank whose process is gone is named
    (:attr:`processes`, :meth:`dead_ranks`), and a group whose collective failed or timed out
    is marked (:attr:`half_done`): gloo would abort the process on its next collective.
    """

    same_process = False
    bound: Bound | None = None
    #: Every rank's :func:`process_id` (set once construction has exchanged them), to name a
    #: peer whose process is gone.
    processes: list[Any] | None = None

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
        self._state = _GROUP_STATE.setdefault(self.group, {"arrivals": 0})
        self._store = None
        try:  # private but long-standing; without it waits are unbounded and name no ranks
            base = dist.distributed_c10d._get_default_store()
            self._store = dist.PrefixStore(f"cpindex/{name}/", base)
        except Exception:
            self._store = None

    @property
    def counters(self) -> dict[str, int]:
        return self._state

    @property
    def half_done(self) -> str | None:
        """Why this group may hold a half-done collective on this rank (no collective may be
        posted on it again: gloo aborts the process), or None."""
        return _GROUP_BROKEN.get(self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        bound = self.bound
        if bound is not None and self._store is not None:  # a store round, bounded
            n = self.counters["objects"] = self.counters.get("objects", 0) + 1
            texts = self.rendezvous(f"objects/{n}", _payload(obj), bound.timeout_s)
            self.forget(f"objects/{n - 1}")  # every rank is past the previous round
            return [_unpayload(t) for t in texts]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def abort(self, reason: str) -> None:
        """See :func:`abort`. Peers can be at most one round ahead of this rank (a round ends
        only once every rank came), so they wait in this rank's next round of a scope, if
        anywhere: its outcome is set to the abort, and the scope moves past it on this rank
        (the next construction's agreement moves every rank past it)."""
        st = self._store
        if st is None:
            return
        for scope in ABORT_SCOPES:
            n = self.counters[scope] = self.counters.get(scope, 0) + 1
            st.compare_set(f"rv/{scope}/{n}/o", "", f"abort:{self.rank}:{reason}")

    def dead_ranks(self, ranks: list[int] | None = None, grace_s: float = 0.0) -> list[int]:
        """The ranks (of ``ranks``, default all) whose processes are known to be gone, waiting
        up to ``grace_s`` for a death to show (a closed connection comes before the exit)."""
        procs = self.processes
        if not procs:
            return []
        ranks = [r for r in (range(self.world_size) if ranks is None else ranks) if r != self.rank]
        end = time.monotonic() + grace_s
        while True:
            dead = [r for r in ranks if r < len(procs) and process_gone(procs[r])]
            if dead or time.monotonic() >= end:
                return dead
            time.sleep(0.02)

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
            if outcome.startswith(b"abort:"):  # a rank gave up the work (abort())
                rank, _, reason = outcome.decode()[len("abort:") :].partition(":")
                raise PeerAborted(what, int(rank), reason)
            late = [r for r in range(w) if not st.check([f"{k}/{r}"])]
        except CollectiveFailed:
            raise
        except RuntimeError as e:  # torch's DistNetworkError/DistStoreError and kin
            raise _store_failed(what, e, self.dead_ranks(grace_s=DEATH_GRACE_S)) from None
        dead = self.dead_ranks(late)
        if dead:  # not late: gone
            who = ", ".join(map(str, dead))
            raise CollectiveFailed(what, f"the process of rank {who} is gone", dead)
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
        except RuntimeError:
            pass  # a failing store shows up in the next round, with its error

    def _bounded(self, what: str, start: Callable[[], Any], timeout_s: float | None) -> None:
        if timeout_s is None or self.backend != "gloo":
            start()
            return
        self._state["arrivals"] += 1
        mine = self._state["arrivals"]
        st = self._store
        if st is not None:
            try:
                st.add(f"arrivals/{self.rank}", 1)
            except RuntimeError as e:
                raise _store_failed(what, e) from None
        work = start()
        t0 = time.monotonic()
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            # Failed or waited out, the collective may be half done in the backend for good.
            _GROUP_BROKEN.setdefault(self.group, f"its {what} failed ({_first_line(e)})")
            if time.monotonic() - t0 < 0.9 * timeout_s:  # not a timeout: a lost connection
                dead = self.dead_ranks(grace_s=DEATH_GRACE_S)
                raise CollectiveFailed(what, _first_line(e), dead) from None
            late = []
            if st is not None:
                try:
                    counts = [st.add(f"arrivals/{r}", 0) for r in range(self.world_size)]
                except RuntimeError as e2:
                    raise _store_failed(what, e2) from None
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
        if self.bound is not None and self._store is not None:
            self.all_gather_object(None)
            return
        dist.barrier(group=self.group)
