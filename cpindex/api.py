"""The public entry point: :class:`IndexCP` and the per-process ``init``/``get`` pair."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

from . import formats, lockstep
from .comm import Comm, TorchComm
from .config import CPIndexConfig
from .errors import (
    BadBlockTableError,
    BrokenInstanceError,
    ConfigMismatchError,
    CPIndexError,
    OutOfStepError,
    PeerConnectionError,
    PeerTimeoutError,
    add_note,
)
from .transports import Context, candidates, select
from .validation import Call, check_call, check_topk

R = TypeVar("R")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """This rank's device: a CPU or an existing CUDA/HIP device (``meta`` and friends have no
    memory to exchange)."""
    try:
        dev = torch.device(device) if device is not None else _default_device()
    except RuntimeError as e:
        raise ValueError(f"device: {e}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected a cpu or cuda device, got {dev}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {dev} requested, but no CUDA/HIP device is visible")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {dev} does not exist ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", index)


def _agree_construction(
    config: CPIndexConfig, comm: Comm, device: torch.device | str | None
) -> tuple[CPIndexConfig, torch.device, list[Any], int]:
    """Collective, bounded by ``config.timeout_s``, and before anything else is exchanged:
    every rank's shared fields, transport candidates, placement and local preparation error.
    Raises on every rank if any rank failed or any shared field differs. Returns the bound
    config, the device, every rank's placement and the instance number on this group."""
    bound, dev, error = config, None, None
    try:
        bound = config.with_world_size(comm.world_size)
        dev = _resolve_device(device)
    except ValueError as e:  # pydantic's ValidationError is one
        error = e
    mine = {
        "shared": bound.shared_values(),
        "candidates": candidates(bound),
        "placement": None if dev is None else [dev.type, dev.index, comm.same_process],
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    n = lockstep.next_round(comm, "new")
    reports = lockstep.exchange(
        comm, f"new/{n}", mine, config.timeout_s, what="IndexCP construction"
    )
    comm.forget(f"new/{n - 1}")
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if error is not None:
        others = [f"rank {r}: {why}" for r, why in failed if r != comm.rank]
        if others:
            add_note(error, "other ranks failed too: " + "; ".join(others))
        raise error
    if failed:
        raise CPIndexError(
            f"rank {comm.rank}: IndexCP construction failed on "
            + "; ".join(f"rank {r}: {why}" for r, why in failed)
        )
    diffs = []
    for field, value in mine["shared"].items():
        values = [rep["shared"].get(field) for rep in reports]
        if any(v != value for v in values):
            diffs.append(f"{field}: " + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))
    if not diffs and any(rep["candidates"] != mine["candidates"] for rep in reports):
        diffs.append(
            "transports tried: "
            + ", ".join(f"rank {r}: {rep['candidates']}" for r, rep in enumerate(reports))
        )
    if diffs:
        local = ", ".join(sorted(CPIndexConfig.LOCAL_FIELDS))
        raise ConfigMismatchError(
            f"rank {comm.rank}: the ranks built IndexCP from different configurations: "
            + "; ".join(diffs)
            + f". Every field but {local} must be equal on every rank."
        )
    assert dev is not None
    return bound, dev, [rep["placement"] for rep in reports], n


