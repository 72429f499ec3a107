"""``collective``: score locally, exchange through torch.distributed. Works everywhere.

1. all-gather every rank's query rows (so each rank has all H heads);
2. score this rank's round-robin share of every row's blocks for all heads (fused kernel in local
   mode on GPU, the reference on CPU) into a ``[H, rows, ceil(width / W)]`` shard;
3. all-to-all the shard so rank d receives its heads' columns from every rank;
4. interleave the W shards back into ``[heads_per_rank, rows, width]``.

``select_blocks`` exchanges candidates instead of scores: after step 2, each rank keeps the top
``topk`` of its share per (head, row) as packed (score, block id) keys, the all-to-all carries
only those, and each head's owner merges ``W * topk`` of them (docs/contract.md §6).
"""

from __future__ import annotations

import torch

from .. import formats, partition, reference, selection
from ..comm import CollectiveFailed, CollectiveTimeout
from ..errors import PeerConnectionError, PeerTimeoutError
from ..kernels.launcher import ErrorMonitor, KernelScorer
from ..validation import Call
from .base import Context, Transport, register


@register
class CollectiveTransport(Transport):
    name = "collective"
    host_lockstep = True  # IndexCP compares each call's header before any data collective

    @classmethod
    def probe(cls, ctx: Context) -> tuple[bool, str]:
        backend = getattr(ctx.comm, "backend", "in-process copies")
        return True, f"all-gather + all-to-all over {backend}"

    def __init__(self, ctx: Context) -> None:
        cfg, w, hpr = ctx.config, ctx.world, ctx.heads_per_rank
        self.ctx = ctx
        self.fmt = cfg.cache_format
        self.qdtype = formats.query_dtype(self.fmt)
        kw = partition.shard_width(cfg.max_width, w)
        dev = ctx.device
        self._q = torch.empty(w * cfg.max_rows * hpr * cfg.head_dim, dtype=self.qdtype, device=dev)
        self._shard = torch.empty(cfg.num_heads * cfg.max_rows * kw, device=dev)
        self._recv = torch.empty(w * hpr * cfg.max_rows * kw, device=dev)
        self._out = torch.empty(hpr * cfg.max_rows * cfg.max_width, device=dev)
        self._cand = torch.empty(
            w * hpr * cfg.max_rows * cfg.max_topk, dtype=torch.int64, device=dev
        )
        self._selected = selection.Outputs(cfg, hpr, dev)
        # Block id of each shard column: column k of rank r is block r + W*k.
        self._cols = torch.arange(kw, device=dev) * w + ctx.rank
        # Which of the shard's heads go to each destination (replicated heads: d % H).
        self._send_heads = (
            None
            if cfg.num_heads >= w
            else torch.tensor([d % cfg.num_heads for d in range(w)], device=dev)
        )
        self.calls = 0
        self._half_done: str | None = None  # a data collective that did not finish everywhere
        self.scorer = None
        self.monitor = None
        if dev.type == "cuda":
            self.monitor = ErrorMonitor(dev, ctx.rank)
            self.scorer = KernelScorer(
                dev,
                self.fmt,
                num_heads=cfg.num_heads,
                rank=ctx.rank,
                world=w,
                sm_scale=cfg.sm_scale,
                monitor=self.monitor,
                ranks_per_device=ctx.ranks_per_device,
            )

    @property
    def capturable(self) -> bool:
        # NCCL/RCCL collectives capture; the one-process world exchanges through host barriers.
        return not self.ctx.comm.same_process

    def _all_heads(self, q_all: torch.Tensor) -> torch.Tensor:
        """Gathered ``[W, rows, hpr, D]`` queries as ``[rows, H, D]`` (reference path)."""
        h = self.ctx.config.num_heads
        w, rows, _, d = q_all.shape
        src = q_all if h >= w else q_all[:h]
        return src.permute(1, 0, 2, 3).reshape(rows, h, d)

    def score_push(self, call: Call) -> torch.Tensor:
        w, hpr = self.ctx.world, self.ctx.heads_per_rank
        rows, width = call.rows, call.width
        shard, kw = self._score_share(call)
        send = shard if self._send_heads is None else shard.index_select(0, self._send_heads)
        recv = self._recv[: w * hpr * rows * kw].view(w, hpr, rows, kw)
        self._collective(
            "all-to-all of scores", self.ctx.comm.all_to_all_into, recv, send.view(w, hpr, rows, kw)
        )
        out = self._out[: hpr * rows * width].view(hpr, rows, width)
        # Column src + W*k of the output is column k of rank src's shard.
        out.copy_(recv.permute(1, 2, 3, 0).reshape(hpr, rows, kw * w)[:, :, :width])
        return out

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate exchange: the global top-k lies in the union of the ranks' top-k of their
        shares, so merging ``W * topk`` candidates is exact, and the payload (``topk`` 8-byte
        keys per row and head) does not grow with ``width``."""
        w, hpr = self.ctx.world, self.ctx.heads_per_rank
        rows, width = call.rows, call.width
        shard, kw = self._score_share(call)
        cols = self._cols[:kw]
        # Shard columns past width (the last one on some ranks) hold no block: FILLER keys.
        local = selection.top_keys(selection.pack(shard, cols, cols < width), topk)
        send = local if self._send_heads is None else local.index_select(0, self._send_heads)
        recv = self._cand[: w * hpr * rows * topk].view(w, hpr, rows, topk)
        self._collective(
            "all-to-all of candidates",
            self.ctx.comm.all_to_all_into,
            recv,
            send.reshape(w, hpr, rows, topk),
        )
        merged = recv.permute(1, 2, 0, 3).reshape(hpr, rows, w * topk)
        ids, scores = self._selected.views(rows, topk)
        selection.finish(selection.top_keys(merged, topk), ids, scores)
        return ids, scores

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        cfg, w = self.ctx.config, self.ctx.world
        if topk is None:
            return selection.score_bytes(cfg, w, rows, width)
        return selection.candidate_bytes(cfg, w, rows, topk)

    def _score_share(self, call: Call) -> tuple[torch.Tensor, int]:
        """Steps 1-2: gather every rank's queries, score this rank's share of every row's
        blocks for all heads. Returns the ``[H, rows, kw]`` shard and ``kw``."""
        cfg, w, rank, hpr = self.ctx.config, self.ctx.world, self.ctx.rank, self.ctx.heads_per_rank
        rows, width, d = call.rows, call.width, cfg.head_dim
        kw = partition.shard_width(width, w)
        self.calls += 1
        q_all = self._q[: w * rows * hpr * d].view(w, rows, hpr, d)
        self._collective("all-gather of queries", self.ctx.comm.all_gather_into, q_all, call.iq)

        shard = self._shard[: cfg.num_heads * rows * kw].view(cfg.num_heads, rows, kw)
        if self.scorer is not None:
            self.scorer.score_local(
                q_all,
                call.index_cache,
                call.block_table,
                call.seq_lens,
                shard,
                init_blocks=call.init_blocks,
                local_blocks=call.local_blocks,
                width=width,
                query_len=call.query_len,
                shard=True,
                q_src_stride=rows * hpr * d * q_all.element_size(),
                q_heads_per_src=hpr,
            )
        else:
            cols = partition.owned_columns(rank, w, width)
            shard[:, :, : cols.numel()] = reference.block_scores(
                self._all_heads(q_all),
                call.index_cache,
                call.block_table,
                call.seq_lens,
                init_blocks=call.init_blocks,
                local_blocks=call.local_blocks,
                width=width,
                sm_scale=cfg.sm_scale,
                columns=cols,
                query_len=call.query_len,
            )
        return shard, kw

    def _collective(self, what: str, fn, out: torch.Tensor, inp: torch.Tensor) -> None:
        # The call's header round passed on every rank, so every rank posts this collective;
        # one that fails or runs out of time here means a peer stopped (or died) inside the
        # call, and the backend may hold a half-done collective that no reset can pair.
        rank, timeout = self.ctx.rank, self.ctx.config.timeout_s
        try:
            fn(out, inp, timeout_s=timeout)
        except CollectiveTimeout as e:
            late = ", ".join(map(str, e.late)) or "unknown (the backend cannot tell)"
            self._half_done = f"call {self.calls}'s {what} did not complete (rank(s) {late})"
            raise PeerTimeoutError(
                f"rank {rank}: call {self.calls} timed out in the {what} after {timeout} s "
                f"waiting for rank(s) {late}, which stopped inside the call after its header "
                "round. The process group may hold a half-done collective: rebuild it.",
                rank=rank,
                peer=e.late[0] if e.late else -1,
                call=self.calls,
                phase=what,
            ) from None
        except CollectiveFailed as e:
            self._half_done = f"call {self.calls}'s {what} failed ({e.detail})"
            raise PeerConnectionError(
                f"rank {rank}: call {self.calls}: the {what} lost a peer: {e.detail}",
                rank=rank,
                call=self.calls,
                phase=what,
            ) from None

    @property
    def unrecoverable(self) -> str | None:
        return self._half_done

    def check(self) -> None:
        if self.monitor is not None:
            self.monitor.check()

    def reset(self) -> None:
        # No collective here: IndexCP.reset met every rank already, and after a data
        # collective failed a barrier could pair with the half-done one.
        self.calls = 0
        if self.monitor is not None:
            torch.cuda.synchronize(self.ctx.device)
            self.monitor.reset()
