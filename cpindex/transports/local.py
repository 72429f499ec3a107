"""Calls below the CP gate (docs/design.md, "CP per call: the gate"): each rank scores every
block of its own heads from its own ``iq`` alone. No exchange, no header round, no handshake,
no waiting on peers; the results are the context-parallel path's, bit for bit, in the very views
the transport returns, so a caller tells the two apart by speed only.

One :class:`LocalPath` serves every transport. On a GPU it runs the fused kernel in local mode as
a world of one (rank 0 of 1, ``heads_per_rank`` heads), writing straight into the transport's
score view; on the CPU it runs the reference for this rank's heads. ``select_blocks`` scores the
same way, then selects with :func:`cpindex.selection.select` into the transport's result views.

Why the kernel may write into a push transport's receive buffer here, which peers write into
during pushed calls: a peer writes call ``N``'s scores into this rank's buffer only after it has
seen this rank's call-``N`` query flag, every CTA of a push waiting for the queries of all W ranks
before it scores (replicated heads included). This rank raises that flag from its own launch of
call ``N``, which its stream runs after everything enqueued before it: this local kernel and the
work that reads its view. And every peer write of an earlier pushed call has landed before that
call's kernel ended here (it waits for every peer's score flag). So while a local call runs,
nobody else writes the buffer: the reasoning of docs/design.md ("Why buffers can be reused
without a host barrier") with a local call in place of a pushed one.
"""

from __future__ import annotations

import ctypes as C

import torch

from .. import reference, selection
from ..kernels import structs
from ..kernels.launcher import ErrorMonitor, KernelScorer
from ..plan import Call
from .base import Context, Transport

#: Byte offset of the rank in the error word (the local kernel runs as rank 0 of a world of 1).
_RANK_OFFSET = structs.ErrorWord.rank.offset


class LocalPath:
    """Scores this rank's own heads alone, into ``transport``'s output views."""

    def __init__(self, ctx: Context, transport: Transport) -> None:
        self.ctx, self.transport = ctx, transport
        self.rank, self.hpr = ctx.rank, ctx.heads_per_rank
        self.scorer: KernelScorer | None = None
        self.monitor: ErrorMonitor | None = None
        self._word: torch.Tensor | None = None
        if ctx.device.type == "cuda":
            cfg = ctx.config
            # The local kernel's own error word (device copy here, a pinned host mirror): its
            # errors concern this rank only, so they are kept apart from the transport's.
            self._word = torch.zeros(
                C.sizeof(structs.ErrorWord), dtype=torch.uint8, device=ctx.device
            )
            self.monitor = ErrorMonitor(
                ctx.device, self.rank, device_word_ptr=self._word.data_ptr()
            )
            self.scorer = KernelScorer(
                ctx.device,
                cfg.cache_format,
                num_heads=self.hpr,
                rank=0,
                world=1,
                sm_scale=cfg.sm_scale,
                monitor=self.monitor,
                ranks_per_device=ctx.ranks_per_device,
            )

    def _score(self, call: Call, out: torch.Tensor) -> None:
        """Every column of every row for this rank's heads into ``out`` ``[hpr, rows, width]``."""
        p = call.plan
        if self.scorer is not None:
            self.scorer.score_local(
                call.iq,
                call.index_cache,
                p.block_table,
                p.seq_lens,
                out,
                init_blocks=p.init_blocks,
                local_blocks=p.local_blocks,
                width=p.width,
                query_len=p.query_len,
                cache_key=call.cache_key,
            )
            return
        out.copy_(
            reference.block_scores(
                call.iq,
                call.index_cache,
                p.block_table,
                p.seq_lens,
                init_blocks=p.init_blocks,
                local_blocks=p.local_blocks,
                width=p.width,
                sm_scale=self.ctx.config.sm_scale,
                query_len=p.query_len,
            )
        )

    def score_push(self, call: Call) -> torch.Tensor:
        out = self.transport.scores_out(call.plan.rows, call.plan.width)
        self._score(call, out)
        return out

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores into the transport's score view (a call may overwrite it: the previous
        call's view is valid until this call), then the selection into its result views."""
        rows = call.plan.rows
        scores = self.transport.scores_out(rows, call.plan.width)
        self._score(call, scores)
        ids, vals = self.transport.selected_out(rows, topk)
        selection.select(scores, topk, ids, vals)
        return ids, vals

    def take_error(self) -> BaseException | None:
        """The error a local call recorded on the device, cleared, or None (reads host memory
        only). It concerns this rank's own inputs: no peer waits on it."""
        mon = self.monitor
        if mon is None or not mon.pending:
            return None
        mon.host[_RANK_OFFSET : _RANK_OFFSET + 4].view(torch.int32)[0] = self.rank
        try:
            mon.check()
        except Exception as e:  # the monitor raises the recorded error as a cpindex error
            return e
        finally:
            self.clear()
        return None

    def clear(self) -> None:
        """Forget a recorded error. The device word is zeroed by an elementwise kernel on the
        current stream (after the launches that could have written it), not a memset, which
        would synchronize the device (docs/design.md, the one-process world, rule 2)."""
        if self._word is not None and self.monitor is not None:
            torch.bitwise_and(self._word, 0, out=self._word)
            self.monitor.clear_host()