class IndexCP:
    """Context-parallel block scoring over the ranks of a group.

    Construction is collective (every rank of the group, same config): the ranks agree on one
    transport (``config.transport``; ``"auto"`` picks the fastest all ranks can run), allocate
    and exchange buffers, and self-test. After that, every rank makes the same sequence of
    calls (:meth:`select_blocks`, the block ids sparse attention reads, or :meth:`score_push`,
    the scores), on one stream at a time (a second stream or micro-batch needs its own
    instance).

    Args:
        config: the configuration (default ``CPIndexConfig()``); ``world_size`` is bound to the
            group's size.
        group: a ``torch.distributed`` process group (default: the world group).
        device: this rank's device (default: the current CUDA device, else CPU).
        comm: instead of ``group``, an explicit :class:`cpindex.world.Comm` (the one-process
            world of :func:`cpindex.world.run_threads` passes its ``ThreadComm`` here).
    """

    def __init__(
        self,
        config: CPIndexConfig | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        *,
        comm: Comm | None = None,
    ) -> None:
        if config is not None and not isinstance(config, CPIndexConfig):
            raise TypeError(f"config: expected CPIndexConfig, got {type(config).__name__}")
        if comm is None:
            comm = TorchComm(group)
        elif group is not None:
            raise ValueError("group: pass either group or comm, not both")
        self.comm = comm
        # Agree first: a rank with another config must not reach the probes' collectives.
        self.config, self.device, placements, self._instance = _agree_construction(
            config or CPIndexConfig(), comm, device
        )
        key = [self.device.type, self.device.index, True]
        sharing = sum(1 for p in placements if p == key) if key[0] == "cuda" else 1
        self.heads_per_rank = self.config.heads_per_rank(comm.world_size)
        self._digest = self.config.digest()
        ctx = Context(self.config, comm, self.device, max(1, sharing))
        self._transport = select(ctx)
        self._busy = threading.Lock()
        self._closed = False
        self._calls = 0  # calls on this instance since construction or the last reset
        self._resets = 0  # reset rounds entered (every rank counts alike)
        self._broken: BaseException | None = None  # why calls are refused until reset()
        self._left_mid_call: str | None = None  # a host-lockstep call abandoned after its header

    # ---- properties -----------------------------------------------------------------------
    @property
    def transport_name(self) -> str:
        """The transport in use (what ``"auto"`` resolved to)."""
        return self._transport.name

    @property
    def capturable(self) -> bool:
        """Whether ``score_push`` and ``select_blocks`` may be captured in a CUDA/HIP graph
        with this transport."""
        return self.device.type == "cuda" and self._transport.capturable

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    # ---- the call ---------------------------------------------------------------------------
    def score_push(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int = 0,
        local_blocks: int = 1,
        width: int | None = None,
        *,
        query_len: int = 1,
    ) -> torch.Tensor:
        """This rank's heads' block scores over every block of every row.

        Args:
            iq: ``[rows, heads_per_rank, 128]`` (or ``[rows, 128]``) query rows of this rank's
                heads, ``rows = requests * query_len``, request-major (token t of request r is
                row ``r * query_len + t``); ``float8_e4m3fn`` for fp8/nvfp4 caches,
                ``bfloat16`` for bf16.
            index_cache: the paged index-key cache in ``config.cache_format``: bf16 or fp8
                ``[pages, 128, 128]``, nvfp4 ``uint8 [pages, 9216]`` or the public pair
                ``(packed uint8 [pages, 128, 64], scales e4m3 [pages, 128, 8])``.
            block_table: int32 ``[requests, max_blocks]``, rows contiguous.
            seq_lens: int32 ``[requests]``, causal lengths through each request's last query
                token (so ``>= query_len``); token t sees ``seq_lens[r] - query_len + 1 + t``.
            init_blocks, local_blocks: forced-selection counts (MiniMax-M3: 0 and 1).
            width: score columns, ``ceil(max(seq_lens)/128) <= width <= max_width``; default
                ``block_table.shape[1]`` (capture-stable).
            query_len: query tokens per request (speculative/MTP decode), at most
                ``config.max_query_len``. The kernel reads each request's pages once for all
                its rows.

        Returns:
            float32 ``[heads_per_rank, rows, width]``: a view of the instance's receive
            buffer, overwritten by the next call. Keep it with ``.clone()``::

                a = cp.score_push(...)          # call 1's scores
                b = cp.score_push(...)          # a shows call 2's scores now (a is b's memory;
                                                # with another rows/width, a is scrambled)
                a = cp.score_push(...).clone()  # a copy: stays call 3's scores

            Work that reads the view must run on the instance's stream (or be ordered before
            the next call).

        Raises:
            TypeError, ValueError: bad input, naming the argument. With peers, the call still
                counts and the instance refuses calls until :meth:`reset` (the peers raise too).
            OutOfStepError, PeerTimeoutError, PeerConnectionError: the ranks are not making
                the same call, a peer did not come within ``timeout_s``, or a peer is gone.
            BrokenInstanceError: an earlier call failed on this rank; :meth:`reset` first.
        """
        if width is None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
            width = block_table.shape[1]

        def validate() -> tuple[Call, dict[str, Any]]:
            call = check_call(
                self.config, self.heads_per_rank, self.device, iq, index_cache, block_table,
                seq_lens, init_blocks, local_blocks, width, query_len,
            )  # fmt: skip
            return call, {}

        return self._run("score_push", validate, lambda call, _: self._transport.score_push(call))

    @overload
    def select_blocks(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int = 0,
        local_blocks: int = 1,
        width: int | None = None,
        *,
        query_len: int = 1,
        topk: int = 16,
        return_scores: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def select_blocks(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int = 0,
        local_blocks: int = 1,
        width: int | None = None,
        *,
        query_len: int = 1,
        topk: int = 16,
        return_scores: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def select_blocks(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int = 0,
        local_blocks: int = 1,
        width: int | None = None,
        *,
        query_len: int = 1,
        topk: int = 16,
        return_scores: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' ``topk`` best blocks per row: what sparse attention reads
        (docs/contract.md §6). Same inputs as :meth:`score_push`.

        Per (head, row): the ``topk`` columns with the highest scores, forced blocks included,
        ``-inf`` columns never, equal scores to the lower block id. Ranks exchange only their
        ``topk`` candidates per (head, row), so the exchange does not grow with ``width``:
        ``collective`` through torch.distributed, ``ipc`` and ``mori`` inside the one fused
        launch (up to ``topk`` 16; a larger ``topk`` pushes the scores and selects from them).

        Args:
            iq, index_cache, block_table, seq_lens, init_blocks, local_blocks, width,
                query_len: as in :meth:`score_push`.
            topk: blocks per (head, row), at most ``config.max_topk`` (MiniMax-M3: 16).
            return_scores: also return each selected block's score.

        Returns:
            int32 ``[heads_per_rank, rows, topk]``: block ids in ascending order, then ``-1``
            for each slot a row with fewer than ``topk`` blocks in its context leaves. With
            ``return_scores``, also float32 ``[heads_per_rank, rows, topk]``, aligned with the
            ids (``-inf`` where padded). Views valid until the next call.
        """
        if width is None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
            width = block_table.shape[1]

        def validate() -> tuple[Call, dict[str, Any]]:
            call = check_call(
                self.config, self.heads_per_rank, self.device, iq, index_cache, block_table,
                seq_lens, init_blocks, local_blocks, width, query_len,
            )  # fmt: skip
            return call, {"topk": check_topk(self.config, topk, return_scores)}

        ids, scores = self._run(
            "select_blocks",
            validate,
            lambda call, extra: self._transport.select_blocks(call, extra["topk"]),
        )
        return (ids, scores) if return_scores else ids

    def _run(
        self,
        what: str,
        validate: Callable[[], tuple[Call, dict[str, Any]]],
        launch: Callable[[Call, dict[str, Any]], R],
    ) -> R:
        """The one per-call path of every call (docs/design.md, "Ranks in step"): one caller
        at a time; refused while broken; a previous call's recorded failure raised first (no
        sync); the input validated; on ``host_lockstep`` transports the call's header agreed
        with every rank before anything is exchanged; ``error_check="sync"``. Any failure
        once peers may be waiting marks the instance broken until :meth:`reset`.

        ``validate`` returns the call and the operation's own arguments (they join the
        header); ``launch`` runs it."""
        if self._closed:
            raise CPIndexError(f"{what} on a closed IndexCP")
        if not self._busy.acquire(blocking=False):
            raise CPIndexError(
                f"{what} called concurrently on one IndexCP; one instance serves one stream "
                "at a time (create one instance per stream or micro-batch)"
            )
        try:
            if self._broken is not None:
                e = self._broken
                raise BrokenInstanceError(
                    f"rank {self.rank}: {what} refused: this IndexCP failed earlier "
                    f"({type(e).__name__}: {e}). Ranks may be out of step; call reset() on "
                    "every rank to go on."
                ) from e
            refused_alone = False  # bad input with no peer waiting: the instance stays usable
            try:
                self._transport.check()  # a previous call's recorded failure, no sync
                self._calls += 1
                try:
                    call, extra = validate()
                except (TypeError, ValueError) as e:
                    refused_alone = self.world_size == 1
                    if not refused_alone:
                        self._refuse(what, e)
                    raise
                if self._transport.host_lockstep:
                    header = lockstep.call_header(
                        what, self._instance, self._calls, call, self._digest, extra
                    )
                    lockstep.agree_call(
                        self.comm, header, self.config.timeout_s,
                        what=f"call {self._calls} ({what})",
                    )  # fmt: skip
                try:
                    out = launch(call, extra)
                except BaseException as e:
                    if self._transport.host_lockstep and not isinstance(e, _PEER_ERRORS):
                        # The header passed, so peers may wait in this call's collectives.
                        self._left_mid_call = (
                            f"rank {self.rank} left call {self._calls} after its header round "
                            f"({type(e).__name__}: {e})"
                        )
                    raise
                if self.config.error_check == "sync" and self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                    self._transport.check()
                return out
            except BaseException as e:
                if self._broken is None and not refused_alone:
                    self._broken = e
                raise
        finally:
            self._busy.release()

    def _refuse(self, what: str, error: BaseException) -> None:
        """Tell the peers that this rank refused its call (host-lockstep transports), so they
        raise at once instead of waiting out ``timeout_s``. Other transports' peers time out
        in the kernel and report this rank as late."""
        self._broken = error
        if not self._transport.host_lockstep:
            return
        header = lockstep.refusal_header(what, self._instance, self._calls, error)
        try:
            lockstep.agree_call(
                self.comm, header, self.config.timeout_s, what=f"call {self._calls} ({what})"
            )
        except CPIndexError as e:
            add_note(error, f"telling the other ranks failed too: {type(e).__name__}: {e}")

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        """Bytes this rank sends its peers in one call's score (``topk=None``: ``score_push``)
        or candidate (``select_blocks``) exchange; the query exchange, the same for both, is
        not counted. ``collective``'s ``select_blocks``: ``(W-1) * heads_per_rank * rows *
        topk * 8``, whatever the width; a score exchange: ``(W-1) * heads_per_rank * rows *
        ceil(width / W) * 4``."""
        return self._transport.exchange_bytes(rows, width, topk)

    def check(self) -> None:
        """Raise an error recorded by an earlier call (timeouts, bad block tables). Reads host
        memory only: cheap, and usable after graph replays. Marks the instance broken too."""
        try:
            self._transport.check()
        except BaseException as e:
            if self._broken is None:
                self._broken = e
            raise

    def reset(self) -> None:
        """Collective, bounded by ``timeout_s``: bring every rank back in step after a failure.

        Every rank meets in a round first (a rank that does not come within ``timeout_s``
        makes the others raise :class:`PeerTimeoutError` naming it, and the instance stays
        broken: call ``reset()`` again on every rank). Then the transport waits for this
        rank's kernels and clears its error words and handshake state, the call count goes
        back to 0 on every rank, and calls are accepted again. A reset on a healthy instance
        is harmless.

        Raises :class:`PeerConnectionError` when a peer or the group's store is gone, and
        :class:`CPIndexError` when a collective was left half done (a rank stopped inside a
        call after its peers started exchanging data): the process group must be rebuilt."""
        if self._closed:
            raise CPIndexError("reset on a closed IndexCP")
        if not self._busy.acquire(blocking=False):
            raise CPIndexError("reset called while a call runs on this IndexCP")
        try:
            self._resets += 1
            mine = {
                "round": self.comm.counters.get("call", 0),
                "unrecoverable": self._transport.unrecoverable or self._left_mid_call,
            }
            try:
                reports = lockstep.exchange(
                    self.comm, f"reset/{self._instance}/{self._resets}", mine,
                    self.config.timeout_s, what=f"reset {self._resets}",
                )  # fmt: skip
                stuck = [(r, rep["unrecoverable"]) for r, rep in enumerate(reports)]
                stuck = [(r, why) for r, why in stuck if why]
                if stuck:
                    raise CPIndexError(
                        f"rank {self.rank}: reset: the group cannot be reused: "
                        + "; ".join(f"rank {r}: {why}" for r, why in stuck)
                        + ". Its process group may hold a half-done collective: close this "
                        "instance and rebuild the group."
                    )
                self._transport.reset()
            except BaseException as e:
                self._broken = self._broken or e
                raise
            # Every rank made the same number of header rounds except around the failure:
            # continue from the furthest, so no rank reuses a round another has entered.
            self.comm.counters["call"] = max(rep["round"] for rep in reports)
            self._calls = 0
            self._broken = None
        finally:
            self._busy.release()

    def close(self) -> None:
        """Collective, bounded by ``timeout_s``: release buffers and peer mappings. Idempotent.

        ``ipc`` and ``mori`` ranks meet before freeing memory their peers write into. A rank
        that does not come within ``timeout_s`` makes the others raise
        :class:`PeerTimeoutError` naming it; they keep that memory then (a late peer may still
        write into it) until the process ends."""
        if not self._closed:
            self._closed = True
            self._transport.close(
                meet=lambda: lockstep.meet(
                    self.comm, f"close/{self._instance}", self.config.timeout_s, what="close"
                )
            )

    def __enter__(self) -> IndexCP:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:  # leaving on an error: close, but never hide that error behind close's own
            self.close()
        except Exception as e:
            add_note(exc, f"closing afterwards failed too: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return (
            f"IndexCP(transport={self.transport_name!r}, rank={self.rank}/{self.world_size}, "
            f"device={self.device}, format={self.config.cache_format!r})"
        )


# What a transport raises about its peers: the call ended for every rank alike.
_PEER_ERRORS = (OutOfStepError, PeerTimeoutError, PeerConnectionError, BadBlockTableError)

_instance: IndexCP | None = None


def init(
    config: CPIndexConfig | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> IndexCP:
    """Create this process's shared instance (collective). Serving stacks call it once after
    their process groups exist; :func:`get` returns it afterwards."""
    global _instance
    if _instance is not None:
        raise CPIndexError("cpindex.init called twice; use cpindex.get() or shutdown() first")
    _instance = IndexCP(config, group, device)
    return _instance


def get() -> IndexCP:
    """The instance created by :func:`init`."""
    if _instance is None:
        raise CPIndexError("cpindex.get() before cpindex.init()")
    return _instance


def shutdown() -> None:
    """Close and forget the shared instance (collective)."""
    global _instance
    if _instance is not None:
        _instance.close()
        _instance = None
