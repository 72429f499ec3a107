"""What the peer-push transports (``ipc``, ``mori``) share: the layout of each rank's
peer-visible region, the handshake state, the launch, the self-test and the reset.

A transport only allocates one region per rank and tells this module every rank's base address
as seen from this process; the rest is here, once.

Region of rank r (offsets in bytes)::

    0      calls   u64   completed calls (advanced by the kernel)
    8      ticket  u32   CTAs finished in the current call
    16     barrier u32   CTAs past scoring in the current select_blocks call
    64     ErrorWord     device copy of this rank's error word
    512    q_flags u64[16]  slot p: last call whose queries rank p delivered here
    1024   s_flags u64[16]  slot p: last call whose scores rank p delivered here
    1536   q_ident u64[16]  slot p: identity of the call whose queries rank p delivered here
    1664   q_tag   u64[16]  slot p: tag of the call whose queries rank p delivered here
    1792   fps     u64[16]  slot p: rank p's agreement hash of its last call (sent with scores)
    1920   fp_acc  u64[2]   this rank's agreement hash being summed, by call parity
    4096   queries [world][max_rows][heads_per_rank][128] (query element size)
    ...    recv    f32 [heads_per_rank][max_rows * max_width]   (used as [hpr, rows, width])
    ...    cand    i64 [world][heads_per_rank][max_rows * max_topk]  select_blocks candidates
                   (used as [world][hpr][rows][topk]: slot src holds rank src's top-k keys)
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Sequence

import torch

from .. import formats, kernels, partition, selection
from ..config import CPIndexConfig
from ..errors import TransportUnavailable
from ..kernels import structs
from ..kernels.launcher import ErrorMonitor, KernelScorer, SelectTargets
from ..memo import Memo
from ..plan import Call, Plan
from .base import Context, Transport

OFF_CALLS, OFF_TICKET, OFF_BARRIER, OFF_ERR = 0, 8, 16, 64
OFF_QFLAGS, OFF_SFLAGS, OFF_QIDENT, OFF_QTAG, OFF_FPS, OFF_FPACC = 512, 1024, 1536, 1664, 1792, 1920
FLAG_BYTES = 4096


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


class PeerLayout:
    """Byte offsets of one rank's region (identical on every rank)."""

    def __init__(self, cfg: CPIndexConfig, world: int) -> None:
        hpr = cfg.heads_per_rank(world)
        self.elem = 2 if cfg.cache_format == "bf16" else 1
        self.q_slot = _align(cfg.max_rows * hpr * cfg.head_dim * self.elem)
        self.q_off = FLAG_BYTES
        self.recv_off = _align(self.q_off + world * self.q_slot)
        self.cand_off = _align(self.recv_off + hpr * cfg.max_rows * cfg.max_width * 4)
        self.total = self.cand_off + world * hpr * cfg.max_rows * cfg.max_topk * 8


class _CudaArray:
    """Lets torch view raw device memory (``__cuda_array_interface__``, honoured by torch on
    CUDA and ROCm) without owning it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def view_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr`` (memory stays ours)."""
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


def agree(ctx: Context, ok: bool, why: str, what: str) -> None:
    """Collective: raise TransportUnavailable on every rank if any rank failed ``what``."""
    results = ctx.comm.all_gather_object((ok, why))
    bad = [(r, w) for r, (o, w) in enumerate(results) if not o]
    if bad:
        raise TransportUnavailable(f"{what} failed: " + "; ".join(f"rank {r}: {w}" for r, w in bad))


