"""A drop-in for the ``IndexCP`` of vLLM's MiniMax-M3 ROCm indexer CP path (``ops/index_cp``).

A serving stack that calls that module swaps one import and changes nothing else::

    # from vllm.models.minimax_m3.amd.ops.index_cp import IndexCP
    from cpindex.vllm import IndexCP

    cp = IndexCP(rank, group, device, max_rows, max_width)   # collective, once, outside capture
    scores = cp.score_push(iq, index_cache, block_table, seq_lens,
                           init_blocks, local_blocks, width)  # [1, rows, width] float32

Heads = world size, rank ``r`` owns head ``r``; ``T = rows / block_table.shape[0]``. The rest of
the configuration comes from ``CPINDEX_*`` variables (:meth:`cpindex.CPIndexConfig.from_env`).
Each call is :meth:`cpindex.IndexCP.plan` (reused while the same ``block_table`` and
``seq_lens`` objects come with the same counts, as every layer of a step passes them) and the
plan form of :class:`cpindex.IndexCP` (``.cp``; its other attributes are reachable here).

**Tags.** The seed's calls carry no tag, and counting calls cannot see a skipped one: a skip
shifts every later count alike, so with equal shapes rank 1's layer L+1 would pair with rank 0's
layer L. What tells layers apart without the caller is the cache: each sparse layer passes its
own ``index_cache`` tensor, the same object at every step. An untagged call is tagged with the
order in which this instance first saw that cache object (0, 1, ...): every rank runs the same
code, so every rank numbers its layers' caches alike without talking, and a rank that skips a
layer's call makes the next call's tags differ: every rank raises ``OutOfStepError`` at once.
The tag is a host int fixed when the call is made, so a captured call replays with its layer's
tag. Blind spots: a skip during the very first pass over the layers (numbers are handed out
then); layers that share one cache tensor; a stack that builds a new cache object per call
(then every call gets a new number: never a false alarm, but no protection). Such a stack passes
``tag=`` (e.g. ``step * layers + layer``), which is used as given.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import api, construction, formats
from .api import get, shutdown
from .config import CPIndexConfig
from .plan import Plan

__all__ = ["IndexCP", "get", "init", "shutdown"]

#: Cache objects numbered before the numbering starts over (on every rank alike).
LAYER_LIMIT = 4096


class IndexCP:
    """The seed's ``IndexCP(rank, group, device, max_rows, max_width)``: collective (every rank
    of ``group``, outside capture). ``rank`` must be this process's rank in ``group`` (``None``:
    the world); ``comm`` replaces ``group`` in the one-process world. The configuration is
    ``CPIndexConfig.from_env(num_heads=W, max_rows=max_rows, max_width=max_width)``. Raises
    ``ValueError`` for a wrong ``rank`` or configuration, after telling the peers (their
    construction raises at once; the group stays usable for the next one)."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None, device: Any, max_rows: int,
                 max_width: int, *, comm: Any = None) -> None:  # fmt: skip
        try:  # a refusal is still a round: the peers raise at once (construction.refuse)
            if isinstance(rank, bool) or not hasattr(rank, "__index__"):
                raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
            if comm is not None and group is not None:
                raise ValueError("group: pass either group or comm, not both")
            if comm is None and not dist.is_initialized():
                raise ValueError("group: torch.distributed is not initialized (init_process_group)")
            actual = int(comm.rank) if comm is not None else dist.get_rank(group)
            if actual < 0:
                raise ValueError("group: this process is not a member of the given process group")
            if operator.index(rank) != actual:
                raise ValueError(
                    f"rank: got {rank}, but this process is rank {actual} of the group"
                )
            world = int(comm.world_size) if comm is not None else dist.get_world_size(group)
            config = CPIndexConfig.from_env(num_heads=world, max_rows=max_rows, max_width=max_width)
        except (TypeError, ValueError) as e:
            construction.refuse(e, group=group, comm=comm)
        self.cp = api.IndexCP(config, group, device, comm=comm)  #: the wrapped instance
        self._plan: Plan | None = None
        self._key: tuple = ()
        self._layers: dict[int, tuple[weakref.ref, int]] = {}  # id(cache) -> (ref, number)
        self._numbered = 0
        self._warned_grid = False

    def __getattr__(self, name: str) -> Any:  # rank, config, reset(), check(), close(), ...
        if name == "cp":
            raise AttributeError(name)
        return getattr(self.cp, name)

    def score_push(self, iq: torch.Tensor, index_cache: formats.Cache, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, init_blocks: int, local_blocks: int, width: int,
                   grid: int = 0, *, tag: int | None = None) -> torch.Tensor:  # fmt: skip
        """This rank's head's scores, float32 ``[1, rows, width]``: a view valid until the next
        call. ``grid`` is accepted and ignored (the kernel sizes its grid; a positive value
        warns once). Bad ``grid``, or rows not ``requests * T`` with ``T <= max_query_len``:
        refused before any launch, as the rank's refusal of its call (with peers above the CP
        gate: the peers raise too and the instance needs ``reset()``); the rest as in
        :meth:`cpindex.IndexCP.score_push`."""
        plan = self._plan_for(iq, block_table, seq_lens, init_blocks, local_blocks, width, grid)
        return self.cp.score_push(iq, index_cache, plan, tag=self._tag(index_cache, tag))

    def select_blocks(self, iq: torch.Tensor, index_cache: formats.Cache,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, init_blocks: int,
                      local_blocks: int, width: int, grid: int = 0, *, topk: int = 16,
                      tag: int | None = None) -> torch.Tensor:  # fmt: skip
        """This rank's head's ``topk`` block-table columns per row, int32 ``[1, rows, topk]``
        (ascending, ``-1``-padded; :meth:`cpindex.IndexCP.select_blocks`)."""
        plan = self._plan_for(iq, block_table, seq_lens, init_blocks, local_blocks, width, grid)
        return self.cp.select_blocks(
            iq, index_cache, plan, topk=topk, tag=self._tag(index_cache, tag)
        )

    def _plan_for(
        self, iq: Any, block_table: Any, seq_lens: Any, init: Any, local: Any, width: Any, grid: Any
    ) -> Plan:
        try:  # a refusal here is the rank's refusal of its call: the peers are told
            t = self._query_len(iq, block_table, grid)
        except (TypeError, ValueError) as e:
            self.cp._runner.refuse_input("score_push", e, block_table, width)
            raise
        key = (t, init, local, width, type(init), type(local), type(width))  # True is not 1
        p = self._plan
        if (
            p is None
            or key != self._key
            or p.block_table is not block_table
            or p.seq_lens is not seq_lens
            or p.checked != p.record()  # resized in place since
        ):
            p = self.cp.plan(block_table, seq_lens, query_len=t, init_blocks=init,
                             local_blocks=local, width=width)  # fmt: skip
            self._plan, self._key = p, key
        return p

    def _query_len(self, iq: Any, block_table: Any, grid: Any) -> int:
        """T, the query rows per request, from the seed's arguments (which carry no T)."""
        if isinstance(grid, bool) or not isinstance(grid, int):
            raise TypeError(f"grid: expected an int, got {type(grid).__name__}")
        if grid < 0:
            raise ValueError(f"grid: expected 0 (automatic) or a positive int, got {grid}")
        if grid > 0 and not self._warned_grid:
            self._warned_grid = True
            warnings.warn(
                f"grid={grid} has no effect: cpindex sizes the kernel's grid itself "
                "(capture-stable, resident at once); results are the same",
                stacklevel=3,
            )
        if not isinstance(iq, torch.Tensor) or not isinstance(block_table, torch.Tensor):
            raise TypeError("iq, block_table: expected torch.Tensors")
        rows, requests = iq.shape[0] if iq.dim() else 0, block_table.shape[0]
        if block_table.dim() != 2 or rows < 1 or requests < 1 or rows % requests:
            raise ValueError(
                f"iq, block_table: iq's rows must be requests * T; got {rows} iq rows for "
                f"{requests} block_table rows (iq {list(iq.shape)}, block_table "
                f"{list(block_table.shape)})"
            )
        t, most = rows // requests, self.cp.config.max_query_len
        if t > most:
            raise ValueError(
                f"iq, block_table: T = {t} query rows per request, more than "
                f"max_query_len={most} (CPINDEX_MAX_QUERY_LEN)"
            )
        return t

    def _tag(self, index_cache: Any, tag: int | None) -> int | None:
        """``tag`` if given, else the number of this cache object (see the module docstring)."""
        if tag is not None:
            return tag
        cache = index_cache[0] if isinstance(index_cache, tuple) and index_cache else index_cache
        seen = self._layers.get(id(cache))
        if seen is not None and seen[0]() is cache:
            return seen[1]
        try:
            ref = weakref.ref(cache)
        except TypeError:
            return None  # not a tensor: the call refuses it
        if self._numbered >= LAYER_LIMIT:  # by count, not len(): ids are reused unevenly
            self._layers.clear()
            self._numbered = 0
        self._layers[id(cache)] = (ref, self._numbered)
        self._numbered += 1
        return self._numbered - 1

    def __enter__(self) -> IndexCP:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.cp.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"cpindex.vllm.IndexCP({self.cp!r})"


def init(
    rank: int, group: dist.ProcessGroup | None, device: Any, max_rows: int, max_width: int
) -> IndexCP:
    """The seed's ``init``: this process's shared drop-in instance (:func:`cpindex.init`'s
    rules: made once, the same one again for equal arguments; :func:`get`, :func:`shutdown`)."""
    return api.shared(IndexCP, (rank, group, device, max_rows, max_width), "cpindex.vllm.init")
