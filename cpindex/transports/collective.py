"""``collective``: score locally, exchange through torch.distributed. Works everywhere.

1. all-gather every rank's query rows (so each rank has all H heads);
2. score this rank's round-robin share of every row's blocks for all heads (fused kernel in local
   mode on GPU, the reference on CPU) into a ``[H, rows, ceil(width / W)]`` shard;
3. all-to-all the shard so rank d receives its heads' columns from every rank;
4. interleave the W shards back into ``[heads_per_rank, rows, width]``.

``select_blocks`` exchanges candidates instead of scores: after step 2, each rank keeps the top
``topk`` of its share per (head, row) as packed (score, block id) keys, the all-to-all carries
only those, and each head's owner merges ``W * topk`` of them (docs/contract.md §6). On a GPU
up to ``topk`` 16 both are kernels: a small kernel that step 2's launch runs after the scoring
writes the shard's keys into the all-to-all's send buffer, and a merge kernel follows it.

Agreement (docs/design.md, "Ranks in step"): on the CPU, ``IndexCP`` compares each call's
header, with the plan's fingerprint and replicated heads' query hashes, before step 1. On a GPU
a host comparison would cost a sync, so step 1 carries them instead: each rank's slot of the
gathered buffer is its query rows followed by 16 bytes (the plan's fingerprint and, where ranks
share a head, the hash of its queries), and a small kernel that step 2's launch runs after the
scoring compares every rank's (kernels/agree.h). On a mismatch it writes NaN over the shard (so
every rank's outputs are NaN after step 4; ``select_blocks``' merge writes NaN scores and ids
-1 from the verdict it keeps on the device) and records the first disagreement in the kernel
error word, raised as ``OutOfStepError`` by the next call or ``check()`` (at once with
``error_check="sync"``).

Per call, apart from the scoring launch and the two collectives, ``score_push`` is one op that
writes the queries and trailer into the gathered buffer and one copy per span of the
interleave (two when ``W`` does not divide ``width``); ``select_blocks`` is that op and the
merge launch (torch ops select past ``topk`` 16). Buffers and views are made once per size.
Nothing reads the device from the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import fingerprint, formats, lockstep, partition, reference, selection
from ..comm import CollectiveFailed, CollectiveTimeout
from ..errors import PeerTimeoutError, TransportUnavailable
from ..kernels import structs
from ..kernels.launcher import ErrorMonitor, KernelScorer, SelectTargets
from ..memo import Memo
from ..plan import Call
from .base import Context, Transport, register

#: Bytes after each rank's query rows in the gathered buffer (GPU agreement): the plan's
#: fingerprint and the hash of this rank's queries (int64 each; 16 keeps every slot's queries
#: 16-byte aligned for the kernel).
TRAILER = 16


class DeviceAgreement:
    """The host side of the collective agreement on a GPU (module docstring): stamps this
    rank's trailer; the agreement kernel compares every rank's after the scoring and keeps
    :attr:`state`. Made once, nothing per call (graph-capturable)."""

    def __init__(
        self, world: int, rank: int, num_heads: int, device: torch.device, query_bytes: int
    ) -> None:
        self.replicas = num_heads < world  # ranks r, r + H, ... own head r % H
        #: The kernel's int64 ``[calls since reset(), the last call's verdict (1: disagree)]``.
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        #: The last call's verdict as a bool ``[1]`` mask (the verdict word's low byte).
        self.bad = self.state[1:].view(torch.uint8)[:1].view(torch.bool)
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)  # a plan without fingerprint
        # Query hashes' weights, made once for the largest queries (``query_bytes``).
        self._weights = (
            fingerprint.query_weights(query_bytes // 4, device) if self.replicas else None
        )

    def stamp(self, mine: torch.Tensor, iq: torch.Tensor, fp: torch.Tensor | None) -> None:
        """Writes this rank's slot (uint8 ``[q_bytes + TRAILER]``): its queries, the plan's
        fingerprint and, where ranks share a head, the hash of its queries. One op (three with
        the hash)."""
        parts = [
            iq.view(-1).view(torch.uint8),
            (self._zero if fp is None else fp).view(torch.uint8),
        ]
        if self.replicas:
            parts.append(fingerprint.query_hash(iq, self._weights).view(1).view(torch.uint8))
        n = mine.numel() - (0 if self.replicas else 8)  # without replicas the hash word is unused
        torch.cat(parts, out=mine[:n])

    def reset(self) -> None:
        """Back to call 0 (with the device idle)."""
        self.state.zero_()


class _ShareViews(NamedTuple):
    """One call size's views of the gathered queries, the shard, the received scores and the
    output (internal: never handed to a caller)."""

    kw: int  # shard columns: ceil(width / W)
    slot: int  # bytes of one rank's slot in the gathered buffer
    gathered: torch.Tensor  # uint8 [W, slot]
    mine: torch.Tensor  # this rank's slot
    trailer: tuple[int, int]  # the kernel's trailer argument (KernelScorer.score_local)
    q_all: torch.Tensor  # [W, rows, hpr, 128] in the query dtype
    shard: torch.Tensor  # float32 [H, rows, kw]
    send: torch.Tensor | None  # the shard as the all-to-all sends it (None: replicated heads)
    recv: torch.Tensor  # float32 [W, hpr, rows, kw]
    # (output, received) pairs whose copies interleave ``recv`` into the output: column
    # src + W*k of the output is column k of rank src's shard. One pair when W divides
    # width, else a second for the last, partial group of W columns.
    spans: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    low: torch.Tensor  # int64 [kw]: the shard columns' key bits (selection.id_bits)
    owned: int  # shard columns that hold a block (the rest lie past width)


class _SelectViews(NamedTuple):
    """One (rows, topk)'s fused selection: the kernel's targets, the all-to-all's send and
    receive buffers (int64 ``[W, hpr, rows, topk]`` keys) and the outputs."""

    targets: SelectTargets
    send: torch.Tensor
    recv: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor


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
        #: GPU agreement rides on the query all-gather (module docstring); set up below.
        self.agreement: DeviceAgreement | None = None
        want_agreement = dev.type == "cuda" and cfg.fingerprint
        # Allocation can fail on any rank (memory, limits): every rank learns it in the round
        # below, so none is left waiting and every rank raises the same error.
        error = None
        try:
            self._elem = torch.empty(0, dtype=self.qdtype).element_size()
            q_bytes = cfg.max_rows * hpr * cfg.head_dim * self._elem
            self._q = torch.empty(w * (q_bytes + TRAILER), dtype=torch.uint8, device=dev)
            self._shard = torch.empty(cfg.num_heads * cfg.max_rows * kw, device=dev)
            self._recv = torch.empty(w * hpr * cfg.max_rows * kw, device=dev)
            self._out = torch.empty(hpr * cfg.max_rows * cfg.max_width, device=dev)
            self._out_views: Memo[torch.Tensor] = Memo()
            self._share_views: Memo[_ShareViews] = Memo()
            self._cand = torch.empty(
                w * hpr * cfg.max_rows * cfg.max_topk, dtype=torch.int64, device=dev
            )
            self._selected = selection.Outputs(cfg, hpr, dev)
            # The kernel's selection (topk up to MAX_FUSED_TOPK): its send buffer and views.
            fused_topk = min(cfg.max_topk, structs.MAX_FUSED_TOPK)
            self._cand_send = torch.empty(
                w * hpr * cfg.max_rows * fused_topk, dtype=torch.int64, device=dev
            )
            self._select: Memo[_SelectViews] = Memo()
            # Column k of rank r's shard is block r + W*k; its keys' low bits, made once.
            self._low = selection.id_bits(torch.arange(kw, device=dev) * w + ctx.rank)
            # Which of the shard's heads go to each destination (replicated heads: d % H).
            self._send_heads = (
                None
                if cfg.num_heads >= w
                else torch.tensor([d % cfg.num_heads for d in range(w)], device=dev)
            )
        except Exception as e:
            error = (
                f"allocating its buffers ({cfg.buffer_bytes(w):,} bytes) failed: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
        self.calls = 0
        self._half_done: str | None = None  # a data collective that did not finish everywhere
        self.scorer = None
        self.monitor = None
        try:
            if error is None and dev.type == "cuda":
                self.monitor = ErrorMonitor(dev, ctx.rank)
                if want_agreement:
                    self.agreement = DeviceAgreement(w, ctx.rank, cfg.num_heads, dev, q_bytes)
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
            self.agreement = None

    @property
    def agree_on_device(self) -> bool:
        """Whether calls compare the ranks' fingerprints (and query hashes) on the device."""
        return self.agreement is not None

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
        rows, width = call.plan.rows, call.plan.width
        v = self._views(rows, width)
        self._score_share(call, v)
        send = v.send
        if send is None:  # replicated heads: rank d receives head d % H
            send = v.shard.index_select(0, self._send_heads).view(v.recv.shape)
        self._collective("all-to-all of scores", self.ctx.comm.all_to_all_into, v.recv, send)
        for dst, src in v.spans:  # the interleave (NaN throughout where ranks disagree)
            dst.copy_(src)
        return self.scores_out(rows, width)

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate exchange: the global top-k lies in the union of the ranks' top-k of their
        shares, so merging ``W * topk`` candidates is exact, and the payload (``topk`` 8-byte
        keys per row and head) does not grow with ``width``. On a GPU up to
        ``structs.MAX_FUSED_TOPK``, the kernel keeps the shard's candidates (after the
        scoring, in the same launch) and a merge kernel follows the all-to-all; otherwise
        torch ops do both."""
        rows, width = call.plan.rows, call.plan.width
        v = self._views(rows, width)
        if self.scorer is None or topk > structs.MAX_FUSED_TOPK:
            return self._select_with_torch(call, v, topk)
        sel = self._select_views(rows, topk)
        img = self._score_share(call, v, sel.targets)
        self._collective(
            "all-to-all of candidates", self.ctx.comm.all_to_all_into, sel.recv, sel.send
        )
        self.scorer.merge(img)
        return sel.ids.detach(), sel.scores.detach()

    def _select_with_torch(
        self, call: Call, v: _ShareViews, topk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w, hpr, rows = self.ctx.world, self.ctx.heads_per_rank, call.plan.rows
        self._score_share(call, v)
        keys = selection.pack_bits(v.shard, v.low)
        if v.owned < v.kw:  # the last shard column lies past width here: it holds no block
            keys[:, :, v.owned :].fill_(selection.FILLER)
        local = selection.top_keys(keys, topk)
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
        if self.agreement is not None:
            bad = self.agreement.bad
            scores.masked_fill_(bad, float("nan"))
            ids.masked_fill_(bad, -1)
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
        once per size. Views only: a size first met inside a graph capture records nothing."""
        got = self._share_views.get((rows, width))
        if got is not None:
            return got
        cfg, w, rank, hpr = self.ctx.config, self.ctx.world, self.ctx.rank, self.ctx.heads_per_rank
        kw = partition.shard_width(width, w)
        shard = self._shard[: cfg.num_heads * rows * kw].view(cfg.num_heads, rows, kw)
        q_bytes = rows * hpr * cfg.head_dim * self._elem
        slot = q_bytes + (TRAILER if self.agree_on_device else 0)
        gathered = self._q[: w * slot].view(w, slot)
        recv = self._recv[: w * hpr * rows * kw].view(w, hpr, rows, kw)
        out = self._out[: hpr * rows * width].view(hpr, rows, width)
        full, part = divmod(width, w)  # width = full * W + part
        spans = []
        if full:
            spans.append(
                (
                    out[:, :, : full * w].view(hpr, rows, full, w),
                    recv[..., :full].permute(1, 2, 3, 0),
                )
            )
        if part:  # columns full*W + src for src < part: column ``full`` of those ranks' shards
            spans.append((out[:, :, full * w :], recv[:part, :, :, full].permute(1, 2, 0)))
        return self._share_views.put(
            (rows, width),
            _ShareViews(
                kw=kw,
                slot=slot,
                gathered=gathered,
                mine=gathered[rank],  # gathered in place: this rank's slot is its input
                trailer=(0, 0)
                if self.agreement is None
                else (q_bytes, self.agreement.state.data_ptr()),
                q_all=gathered[:, :q_bytes].view(self.qdtype).view(w, rows, hpr, cfg.head_dim),
                shard=shard,
                send=shard.view(w, hpr, rows, kw) if self._send_heads is None else None,
                recv=recv,
                spans=tuple(spans),
                low=self._low[:kw],
                owned=partition.blocks_owned(width, rank, w),
            ),
        )

    def _select_views(self, rows: int, topk: int) -> _SelectViews:
        """The fused selection's buffers and kernel targets for ``rows`` x ``topk``, made once
        per size. Head h's candidates go to each owner d's block of the send buffer, at
        the head's slot among d's heads (the all-to-all's layout)."""
        got = self._select.get((rows, topk))
        if got is not None:
            return got
        cfg, w, hpr = self.ctx.config, self.ctx.world, self.ctx.heads_per_rank
        n = w * hpr * rows * topk
        send = self._cand_send[:n].view(w, hpr, rows, topk)
        recv = self._cand[:n].view(w, hpr, rows, topk)
        owners = partition.head_owners(cfg.num_heads, w)
        cand_dst = tuple(
            send[d, partition.heads_of_rank(d, cfg.num_heads, w).index(h)].data_ptr()
            for h in range(cfg.num_heads)
            for d in owners[h]
        )
        ids, scores = self.selected_out(rows, topk)
        targets = SelectTargets(
            topk=topk,
            heads_per_rank=hpr,
            cand_copies=len(owners[0]),
            cand_dst=cand_dst,
            cand=recv.data_ptr(),
            ids_out=ids.data_ptr(),
            scores_out=scores.data_ptr(),
        )
        return self._select.put((rows, topk), _SelectViews(targets, send, recv, ids, scores))

    def _score_share(
        self, call: Call, v: _ShareViews, select: SelectTargets | None = None
    ) -> torch.Tensor | None:
        """Steps 1-2: gather every rank's queries, score this rank's share of every row's
        blocks for all heads into the ``[H, rows, kw]`` shard ``v.shard`` (``select``: and
        keep its candidates). Returns the kernel's parameter image (None on the CPU)."""
        cfg, w, rank, hpr = self.ctx.config, self.ctx.world, self.ctx.rank, self.ctx.heads_per_rank
        plan = call.plan
        width = plan.width
        gathered, q_all, shard = v.gathered, v.q_all, v.shard
        self.calls += 1
        agreement = self.agreement
        if agreement is not None:
            agreement.stamp(v.mine, call.iq, plan.fingerprint)
            self._collective(
                "all-gather of queries", self.ctx.comm.all_gather_into, gathered, v.mine
            )
        else:
            self._collective(
                "all-gather of queries", self.ctx.comm.all_gather_into, gathered, call.iq
            )
        if self.scorer is not None:
            return self.scorer.score_local(
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
                q_src_stride=v.slot,
                q_heads_per_src=hpr,
                trailer=v.trailer,
                select=select,
                cache_key=call.cache_key,
            )
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
        return None

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
            dead = e.dead if isinstance(e, CollectiveFailed) else None  # None: look for them
            raise lockstep.lost_connection(
                self.ctx.comm, f"call {self.calls}: the {what}", detail, self.calls, dead
            ) from None

    @property
    def unrecoverable(self) -> str | None:
        return self._half_done

    def check(self) -> None:
        if self.monitor is not None:  # the kernel's error word, the agreement's included
            self.monitor.check()

    def reset(self) -> None:
        # No collective here: IndexCP.reset met every rank already, and after a data
        # collective failed a barrier could pair with the half-done one.
        self.calls = 0
        if self.monitor is not None:
            torch.cuda.synchronize(self.ctx.device)
            self.monitor.reset()
        if self.agreement is not None:  # the device is done with it (synchronized above)
            self.agreement.reset()