def call_identity(cfg: CPIndexConfig, *shape: int) -> int:
    """A non-zero 64-bit identity of one call: its shape and forcing counts and the fields of
    the configuration that every rank must share. The kernel compares the identities the ranks
    deliver with their queries, so ranks that pair different calls raise instead of exchanging
    wrong data. Static per call shape, so graph replays carry it unchanged."""
    text = repr((cfg.digest(), shape)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") | 1


class PushEngine:
    """Launches push-mode calls over regions whose base addresses are ``bases[rank]``."""

    def __init__(
        self, ctx: Context, layout: PeerLayout, bases: Sequence[int], timeout_ticks_per_s: float
    ) -> None:
        cfg, rank, w = ctx.config, ctx.rank, ctx.world
        self.ctx, self.layout, self.bases = ctx, layout, list(bases)
        self.hpr = ctx.heads_per_rank
        self.local = view_bytes(bases[rank], layout.total, ctx.device)
        self.recv = self.local[layout.recv_off :].view(torch.float32)
        self.monitor = ErrorMonitor(ctx.device, rank, device_word_ptr=bases[rank] + OFF_ERR)
        self.scorer = KernelScorer(
            ctx.device,
            cfg.cache_format,
            num_heads=cfg.num_heads,
            rank=rank,
            world=w,
            sm_scale=cfg.sm_scale,
            monitor=self.monitor,
            ranks_per_device=ctx.ranks_per_device,
        )
        ps = structs.PushState()
        base = bases[rank]
        ps.calls, ps.ticket, ps.barrier = base + OFF_CALLS, base + OFF_TICKET, base + OFF_BARRIER
        ps.q_flags, ps.s_flags = base + OFF_QFLAGS, base + OFF_SFLAGS
        ps.q_idents, ps.q_tags = base + OFF_QIDENT, base + OFF_QTAG
        ps.fps, ps.fp_acc = base + OFF_FPS, base + OFF_FPACC
        for p in range(w):
            ps.peer_q_slot[p] = bases[p] + layout.q_off + rank * layout.q_slot
            ps.peer_q_flag[p] = bases[p] + OFF_QFLAGS + 8 * rank
            ps.peer_s_flag[p] = bases[p] + OFF_SFLAGS + 8 * rank
            ps.peer_q_ident[p] = bases[p] + OFF_QIDENT + 8 * rank
            ps.peer_q_tag[p] = bases[p] + OFF_QTAG + 8 * rank
            ps.peer_fp[p] = bases[p] + OFF_FPS + 8 * rank
        ps.timeout_ticks = int(cfg.timeout_s * timeout_ticks_per_s)
        self.push_image = structs.image(ps)
        self._owners = partition.head_owners(cfg.num_heads, w)
        # per static call shape (a handful per run): the parameter image and the views a call
        # returns fresh aliases of (they are never handed out themselves)
        self._calls: Memo[tuple] = Memo()
        self._score_views: Memo[torch.Tensor] = Memo()
        # select_blocks: this rank's scored share ([H][rows][kw], local) and the results; both
        # allocated here, never inside a call (graph capture; the one-process world's rule 2).
        kw = partition.shard_width(cfg.max_width, w)
        self._shard = torch.empty(cfg.num_heads * cfg.max_rows * kw, device=ctx.device)
        self.selected = selection.Outputs(cfg, self.hpr, ctx.device)

    def _params(
        self, requests: int, query_len: int, width: int, init_blocks: int, local_blocks: int
    ) -> torch.Tensor:
        cfg, w, lay = self.ctx.config, self.ctx.world, self.layout
        rows = requests * query_len
        dst = []
        for h, owners in enumerate(self._owners):
            for o in owners:
                slot = partition.heads_of_rank(o, cfg.num_heads, w).index(h)
                dst.append(self.bases[o] + lay.recv_off + slot * rows * width * 4)
        return self.scorer.params(
            requests=requests,
            query_len=query_len,
            width=width,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            q_ptr=self.bases[self.ctx.rank] + lay.q_off,
            q_src_stride=lay.q_slot,
            q_row_stride=self.hpr * cfg.head_dim * lay.elem,
            q_heads_per_src=self.hpr,
            dst=dst,
            dst_copies=len(self._owners[0]),
            shard_columns=False,
            out_row_stride=width,
            ident=call_identity(cfg, requests, query_len, width, init_blocks, local_blocks),
            agree=cfg.fingerprint,
            poison=(self.bases[self.ctx.rank] + lay.recv_off, self.hpr * rows * width),
        )

    def _select_params(
        self,
        requests: int,
        query_len: int,
        width: int,
        init_blocks: int,
        local_blocks: int,
        topk: int,
    ) -> torch.Tensor:
        """Select mode: scores into the local shard; top-k candidates to each head's owners."""
        cfg, w, lay, rank = self.ctx.config, self.ctx.world, self.layout, self.ctx.rank
        rows, kw = requests * query_len, partition.shard_width(width, w)
        cand_dst = []
        for h, owners in enumerate(self._owners):
            for o in owners:
                slot = partition.heads_of_rank(o, cfg.num_heads, w).index(h)
                block = (rank * self.hpr + slot) * rows * topk
                cand_dst.append(self.bases[o] + lay.cand_off + block * 8)
        ids, scores = self.selected.views(rows, topk)
        shape = (requests, query_len, width, init_blocks, local_blocks, topk)
        return self.scorer.params(
            requests=requests,
            query_len=query_len,
            width=width,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            q_ptr=self.bases[rank] + lay.q_off,
            q_src_stride=lay.q_slot,
            q_row_stride=self.hpr * cfg.head_dim * lay.elem,
            q_heads_per_src=self.hpr,
            dst=[self._shard.data_ptr() + h * rows * kw * 4 for h in range(cfg.num_heads)],
            dst_copies=1,
            shard_columns=True,
            out_row_stride=kw,
            ident=call_identity(cfg, *shape),
            agree=cfg.fingerprint,
            poison=(0, self.hpr * rows * topk),
            select=SelectTargets(
                topk=topk,
                heads_per_rank=self.hpr,
                cand_copies=len(self._owners[0]),
                cand_dst=tuple(cand_dst),
                cand=self.bases[rank] + lay.cand_off,
                ids_out=ids.data_ptr(),
                scores_out=scores.data_ptr(),
            ),
        )

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch: score this rank's share into the local shard, keep its top ``topk``
        per (row, head) as candidates, push them to each head's owner, merge the ``W * topk``
        candidates of this rank's heads. ``topk <= structs.MAX_FUSED_TOPK``."""
        p = call.plan
        requests, query_len, width = p.block_table.shape[0], p.query_len, p.width
        key = (requests, query_len, width, p.init_blocks, p.local_blocks, topk)
        entry = self._calls.get(key)
        if entry is None:
            ids, scores = self.selected.views(requests * query_len, topk)
            entry = self._calls.put(key, (self._select_params(*key), ids, scores))
        img, ids, scores = entry
        self.scorer.launch(
            call.iq, call.index_cache, p.block_table, p.seq_lens, img, width=width,
            query_len=query_len, push=self.push_image, tag=call.tag, cache_key=call.cache_key,
        )  # fmt: skip
        return ids.detach(), scores.detach()

    def score_push(self, call: Call) -> torch.Tensor:
        p = call.plan
        requests, query_len, width = p.block_table.shape[0], p.query_len, p.width
        key = (requests, query_len, width, p.init_blocks, p.local_blocks)
        entry = self._calls.get(key)
        if entry is None:
            view = self.scores_view(requests * query_len, width)
            entry = self._calls.put(key, (self._params(*key), view))
        img, view = entry
        self.scorer.launch(
            call.iq, call.index_cache, p.block_table, p.seq_lens, img, width=width,
            query_len=query_len, push=self.push_image, tag=call.tag, cache_key=call.cache_key,
        )  # fmt: skip
        return view.detach()

    def scores_view(self, rows: int, width: int) -> torch.Tensor:
        """The ``[hpr, rows, width]`` view of this rank's receive buffer a call returns: a fresh
        alias of a view made once per size (a caller that changes the returned tensor's
        metadata in place changes nothing a later call returns)."""
        view = self._score_views.get((rows, width))
        if view is None:
            n = self.hpr * rows * width
            view = self._score_views.put((rows, width), self.recv[:n].view(self.hpr, rows, width))
        return view.detach()

    def self_test(self) -> tuple[bool, str]:
        """Every rank writes a known pattern into every owner's buffer through the real push
        path (forced columns only: no cache reads), and each owner checks what landed. Catches
        peer writes that silently land nowhere (IOMMU, broken P2P)."""
        cfg, w = self.ctx.config, self.ctx.world
        width = min(cfg.max_width, 3 * w)
        n = min(2 * w, width)
        init = min(w, n)
        dev = self.ctx.device
        fmt = cfg.cache_format
        cache = torch.zeros(
            (1, formats.NVFP4_PAGE_BYTES) if fmt == "nvfp4" else (1, 128, 128),
            dtype=torch.uint8
            if fmt == "nvfp4"
            else (torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn),
            device=dev,
        )
        plan = Plan(
            block_table=torch.zeros(1, width, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n * cfg.block_size], dtype=torch.int32, device=dev),
            init_blocks=init,
            local_blocks=n - init,
            width=width,
        )
        call = Call(
            iq=torch.zeros(1, self.hpr, cfg.head_dim, device=dev).to(formats.query_dtype(fmt)),
            index_cache=cache,
            plan=plan,
        )
        self.recv[: self.hpr * width].fill_(float("nan"))
        torch.cuda.synchronize(dev)
        self.ctx.comm.barrier()  # every rank poisoned before anyone pushes
        out = self.score_push(call)
        torch.cuda.synchronize(dev)
        try:
            self.monitor.check()
        except Exception as e:
            return False, f"self-test call failed: {e}"
        j = torch.arange(width, device=dev)
        want = torch.full((width,), float("-inf"), device=dev)
        want[j < n] = 1e29
        want[j < init] = 1e30
        got = out[:, 0, :]
        if not torch.equal(got, want.expand_as(got)):
            wrong = sorted({int(c) % w for c in (got != want).nonzero()[:, 1].tolist()})
            return False, f"peer writes from ranks {wrong} did not land (IOMMU or broken P2P?)"
        return True, f"peer writes from all {w} ranks landed"

    def check(self) -> None:
        self.monitor.check()

    def reset(self) -> None:
        """Collective: wait for every rank's kernels, zero counters, flags and error words."""
        dev = self.ctx.device
        torch.cuda.synchronize(dev)
        self.ctx.comm.barrier()
        self.local[:FLAG_BYTES].zero_()
        torch.cuda.synchronize(dev)
        self.monitor.clear_host()
        self.ctx.comm.barrier()


