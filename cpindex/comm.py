"""How the ranks talk outside the kernel: the :class:`Comm` protocol and its errors.

Transports use :class:`Comm` only. :class:`TorchComm` implements it over a ``torch.distributed``
group, one process per rank (gloo on CPU, NCCL on CUDA, RCCL on ROCm): the production path.
The one-process world (:mod:`cpindex.world`) implements it with W threads of one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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


def _first_line(e: BaseException) -> str:
    # torch's errors can carry a C++ stack trace after the first line
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"


def _store_failed(what: str, e: BaseException) -> CollectiveFailed:
    """A store request failed: its host (the process that created the group's store, global
    rank 0's with ``init_process_group``'s default rendezvous) is gone or unreachable."""
    return CollectiveFailed(
        what,
        "the group's key-value store is unreachable; its host (global rank 0's process, "
        f"unless a launcher hosts the store) may be gone ({_first_line(e)})",
    )


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
        except RuntimeError as e:  # torch's DistNetworkError/DistStoreError and kin
            raise _store_failed(what, e) from None
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
            if time.monotonic() - t0 < 0.9 * timeout_s:  # not a timeout: a lost connection
                raise CollectiveFailed(what, _first_line(e)) from None
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
        dist.barrier(group=self.group)
