"""A drop-in for the ``IndexCP`` of vLLM's MiniMax-M3 ROCm indexer CP path (``ops/index_cp``).

A serving stack that calls that module swaps one import and changes nothing else::

    # from vllm.models.minimax_m3.amd.ops.index_cp import IndexCP
    from cpindex.vllm import IndexCP

    cp = IndexCP(rank, group, device, max_rows, max_width)   # collective, once, outside capture
    scores = cp.score_push(iq, index_cache, block_table, seq_lens,
                           init_blocks, local_blocks, width)  # [1, rows, width] float32

Its arguments keep that module's positions and meanings: heads = world size and rank ``r``
owns head ``r``; ``iq`` holds this rank's head; ``rows = requests * T`` with ``T`` read off
``rows / block_table.shape[0]``. Everything else (transport, cache format, timeouts, ...) comes
from ``CPINDEX_*`` environment variables through :meth:`cpindex.CPIndexConfig.from_env`. The
work is done by one wrapped :class:`cpindex.IndexCP` (``.cp``), which validates each call.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch.distributed as dist

from . import api, formats
from .config import CPIndexConfig
from .errors import CPIndexError

__all__ = ["IndexCP", "get", "init", "shutdown"]


def _rank_of(group: dist.ProcessGroup | None, comm: Any) -> int:
    """This process's rank in the group the instance will run on."""
    if comm is not None:
        if group is not None:
            raise ValueError("group: pass either group or comm, not both")
        return int(comm.rank)
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (init_process_group first)")
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return r