class PeerPushTransport(Transport):
    """Base of the transports that push through a :class:`PushEngine` (``ipc``, ``mori``):
    subclasses allocate and map the regions in ``__init__`` and set ``self.ctx`` and
    ``self.engine``; the calls themselves are the engine's."""

    ctx: Context
    engine: PushEngine | None = None

    def score_push(self, call: Call) -> torch.Tensor:
        return self.engine.score_push(call)  # type: ignore[union-attr]

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused candidate exchange (one launch) up to ``structs.MAX_FUSED_TOPK``; larger
        ``topk`` takes the default (scores, then the selection)."""
        if topk <= structs.MAX_FUSED_TOPK:
            return self.engine.select_blocks(call, topk)  # type: ignore[union-attr]
        return super().select_blocks(call, topk)

    def scores_out(self, rows: int, width: int) -> torch.Tensor:
        return self.engine.scores_view(rows, width)  # type: ignore[union-attr]

    def selected_out(self, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        if topk <= structs.MAX_FUSED_TOPK:
            return self.engine.selected.views(rows, topk)  # type: ignore[union-attr]
        return super().selected_out(rows, topk)

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        if topk is not None and topk <= structs.MAX_FUSED_TOPK:
            return selection.candidate_bytes(self.ctx.config, self.ctx.world, rows, topk)
        return super().exchange_bytes(rows, width, topk)

    def self_test(self) -> tuple[bool, str]:
        if not self.ctx.config.ipc_self_test:
            return True, "self-test disabled by config"
        return self.engine.self_test()  # type: ignore[union-attr]

    def check(self) -> None:
        self.engine.check()  # type: ignore[union-attr]

    def reset(self) -> None:
        self.engine.reset()  # type: ignore[union-attr]


def push_probe(ctx: Context) -> tuple[bool, str]:
    """What every peer-push transport needs on this rank: a GPU, a world the push kernel can
    address, and the fused kernel."""
    if ctx.device.type != "cuda":
        return False, f"needs a GPU (this rank runs on {ctx.device.type})"
    if ctx.world > structs.MAX_WORLD:
        return False, f"world size {ctx.world} > {structs.MAX_WORLD} peers per push kernel"
    return kernels.available(ctx.device, ctx.config.cache_format)


def identity(ctx: Context) -> dict:
    """This rank's placement (host, process, GPU UUID, the GPUs it can see), to all-gather."""
    uuids = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    ]
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "uuid": uuids[ctx.device.index],
        "visible": uuids,
        "index": ctx.device.index,
    }


