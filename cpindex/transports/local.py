"""Calls below the CP gate (docs/design.md, "CP per call: the gate"): each rank scores every
block of its own heads from its own ``iq`` alone. No exchange, no header round, no handshake,
no waiting on peers; the results are the context-parallel path's, bit for bit, in the very views
the transport returns, so a caller tells the two apart by speed only.

One :class:`LocalPath` serves every transport. On a GPU it runs the fused kernel in local mode as
a world of one (rank 0 of 1, ``heads_per_rank`` heads), writing straight into the transport's
score view. ``select_blocks`` (``topk`` up to ``structs.MAX_FUSED_TOPK``) is the collective
transport's fused selection in a world of one: the kernel that the scoring launch runs after
the scoring keeps each (row, head)'s top ``topk`` of every block as keys in a small candidate
buffer of this path's own, and, its candidates being where the merge reads them, each warp then
merges the items it selected, writing ids ascending into the transport's result views
(score.hip, ``after_local_kernel``); no torch op runs, no merge launch follows. Larger ``topk``
select with :func:`cpindex.selection.select` from the scores, as on the CPU, where the
reference scores this rank's heads.

Per call on a GPU: one call of the binding from a parameter image made once per static size
(score_push: the scoring kernel; select_blocks: it and the selection kernel). Nothing is
allocated.

Why the kernel may write into a push transport's receive buffer here, which peers write into
during pushed calls: a peer writes call ``N``'s scores into this rank's buffer only after it has
seen this rank's call-``N`` query flag, every CTA of a push waiting for the queries of all W ranks
before it scores (replicated heads included). This rank raises that flag from its own launch of
call ``N``, which its stream runs after everything enqueued before it: this local kernel and the
work that reads its view. And every peer write of an earlier pushed call has landed before that
call's kernel ended here (it waits for every peer's score flag). So while a local call runs,
nobody else writes the buffer: the reasoning of docs/design.md ("Why buffers can be reused
without a host barrier") with a local call in place of a pushed one. The candidate buffer and
the result views are this rank's alone (peers write candidates into their own region's slots).
"""

from __future__ import annotations

import ctypes as C

import torch

from .. import reference, selection
from ..kernels import structs
from ..kernels.launcher import ErrorMonitor, KernelScorer, SelectTargets
from ..memo import Memo
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
        self._cand: torch.Tensor | None = None
        # Per static size: (parameter image, the view or views a call returns). Views and
        # images only, made by a call's first eager launch (a size first met inside a graph
        # capture records nothing but that launch).
        self._scores: Memo[tuple[torch.Tensor, torch.Tensor]] = Memo()
        self._selects: Memo[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = Memo()
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
            # The fused selection's candidates: int64 keys [hpr, rows, topk] (a world of one's
            # [W, hpr, rows, topk] with W = 1: what the scoring launch keeps is what the merge
            # reads).
            fused = min(cfg.max_topk, structs.MAX_FUSED_TOPK)
            self._cand = torch.empty(
                self.hpr * cfg.max_rows * fused, dtype=torch.int64, device=ctx.device
            )

    def score_push(self, call: Call) -> torch.Tensor:
        p = call.plan
        scorer = self.scorer
        if scorer is None:
            out = self.transport.scores_out(p.rows, p.width)
            out.copy_(self._reference(call))
            return out
        key = (p.block_table.shape[0], p.query_len, p.width, p.init_blocks, p.local_blocks)
        entry = self._scores.get(key)
        if entry is None:  # the first call of this size: the image is made by its launch
            out = self.transport.scores_out(p.rows, p.width)
            img = self._launch_new(call, out, None)
            self._scores.put(key, (img, out))
            return out.detach()
        img, out = entry
        scorer.launch(
            call.iq, call.index_cache, p.block_table, p.seq_lens, img, width=p.width,
            query_len=p.query_len, cache_key=call.cache_key,
        )  # fmt: skip
        return out.detach()

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused selection (module docstring) on a GPU up to ``structs.MAX_FUSED_TOPK``;
        otherwise scores into the transport's score view (a call may overwrite it: the
        previous call's view is valid until this call), then the torch selection into its
        result views."""
        p = call.plan
        scorer = self.scorer
        if scorer is None or topk > structs.MAX_FUSED_TOPK:
            scores = self.score_push(call)
            ids, vals = self.transport.selected_out(p.rows, topk)
            selection.select(scores, topk, ids, vals)
            return ids, vals
        key = (p.block_table.shape[0], p.query_len, p.width, p.init_blocks, p.local_blocks, topk)
        entry = self._selects.get(key)
        if entry is None:
            rows = p.rows
            ids, vals = self.transport.selected_out(rows, topk)
            targets = self._targets(rows, topk, ids, vals)
            img = self._launch_new(call, self.transport.scores_out(rows, p.width), targets)
            entry = self._selects.put(key, (img, ids, vals))
        else:
            scorer.launch(
                call.iq, call.index_cache, p.block_table, p.seq_lens, entry[0], width=p.width,
                query_len=p.query_len, cache_key=call.cache_key,
            )  # fmt: skip
        _, ids, vals = entry
        return ids.detach(), vals.detach()

    def _targets(
        self, rows: int, topk: int, ids: torch.Tensor, vals: torch.Tensor
    ) -> SelectTargets:
        """Where a world of one's selection goes: head h's keys to ``[h, rows, topk]`` of the
        candidate buffer, which the merge reads as ``[1, hpr, rows, topk]``. ``cand`` equal to
        ``cand_dst[0]`` is what tells the kernel to merge in the same launch."""
        base = self._cand.data_ptr()  # type: ignore[union-attr]
        return SelectTargets(
            topk=topk,
            heads_per_rank=self.hpr,
            cand_copies=1,
            cand_dst=tuple(base + h * rows * topk * 8 for h in range(self.hpr)),
            cand=base,
            ids_out=ids.data_ptr(),
            scores_out=vals.data_ptr(),
        )

    def _launch_new(
        self, call: Call, out: torch.Tensor, select: SelectTargets | None
    ) -> torch.Tensor:
        """A call of a size not met before, through :meth:`KernelScorer.score_local` (which
        makes its image): every column for this rank's heads into ``out`` ``[hpr, rows,
        width]``, and with ``select`` its candidates. Returns the image."""
        p = call.plan
        return self.scorer.score_local(  # type: ignore[union-attr]
            call.iq,
            call.index_cache,
            p.block_table,
            p.seq_lens,
            out,
            init_blocks=p.init_blocks,
            local_blocks=p.local_blocks,
            width=p.width,
            query_len=p.query_len,
            select=select,
            cache_key=call.cache_key,
        )

    def _reference(self, call: Call) -> torch.Tensor:
        p = call.plan
        return reference.block_scores(
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
