"""A decode step's plan and one validated call: what every transport takes.

Within a decode step every sparse layer calls the indexer with the same block table, lengths and
query length; only the queries, the layer's cache and the tag change. :meth:`IndexCP.plan
<cpindex.IndexCP.plan>` checks those shared inputs once and returns a :class:`Plan`;
``score_push(iq, index_cache, plan, tag=...)`` and ``select_blocks(iq, index_cache, plan,
tag=...)`` then check only ``iq``, the cache, and that the plan is still what was checked. A
validated call reaches the transports as a :class:`Call`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import fingerprint as _fingerprint

if TYPE_CHECKING:
    from .config import CPIndexConfig
    from .formats import Cache


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's shared call inputs and what depends only on them.

    Make plans with :meth:`cpindex.IndexCP.plan`, which validates them and records what it
    checked (:attr:`checked`); a call refuses a plan whose tensors or fields no longer match
    that record. This constructor checks nothing (transports build internal plans with it).

    The plan holds the caller's ``block_table`` and ``seq_lens`` themselves, not copies, so a
    call always reads their current contents, and the plan's tensors keep their addresses: a
    plan is reusable across layers and steps, and a call captured in a CUDA/HIP graph replays
    with whatever the tensors then hold. Keep the plan and its tensors alive as long as a graph
    that captured a call with it. What the plan derives from the *contents* is the agreement
    :attr:`fingerprint`, computed by every call (:meth:`refresh`: one kernel launch on a GPU,
    no host sync, captured with the call), so that a call compares what the tensors hold then,
    in a graph replay too. On the CPU every call also re-checks the contents.

    Attributes:
        block_table: int32 ``[requests, max_blocks]``, rows contiguous.
        seq_lens: int32 ``[requests]``.
        query_len: query tokens per request (``T``).
        init_blocks, local_blocks: forced-selection counts.
        width: score columns.
        fingerprint: int64 ``[1]`` on the tensors' device, the slot a call computes the
            agreement hash of the entries it reads into
            (:func:`cpindex.fingerprint.plan_fingerprint`): the instance's one slot, or None
            where the instance compares none (``config.fingerprint`` off, or a transport
            that does not compare it).
        config: the configuration the plan was validated against (None: built unchecked).
        checked: what validation checked, :meth:`record` as it was then (None: built
            unchecked).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_len: int = 1
    init_blocks: int = 0
    local_blocks: int = 1
    width: int = 1
    fingerprint: torch.Tensor | None = None
    config: CPIndexConfig | None = field(default=None, repr=False)
    checked: tuple | None = field(default=None, repr=False)

    @property
    def requests(self) -> int:
        return self.block_table.shape[0]

    @property
    def blocks(self) -> int:
        """The call's size as the CP gate counts it: ``requests * width``, both static sizes
        every rank shares (docs/design.md, "CP per call: the gate")."""
        return self.block_table.shape[0] * self.width

    @property
    def rows(self) -> int:
        """Query rows a call with this plan takes: ``requests * query_len``."""
        return self.block_table.shape[0] * self.query_len

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    def record(self) -> tuple:
        """What validation checks of the plan, read now: each tensor's dtype, shape and strides
        (a ``resize_``, ``as_strided_`` or ``.data =`` changes them in place), the four counts
        (``dataclasses.replace`` changes them in a copy) and the device."""
        bt, sl = self.block_table, self.seq_lens
        return (
            bt.dtype, bt.shape, bt.stride(), sl.dtype, sl.shape, sl.stride(),
            self.query_len, self.init_blocks, self.local_blocks, self.width, bt.device,
        )  # fmt: skip

    def refresh(self) -> Plan:
        """Recompute the :attr:`fingerprint` from the tensors' current contents, in place (its
        address stays), on the current stream; no host sync, capturable. Returns the plan."""
        if self.fingerprint is not None:
            _fingerprint.plan_fingerprint(
                self.block_table, self.seq_lens, self.init_blocks, self.local_blocks,
                self.fingerprint,
            )  # fmt: skip
        return self

    def with_fingerprint(self, out: torch.Tensor | None) -> Plan:
        """This plan with ``out`` (int64 ``[1]``, or None) as its fingerprint's slot, not yet
        computed: every call that takes the plan computes it (:meth:`refresh`)."""
        return replace(self, fingerprint=out)


class Call(NamedTuple):
    """One validated call: this rank's queries and cache, the step's plan, and the tag (a
    named tuple: made on every call, so it costs what a tuple costs)."""

    iq: torch.Tensor  # [plan.rows, heads_per_rank, 128], contiguous
    index_cache: Cache
    plan: Plan
    tag: int | None = None
    #: :func:`~cpindex.memo.view_key` of the cache (a pair: of each part) as validation read
    #: it, for the launcher's per-tensor views; None: read it again.
    cache_key: tuple | None = None
