"""``collective``: score locally, exchange through torch.distributed. Works everywhere.

1. all-gather every rank's query rows (so each rank has all H heads);
2. score this rank's round-robin share of every row's blocks for all heads (fused kernel in local
   mode on GPU, the reference on CPU) into a ``[H, rows, ceil(width / W)]`` shard;
3. all-to-all the shard so rank d receives its heads' columns from every rank;
4. interleave the W shards back into ``[heads_per_rank, rows, width]``.

``select_blocks`` exchanges candidates instead of scores: after step 2, each rank keeps the top
``topk`` of its share per (head, row) as packed (score, block id) keys, the all-to-all carries
only those, and each head's owner merges ``W * topk`` of them (docs/contract.md §6).

Agreement (docs/design.md, "Ranks in step"): on the CPU, ``IndexCP`` compares each call's
header, with the plan's fingerprint and replicated heads' query hashes, before step 1. On a GPU
a host comparison would cost a sync, so step 1 carries them instead: each rank's slot of the
gathered buffer is its query rows followed by 16 bytes (the plan's fingerprint, the hash of its
queries where ranks share a head), every rank compares all slots on the device, and on a
mismatch writes NaN over the call's outputs and records the first disagreement in a word of
pinned host memory the device writes (as the kernel's error word), raised as ``OutOfStepError``
by the next call or ``check()`` (at once with ``error_check="sync"``).
"""

from __future__ import annotations

import ctypes
import logging
from typing import NamedTuple

import torch

from .. import fingerprint, formats, kernels, lockstep, partition, reference, selection
from ..comm import CollectiveFailed, CollectiveTimeout
from ..errors import OutOfStepError, PeerTimeoutError, TransportUnavailable
from ..kernels.launcher import ErrorMonitor, KernelScorer
from ..memo import Memo
from ..validation import Call
from .base import Context, Transport, register

log = logging.getLogger("cpindex")

#: Bytes after each rank's query rows in the gathered buffer (GPU agreement): the plan's
#: fingerprint and the hash of this rank's queries (int64 each).
TRAILER = 16
#: The disagreement word, int64 ``[kind, peer, call, detail]``; kinds: block tables or
#: lengths, replicated heads' queries (0: none recorded).
KIND_TABLES, KIND_QUERIES = 1, 2


class _ShareViews(NamedTuple):
    """One call size's views of the gathered queries, the shard and the received scores."""

    kw: int  # shard columns: ceil(width / W)
    slot: int  # bytes of one rank's slot in the gathered buffer
    gathered: torch.Tensor  # uint8 [W, slot]
    mine: torch.Tensor  # this rank's slot
    mine_q: torch.Tensor  # its query bytes
    trailer: torch.Tensor  # int64 [2] after them (device agreement)
    trailers: torch.Tensor  # int64 [W, 2]: every rank's
    q_all: torch.Tensor  # [W, rows, hpr, 128] in the query dtype
    shard: torch.Tensor  # float32 [H, rows, kw]
    recv: torch.Tensor  # float32 [W, hpr, rows, kw]