class IndexCP:
    """Context-parallel index scoring with the seed's constructor and call signatures.

    Construction is collective (every rank of the group, in the same order, outside CUDA graph
    capture): the ranks agree on a configuration and a transport and allocate their buffers.

    Args:
        rank: this process's rank in ``group``; it must equal ``dist.get_rank(group)``. Rank
            ``r`` receives head ``r``'s scores.
        group: the ``torch.distributed`` process group (``None``: the world group). Its size is
            the number of index heads.
        device: this rank's device (``torch.device``, ``"cuda:0"``, a CUDA ordinal, or
            ``"cpu"``).
        max_rows: most query rows (``requests * T``) of one call.
        max_width: most score columns (blocks) of one call.
        comm: instead of ``group``, a cpindex ``Comm``: the one-process world of
            :func:`cpindex.world.run_threads` passes its per-thread ``ThreadComm`` this way.

    The configuration is ``CPIndexConfig.from_env(num_heads=W, max_rows=max_rows,
    max_width=max_width)``: those three come from here whatever the environment says, every
    other field from its ``CPINDEX_*`` variable or its default.

    Raises:
        ValueError: ``rank`` is not this process's rank in the group (checked before anything
            is exchanged), or the configuration is invalid (pydantic's ``ValidationError``).
        CPIndexError: construction failed on another rank, or the ranks' configurations differ.
    """

    def __init__(
        self,
        rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device | str | int | None,
        max_rows: int,
        max_width: int,
        *,
        comm: Any = None,
    ) -> None:
        if isinstance(rank, bool) or not hasattr(rank, "__index__"):
            raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
        rank = operator.index(rank)
        actual = _rank_of(group, comm)
        if rank != actual:
            raise ValueError(
                f"rank: got {rank}, but this process is rank {actual} of the group; pass the "
                "rank within the group the instance runs on (heads follow group ranks)"
            )
        world = int(comm.world_size) if comm is not None else dist.get_world_size(group)
        config = CPIndexConfig.from_env(num_heads=world, max_rows=max_rows, max_width=max_width)
        #: The wrapped instance: reset(), check(), exchange_bytes() and the rest live there.
        self.cp = api.IndexCP(config, group, device, comm=comm)
        self._warned_grid = False

    # ---- properties -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.cp.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group, which is also the number of index heads."""
        return self.cp.world_size

    @property
    def config(self) -> CPIndexConfig:
        return self.cp.config

    @property
    def device(self) -> torch.device:
        return self.cp.device

    @property
    def transport_name(self) -> str:
        return self.cp.transport_name

    @property
    def capturable(self) -> bool:
        """Whether calls may be captured in a CUDA/HIP graph (GPU and a capturable transport)."""
        return self.cp.capturable

    # ---- the calls ------------------------------------------------------------------------
    def score_push(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int,
        local_blocks: int,
        width: int,
        grid: int = 0,
        *,
        tag: int | None = None,
    ) -> torch.Tensor:
        """This rank's head's score for every block of every row.

        Args:
            iq: this rank's head's query rows, ``[rows, 128]`` or ``[rows, 1, 128]``,
                contiguous; ``float8_e4m3fn`` for fp8 and nvfp4 caches, ``bfloat16`` for bf16.
                ``rows = requests * T``, request-major (token t of request r is row
                ``r * T + t``), ``T = rows / block_table.shape[0]`` (at most
                ``config.max_query_len``).
            index_cache: the paged cache in ``config.cache_format`` (``CPINDEX_CACHE_FORMAT``,
                default nvfp4), passed as it is: vLLM's nvfp4 ``uint8 [pages, 128, 72]``, the
                pair ``(cache[..., :64], cache[..., 64:])`` of a token-interleaved one, or
                bf16/fp8 ``[pages, 128, 128]`` (docs/formats.md).
            block_table: int32 ``[requests, max_blocks]``, rows contiguous.
            seq_lens: int32 ``[requests]``: keys each request sees through its last query
                token; token t sees ``seq_lens[r] - T + 1 + t``.
            init_blocks, local_blocks: forced-selection counts (MiniMax-M3: 0 and 1).
            width: score columns, ``ceil(max(seq_lens) / 128) <= width <= max_width``.
            grid: 0 picks the launch grid automatically. A positive value is accepted and has
                no effect (a warning says so once per instance): the kernel sizes its grid
                itself, because every CTA of a push must be resident at once (CTAs wait for
                their peers' CTAs) and the size must follow from static shapes so captured
                graphs replay; results never depend on it.
            tag: optional int that identifies the call on every rank (e.g. ``step * layers +
                layer``); ranks with different tags raise ``OutOfStepError``. Passed through.

        Returns:
            float32 ``[1, rows, width]``: a view of the instance's receive buffer, valid until
            the next call on this instance (``.clone()`` to keep it).

        Raises:
            TypeError, ValueError: bad input. A ``rows`` that is not a multiple of
                ``block_table.shape[0]`` and a bad ``grid`` are refused here, before anything
                is exchanged (the instance stays usable); other input errors are raised by
                :meth:`cpindex.IndexCP.score_push` (see there).
        """
        query_len = self._query_len(iq, block_table, grid)
        return self.cp.score_push(
            iq, index_cache, block_table, seq_lens, init_blocks, local_blocks, width,
            query_len=query_len, **_tag(tag),
        )  # fmt: skip

    def select_blocks(
        self,
        iq: torch.Tensor,
        index_cache: formats.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        init_blocks: int,
        local_blocks: int,
        width: int,
        grid: int = 0,
        *,
        topk: int = 16,
        tag: int | None = None,
    ) -> torch.Tensor:
        """This rank's head's ``topk`` best blocks per row: what sparse attention reads.

        Same arguments as :meth:`score_push`. Returns int32 ``[1, rows, topk]``: block ids in
        ascending order, ``-1`` for the slots a row with fewer than ``topk`` blocks leaves
        (docs/contract.md §6); a view valid until the next call. Ranks exchange only their
        ``topk`` candidates per row, whatever the width.
        """
        query_len = self._query_len(iq, block_table, grid)
        return self.cp.select_blocks(
            iq, index_cache, block_table, seq_lens, init_blocks, local_blocks, width,
            query_len=query_len, topk=topk, **_tag(tag),
        )  # fmt: skip

    def _query_len(self, iq: object, block_table: object, grid: object) -> int:
        """``T`` from the row ratio, and the checks only this wrapper knows, all made before
        the wrapped instance sees the call (so a refusal here exchanges nothing)."""
        if isinstance(grid, bool) or not isinstance(grid, int):
            raise TypeError(f"grid: expected an int, got {type(grid).__name__}")
        if grid < 0:
            raise ValueError(f"grid: expected 0 (automatic) or a positive int, got {grid}")
        if grid > 0 and not self._warned_grid:
            self._warned_grid = True
            warnings.warn(
                f"grid={grid} has no effect: cpindex sizes the kernel's grid itself (a push "
                "grid must be resident at once and capture-stable); results are the same",
                stacklevel=3,
            )
        if not isinstance(iq, torch.Tensor):
            raise TypeError(
                f"iq: expected a torch.Tensor [rows, 128] or [rows, 1, 128], got "
                f"{type(iq).__name__}"
            )
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            got = (
                f"{block_table.dtype} {list(block_table.shape)}"
                if isinstance(block_table, torch.Tensor)
                else type(block_table).__name__
            )
            raise TypeError(
                f"block_table: expected a torch.int32 tensor [requests, max_blocks], got {got}"
            )
        if iq.dim() not in (2, 3):
            raise ValueError(
                f"iq: expected [rows, 128] or [rows, 1, 128], got {iq.dtype} {list(iq.shape)}"
            )
        rows, requests = iq.shape[0], block_table.shape[0]
        if rows < 1 or requests < 1 or rows % requests:
            raise ValueError(
                f"iq, block_table: iq's rows must be requests * T, with one block_table row per "
                f"request; got {rows} iq rows for {requests} block_table rows (iq "
                f"{list(iq.shape)}, block_table {list(block_table.shape)})"
            )
        query_len = rows // requests
        if query_len > self.cp.config.max_query_len:
            raise ValueError(
                f"iq, block_table: T = {rows} iq rows / {requests} block_table rows = "
                f"{query_len} query rows per request, more than max_query_len="
                f"{self.cp.config.max_query_len} (CPINDEX_MAX_QUERY_LEN)"
            )
        return query_len

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Collective, bounded by ``timeout_s``: release buffers and peer mappings."""
        self.cp.close()

    def __enter__(self) -> IndexCP:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.cp.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"cpindex.vllm.IndexCP({self.cp!r})"


def _tag(tag: int | None) -> dict[str, int]:
    # Only when given: an IndexCP without tags still takes every untagged call.
    return {} if tag is None else {"tag": tag}


_instance: IndexCP | None = None
_instance_args: tuple[Any, ...] | None = None


def init(
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str | int | None,
    max_rows: int,
    max_width: int,
) -> IndexCP:
    """Create this process's instance (collective, once, outside capture) and return it.

    A later call with the same arguments returns that instance without communicating; other
    arguments raise :class:`cpindex.CPIndexError` (:func:`shutdown` first). :func:`get`
    returns the instance anywhere.
    """
    global _instance, _instance_args
    args = (rank, group, device, max_rows, max_width)
    if _instance is not None:
        if args != _instance_args:
            raise CPIndexError(
                f"cpindex.vllm.init called again with other arguments ({args[0]}, ..., "
                f"max_rows={max_rows}, max_width={max_width}) than the instance it made; call "
                "cpindex.vllm.shutdown() first"
            )
        return _instance
    _instance, _instance_args = IndexCP(*args), args
    return _instance


def get() -> IndexCP:
    """The instance :func:`init` created."""
    if _instance is None:
        raise CPIndexError("cpindex.vllm.get() before cpindex.vllm.init()")
    return _instance


def shutdown() -> None:
    """Close and forget the instance :func:`init` created (collective)."""
    global _instance, _instance_args
    if _instance is not None:
        inst, _instance, _instance_args = _instance, None, None
        inst.close()