_shared_gpu_processes = False  # set only by allow_shared_gpu_processes()


def allow_shared_gpu_processes(enabled: bool = True) -> bool:
    """Testing and benchmarking only: let ``ipc`` (and ``mori``) run with ranks of several
    processes on one GPU, which :func:`shared_gpu_reason` refuses otherwise. Every such rank's
    process must call it before constructing (a rank that did not refuses, and then all do).
    Returns the previous setting. Process-wide; no configuration field or environment variable
    sets it.

    The spin handshake then completes only because the GPU time-slices between the processes:
    every handshake takes tens of ms (about 24 ms per handoff on an H200; measured on CUDA
    only). It exists so that one GPU can exercise the process boundary (real IPC handles, a
    peer process dying, teardown); never serve with it."""
    global _shared_gpu_processes
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    previous, _shared_gpu_processes = _shared_gpu_processes, enabled
    return previous


def shared_gpu_reason(ctx: Context, ids: list[dict]) -> str | None:
    """Why the push cannot run if another process's rank sits on this rank's GPU: kernels of
    two processes never run concurrently on one GPU, so the spin handshake would deadlock.
    None when no other process shares it, or when :func:`allow_shared_gpu_processes` is on."""
    me = ids[ctx.rank]
    clash = [
        p for p, o in enumerate(ids)
        if o["host"] == me["host"] and o["uuid"] == me["uuid"] and o["pid"] != me["pid"]
    ]  # fmt: skip
    if not clash or _shared_gpu_processes:
        return None
    return (
        f"ranks {clash} share this GPU from other processes: kernels of two processes do not "
        "run concurrently on one GPU, so the spin handshake would deadlock (use the "
        "one-process world, cpindex.world.run_threads)"
    )


def guarded(ctx: Context, what: str, fn: Callable[[], object]) -> object:
    """Run a fallible local step; every rank learns if any rank failed (no rank is left
    waiting in a later collective)."""
    try:
        result, ok, why = fn(), True, ""
    except Exception as e:
        result, ok, why = None, False, f"{type(e).__name__}: {e}"
    agree(ctx, ok, why, what)
    return result