@register
class CollectiveTransport(Transport):
    name = "collective"
    host_lockstep = True  # IndexCP compares each call's header before any data collective
    compares_fingerprint = True  # in the header on the CPU, with the queries on a GPU

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
        #: GPU agreement rides on the query all-gather (module docstring).
        self.agree_on_device = dev.type == "cuda" and cfg.fingerprint
        self._elem = torch.empty(0, dtype=self.qdtype).element_size()
        q_bytes = cfg.max_rows * hpr * cfg.head_dim * self._elem
        trailer = TRAILER if self.agree_on_device else 0
        self._q = torch.empty(w * (q_bytes + trailer), dtype=torch.uint8, device=dev)
        self._shard = torch.empty(cfg.num_heads * cfg.max_rows * kw, device=dev)
        self._recv = torch.empty(w * hpr * cfg.max_rows * kw, device=dev)
        self._out = torch.empty(hpr * cfg.max_rows * cfg.max_width, device=dev)
        self._out_views: Memo[torch.Tensor] = Memo()
        self._share_views: Memo[_ShareViews] = Memo()
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
        self._bad: torch.Tensor | None = None  # this call's device-side disagreement flag
        error = None
        try:
            if dev.type == "cuda":
                self.monitor = ErrorMonitor(dev, ctx.rank)
                if self.agree_on_device:
                    self._init_device_agreement()
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
        except Exception as e:  # every rank learns it below: none is left waiting
            error = f"{type(e).__name__}: {e}"
        # One outcome for all ranks, and one layout of the gathered slots (collective).
        reports = ctx.comm.all_gather_object((error, self.agree_on_device))
        failed = [(r, why) for r, (why, _) in enumerate(reports) if why]
        if failed:
            raise TransportUnavailable(
                "collective: " + "; ".join(f"rank {r}: {why}" for r, why in failed)
            )
        if not all(agree for _, agree in reports):
            self.agree_on_device = False

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
        rows, width = call.plan.rows, call.plan.width
        shard, kw = self._score_share(call)
        send = shard if self._send_heads is None else shard.index_select(0, self._send_heads)
        recv = self._views(rows, width).recv
        self._collective(
            "all-to-all of scores", self.ctx.comm.all_to_all_into, recv, send.view(w, hpr, rows, kw)
        )
        out = self.scores_out(rows, width)
        # Column src + W*k of the output is column k of rank src's shard.
        out.copy_(recv.permute(1, 2, 3, 0).reshape(hpr, rows, kw * w)[:, :, :width])
        if self._bad is not None:
            out.masked_fill_(self._bad, float("nan"))
        return out

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate exchange: the global top-k lies in the union of the ranks' top-k of their
        shares, so merging ``W * topk`` candidates is exact, and the payload (``topk`` 8-byte
        keys per row and head) does not grow with ``width``."""
        w, hpr = self.ctx.world, self.ctx.heads_per_rank
        rows, width = call.plan.rows, call.plan.width
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
        ids, scores = self.selected_out(rows, topk)
        selection.finish(selection.top_keys(merged, topk), ids, scores)
        if self._bad is not None:
            scores.masked_fill_(self._bad, float("nan"))
            ids.masked_fill_(self._bad, -1)
        return ids, scores

    def scores_out(self, rows: int, width: int) -> torch.Tensor:
        view = self._out_views.get((rows, width))
        if view is None:  # made once per size; each call gets a fresh alias (peer.py's why)
            hpr = self.ctx.heads_per_rank
            view = self._out_views.put(
                (rows, width), self._out[: hpr * rows * width].view(hpr, rows, width)
            )
        return view.detach()

    def selected_out(self, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._selected.views(rows, topk)

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        cfg, w = self.ctx.config, self.ctx.world
        if topk is None:
            return selection.score_bytes(cfg, w, rows, width)
        return selection.candidate_bytes(cfg, w, rows, topk)

    def _views(self, rows: int, width: int) -> _ShareViews:
        """The views of this transport's buffers a call of ``rows`` x ``width`` works in, made
        once per size (internal: never handed to a caller)."""
        got = self._share_views.get((rows, width))
        if got is not None:
            return got
        cfg, w, rank, hpr = self.ctx.config, self.ctx.world, self.ctx.rank, self.ctx.heads_per_rank
        kw = partition.shard_width(width, w)
        q_bytes = rows * hpr * cfg.head_dim * self._elem
        slot = q_bytes + (TRAILER if self.agree_on_device else 0)
        gathered = self._q[: w * slot].view(w, slot)
        mine = gathered[rank]  # with agreement gathered in place: this rank's slot is its input
        return self._share_views.put(
            (rows, width),
            _ShareViews(
                kw=kw,
                slot=slot,
                gathered=gathered,
                mine=mine,
                mine_q=mine[:q_bytes],
                trailer=mine[q_bytes:].view(torch.int64),
                trailers=gathered[:, q_bytes:].view(torch.int64),
                q_all=gathered[:, :q_bytes].view(self.qdtype).view(w, rows, hpr, cfg.head_dim),
                shard=self._shard[: cfg.num_heads * rows * kw].view(cfg.num_heads, rows, kw),
                recv=self._recv[: w * hpr * rows * kw].view(w, hpr, rows, kw),
            ),
        )

    def _score_share(self, call: Call) -> tuple[torch.Tensor, int]:
        """Steps 1-2: gather every rank's queries, score this rank's share of every row's
        blocks for all heads. Returns the ``[H, rows, kw]`` shard and ``kw``."""
        cfg, w, rank, hpr = self.ctx.config, self.ctx.world, self.ctx.rank, self.ctx.heads_per_rank
        plan = call.plan
        width = plan.width
        v = self._views(plan.rows, width)
        kw, slot, gathered, q_all, shard = v.kw, v.slot, v.gathered, v.q_all, v.shard
        self.calls += 1
        if self.agree_on_device:
            v.mine_q.copy_(call.iq.view(-1).view(torch.uint8))
            self._stamp(v.trailer, call)
            self._collective(
                "all-gather of queries", self.ctx.comm.all_gather_into, gathered, v.mine
            )
            self._compare(v.trailers)
        else:
            self._collective(
                "all-gather of queries", self.ctx.comm.all_gather_into, gathered, call.iq
            )
        if self.scorer is not None:
            self.scorer.score_local(
                q_all,
                call.index_cache,
                plan.block_table,
                plan.seq_lens,
                shard,
                init_blocks=plan.init_blocks,
                local_blocks=plan.local_blocks,
                width=width,
                query_len=plan.query_len,
                shard=True,
                q_src_stride=slot,
                q_heads_per_src=hpr,
            )
        else:
            cols = partition.owned_columns(rank, w, width)
            shard[:, :, : cols.numel()] = reference.block_scores(
                self._all_heads(q_all),
                call.index_cache,
                plan.block_table,
                plan.seq_lens,
                init_blocks=plan.init_blocks,
                local_blocks=plan.local_blocks,
                width=width,
                sm_scale=cfg.sm_scale,
                columns=cols,
                query_len=plan.query_len,
            )
        return shard, kw

    # ---- agreement on the device (module docstring) ------------------------------------------
    def _init_device_agreement(self) -> None:
        """The disagreement word: a device copy and a pinned host copy the device writes
        through its mapping, so ``check()`` reads it without a sync (like the kernel's error
        word). Checked once here; a system where the device cannot write it gets no device
        agreement (logged)."""
        from .peer import view_bytes  # raw device memory as a tensor (no import cycle at load)

        ctx, cfg, w = self.ctx, self.ctx.config, self.ctx.world
        dev = ctx.device
        self._word = torch.zeros(4, dtype=torch.int64, device=dev)
        self._word_new = torch.zeros(4, dtype=torch.int64, device=dev)
        with torch.cuda.device(dev):  # pinned memory registered with this rank's device
            self._host_word = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        mapped = kernels.load(dev).host_device_pointer(self._host_word.data_ptr())
        self._word_host = view_bytes(mapped, 32, dev).view(torch.int64)
        self._word_host.fill_(7)
        torch.cuda.synchronize(dev)
        if self._word_host.data_ptr() != mapped or int(self._host_word[0]) != 7:
            log.warning(
                "cpindex: rank %d cannot write pinned host memory from %s; the collective "
                "transport compares no fingerprints on the device",
                ctx.rank,
                dev,
            )
            self.agree_on_device = False
            return
        self._host_word.zero_()
        # read in place at every check() (no tensor op); ``_host_word`` owns the memory
        self._host_kind = ctypes.c_int64.from_address(self._host_word.data_ptr())
        self._replicas = cfg.num_heads < w  # ranks r, r + H, ... own head r % H
        self._head_owner = torch.tensor(
            [s % cfg.num_heads for s in range(w)], dtype=torch.int64, device=dev
        )

    def _stamp(self, trailer: torch.Tensor, call: Call) -> None:
        """This rank's 16 bytes after its queries: the plan's fingerprint and, where ranks
        share a head, the hash of its queries (else 0)."""
        fp = call.plan.fingerprint
        if fp is None:  # a plan made without one: compare zeros (IndexCP supplies one)
            trailer[:1].zero_()
        else:
            trailer[:1].copy_(fp)
        if self._replicas:
            trailer[1:].copy_(fingerprint.query_hash(call.iq).view(1))
        else:
            trailer[1:].zero_()

    def _compare(self, trailers: torch.Tensor) -> None:
        """``trailers``: every rank's int64 ``[W, 2]``. Sets ``self._bad`` (0-d bool, device)
        and records the first disagreement unless one is recorded already."""
        w = self.ctx.world
        fps, hashes = trailers[:, 0], trailers[:, 1]
        differ = fps != fps[self.ctx.rank]  # any pair that differs shows against this rank
        if self._replicas:
            differ = torch.cat([differ, hashes != hashes.index_select(0, self._head_owner)])
        bad = differ.any()
        first = differ.to(torch.int64).argmax().view(1)  # the first disagreement: kind, peer
        word = self._word_new
        word[0:1].copy_(first // w + KIND_TABLES)
        word[1:2].copy_(first % w)
        word[2].fill_(self.calls)
        word[3:4].copy_(trailers.t().reshape(-1).index_select(0, first))
        merged = torch.where(bad & (self._word[0] == 0), word, self._word)
        self._word.copy_(merged)
        self._word_host.copy_(merged)
        self._bad = bad

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
        except (CollectiveFailed, *lockstep.DIST_ERRORS) as e:
            detail = e.detail if isinstance(e, CollectiveFailed) else f"{type(e).__name__}: {e}"
            self._half_done = f"call {self.calls}'s {what} failed ({detail})"
            raise lockstep.lost_connection(
                self.ctx.comm, f"call {self.calls}: the {what}", detail, self.calls
            ) from None

    @property
    def unrecoverable(self) -> str | None:
        return self._half_done

    def check(self) -> None:
        if self.monitor is None:
            return
        if self.agree_on_device and self._host_kind.value:
            raise self._disagreement(self._host_word.tolist())
        self.monitor.check()

    def _disagreement(self, word: list[int]) -> OutOfStepError:
        kind, peer, call, detail = word
        rank, detail = self.ctx.rank, detail & ((1 << 64) - 1)
        if kind == KIND_TABLES:
            what = (
                f"rank {peer} passed other block-table entries or lengths of equal shapes "
                f"(agreement fingerprint {detail:#018x} there, another here)"
            )
        else:
            head = peer % self.ctx.config.num_heads
            what = (
                f"ranks {head} and {peer} both own head {head} but passed different iq (query "
                f"hash {detail:#018x} on rank {peer}); ranks that share a head must pass the "
                "same queries"
            )
        return OutOfStepError(
            f"rank {rank}: call {call}: {what}. That call's outputs are NaN on every rank. "
            "Call reset() on every rank to go on.",
            rank=rank,
            peer=peer,
            call=call,
        )

    def reset(self) -> None:
        # No collective here: IndexCP.reset met every rank already, and after a data
        # collective failed a barrier could pair with the half-done one.
        self.calls = 0
        if self.monitor is not None:
            torch.cuda.synchronize(self.ctx.device)
            self.monitor.reset()
            if self.agree_on_device:
                self._word.zero_()
                self._host_word.zero_()
                torch.cuda.synchronize(self.ctx.device)
