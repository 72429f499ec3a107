"""A decode step's plan: its shared inputs, validated once and reused by every layer.

Within a decode step every sparse layer calls the indexer with the same block table, lengths and
query length; only the queries, the layer's cache and the tag change. :meth:`IndexCP.plan
<cpindex.IndexCP.plan>` checks those shared inputs once and returns a :class:`Plan`;
``score_push(iq, index_cache, plan, tag=...)`` and ``select_blocks(iq, index_cache, plan,
tag=...)`` then check only ``iq`` and the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from . import fingerprint as _fingerprint

if TYPE_CHECKING:
    from .config import CPIndexConfig


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's shared call inputs and what depends only on them.

    Make plans with :meth:`cpindex.IndexCP.plan`, which validates them; this constructor
    checks nothing (transports build internal plans with it).

    The plan holds the caller's ``block_table`` and ``seq_lens`` themselves, not copies, so a
    call always reads their current contents, and the plan's tensors keep their addresses: a
    plan is reusable across layers and steps, and a call captured in a CUDA/HIP graph replays
    with whatever the tensors then hold. What the plan derives from the *contents* is the
    agreement :attr:`fingerprint`, computed when the plan is made and again by every call
    (:meth:`refresh`: one kernel launch on a GPU, no host sync, captured with the call), so
    that a call compares what the tensors hold then, in a graph replay too. On the CPU every
    call also re-checks the contents.

    Attributes:
        block_table: int32 ``[requests, max_blocks]``, rows contiguous.
        seq_lens: int32 ``[requests]``.
        query_len: query tokens per request (``T``).
        init_blocks, local_blocks: forced-selection counts.
        width: score columns.
        fingerprint: int64 ``[1]`` on the tensors' device: the agreement hash of the entries a
            call reads (:func:`cpindex.fingerprint.plan_fingerprint`), or None where the
            instance compares none (``config.fingerprint`` off, or a transport that does not
            compare it).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_len: int = 1
    init_blocks: int = 0
    local_blocks: int = 1
    width: int = 1
    fingerprint: torch.Tensor | None = None
    #: The configuration the plan was validated against (None: built unchecked).
    config: CPIndexConfig | None = field(default=None, repr=False)

    @classmethod
    def _of(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_len: int,
        init_blocks: int,
        local_blocks: int,
        width: int,
        fingerprint: torch.Tensor | None,
        config: CPIndexConfig | None,
    ) -> Plan:
        """``Plan(...)`` for validation, which makes one per positional call: the same object,
        built with one ``__dict__`` in place of the frozen dataclass's eight
        ``object.__setattr__`` calls."""
        plan = object.__new__(cls)
        object.__setattr__(
            plan,
            "__dict__",
            {
                "block_table": block_table, "seq_lens": seq_lens, "query_len": query_len,
                "init_blocks": init_blocks, "local_blocks": local_blocks, "width": width,
                "fingerprint": fingerprint, "config": config,
            },
        )  # fmt: skip
        return plan

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

    def refresh(self) -> Plan:
        """Recompute the :attr:`fingerprint` from the tensors' current contents, in place (its
        address stays), on the current stream; no host sync, capturable. Returns the plan."""
        if self.fingerprint is not None:
            _fingerprint.plan_fingerprint(
                self.block_table, self.seq_lens, self.init_blocks, self.local_blocks,
                self.fingerprint,
            )  # fmt: skip
        return self

    def with_fingerprint(self, out: torch.Tensor) -> Plan:
        """This plan with ``out`` (int64 ``[1]``) as its fingerprint's slot, not yet computed:
        every call that takes the plan computes it (:meth:`refresh`)."""
        return replace(self, fingerprint=out)
