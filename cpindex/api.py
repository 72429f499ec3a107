"""The public entry point: :class:`IndexCP` and the per-process ``init``/``get`` pair."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, TypeVar, overload

import torch
import torch.distributed as dist

from . import formats
from .config import CPIndexConfig
from .errors import CPIndexError, add_note
from .transports import Context, select
from .validation import check_call, check_topk
from .world import Comm, TorchComm

R = TypeVar("R")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        self.config = (config or CPIndexConfig()).with_world_size(comm.world_size)
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = comm
        key = (self.device.type, self.device.index)
        placements = comm.all_gather_object((key, comm.same_process))
        sharing = sum(1 for k, same in placements if k == key and same) if key[0] == "cuda" else 1
        self.heads_per_rank = self.config.heads_per_rank(comm.world_size)
        ctx = Context(self.config, comm, self.device, max(1, sharing))
        self._transport = select(ctx)
        self._busy = threading.Lock()
        self._closed = False

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
            float32 ``[heads_per_rank, rows, width]``, a view valid until the next call.
        """
        if self._closed:
            raise CPIndexError("score_push on a closed IndexCP")
        if width is None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
            width = block_table.shape[1]
        call = check_call(
            self.config, self.heads_per_rank, self.device, iq, index_cache, block_table,
            seq_lens, init_blocks, local_blocks, width, query_len,
        )  # fmt: skip
        return self._run("score_push", lambda: self._transport.score_push(call))

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
        ``-inf`` columns never, equal scores to the lower block id. Transports that can
        (``collective``) exchange only each rank's ``topk`` candidates per (head, row), so the
        exchange does not grow with ``width``; the others select from the pushed scores.

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
        if self._closed:
            raise CPIndexError("select_blocks on a closed IndexCP")
        if width is None and isinstance(block_table, torch.Tensor) and block_table.dim() == 2:
            width = block_table.shape[1]
        call = check_call(
            self.config, self.heads_per_rank, self.device, iq, index_cache, block_table,
            seq_lens, init_blocks, local_blocks, width, query_len,
        )  # fmt: skip
        k = check_topk(self.config, topk, return_scores)
        ids, scores = self._run("select_blocks", lambda: self._transport.select_blocks(call, k))
        return (ids, scores) if return_scores else ids

    def _run(self, what: str, launch: Callable[[], R]) -> R:
        """The one per-call path of every call: one caller at a time, a previous call's
        recorded failure raised first (no sync), and ``error_check="sync"``."""
        if not self._busy.acquire(blocking=False):
            raise CPIndexError(
                f"{what} called concurrently on one IndexCP; one instance serves one stream "
                "at a time (create one instance per stream or micro-batch)"
            )
        try:
            self._transport.check()
            out = launch()
            if self.config.error_check == "sync" and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
                self._transport.check()
            return out
        finally:
            self._busy.release()

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        """Bytes this rank sends its peers in one call's score (``topk=None``: ``score_push``)
        or candidate (``select_blocks``) exchange; the query exchange, the same for both, is
        not counted. ``collective``'s ``select_blocks``: ``(W-1) * heads_per_rank * rows *
        topk * 8``, whatever the width; a score exchange: ``(W-1) * heads_per_rank * rows *
        ceil(width / W) * 4``."""
        return self._transport.exchange_bytes(rows, width, topk)

    def check(self) -> None:
        """Raise an error recorded by an earlier call (timeouts, bad block tables). Reads host
        memory only: cheap, and usable after graph replays."""
        self._transport.check()

    def reset(self) -> None:
        """Collective: after an error, wait for every rank's kernels and zero the handshake
        state so the group can go on."""
        self._transport.reset()

    def close(self) -> None:
        """Collective: release buffers and peer mappings. Idempotent."""
        if not self._closed:
            self._closed = True
            self._transport.close()

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
