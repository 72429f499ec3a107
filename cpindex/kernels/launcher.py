"""Launching the fused kernel from Python: parameter images, grid sizing, error words.

A :class:`KernelScorer` is one call site (fixed format, heads, rank, world). Everything that
depends only on the call's static shape (rows, width, forcing counts) is packed into a struct
image once and cached; a call patches pointers in C++ and launches. What a launch derives from
its tensors' metadata is cached too (docs/design.md, "The host path"): the grid choice per
shape, and the nvfp4 views of a cache per cache tensor (:class:`cpindex.memo.PerTensor`).
"""

from __future__ import annotations

import ctypes as C
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import layouts, quant
from ..errors import BadBlockTableError, BadSlotError, OutOfStepError, PeerTimeoutError
from ..memo import Memo, PerTensor
from . import structs
from .build import load

PHASES = {structs.ERR_TIMEOUT_QUERIES: "queries", structs.ERR_TIMEOUT_SCORES: "scores"}

# The warpgroup-mma instance (sm_90a builds, T * H of 17..32) is faster once a call gives each SM
# a few pages per warp, and slower on small batches, where its warps wait on each other
# (docs/BENCHMARKS.md): it runs from this many items (request, block) per SM of a rank's share.
WGMMA_MIN_ITEMS_PER_SM = 32

# bf16 and fp8 (the cp.async ring formats) take the warpgroup-mma instance only on GPUs whose
# name holds one of these: on an H100 the mma.sync instance (whole pages, its own registers
# holding the queries) read them 1-5 % (bf16) and 3-12 % (fp8) faster at every size from
# WGMMA_MIN_ITEMS_PER_SM, while on the H200, with 1.4x the bandwidth per SM, the warpgroup
# instance was 8-14 % faster (docs/kernel.md, "Four query tiles on Hopper"). nvfp4, bound by its
# decode, takes it on every sm_90a GPU.
WGMMA_RING_GPUS: tuple[str, ...] = ("H200",)

# A call whose items (request, block) of the busiest rank's share all fit the resident grid at
# once splits each page over several warps of a CTA (score.hip, split pages): a small call has
# more warps loading and decoding. The warps per page, most first: a call takes the first whose
# CTAs (4 / warps items each) fit the split instance's resident grid (every build has both).
# () keeps a warp per item.
SPLIT_WARPS: tuple[int, ...] = (4, 2)
WARPS_PER_CTA = 4

# bf16 and fp8 whole pages stream through a per-warp cp.async ring (kernels/config.h kRingTiles
# tiles of 16 tokens, all but one in flight). HBM is read faster with about this many of those
# bytes in flight per SM than with the 120-144 KiB of a fully occupied SM (91-92 % of its peak),
# so these instances' persistent grid holds this many bytes per SM rather than as many CTAs as
# fit (docs/kernel.md, "Where the time goes"). 0: every CTA that fits. Only calls of at least
# RING_MIN_ITEMS_PER_SM items per SM: below that, a call that fits one or two rounds of the full
# grid loses more to extra rounds than it gains (fp8 at 8 x 32K 20-25 % slower). The
# warpgroup-mma instance and the split pages keep their own grids, so this applies to bf16 with
# four query tiles and fp8 with two or more (RING_SPLIT_PAGES splits the others).
RING_BYTES_PER_SM = 48 * 1024
RING_MIN_ITEMS_PER_SM = 32
RING_TILES = 4  # kRingTiles

# The ring formats split pages past what fits at once with these query tiles (T * H <= 8: one,
# <= 16: two, <= 32: four), from this many items per SM of a rank's share: (format, tiles, warps
# a page, items per SM). That split instance then runs on its whole resident grid, each CTA
# taking several rounds. On an H100, against whole pages on any grid: bf16 0-2 % faster in
# quarters with one tile and 0-6 % in halves with two (four warps a page with two tiles 3-20 %
# slower); fp8 1-6 % faster in halves with one tile (1-18 % slower with two, and with four
# query tiles every format). bf16 with four tiles (where the warpgroup instance does not take
# them) in quarters that keep the queries in shared memory: 1-6 % faster from 62 items per SM,
# 1-4 % slower at 16 (docs/kernel.md, "Where the time goes"). Only where SPLIT_WARPS holds that
# split; () keeps whole pages past the resident grid.
RING_SPLIT_PAGES: tuple[tuple[str, int, int, int], ...] = (
    ("bf16", 1, 4, 0), ("bf16", 2, 2, 0), ("bf16", 4, 4, RING_MIN_ITEMS_PER_SM), ("fp8", 1, 2, 0)
)  # fmt: skip


def nvfp4_lut() -> torch.Tensor:
    """The nvfp4 key-value tables the kernel decodes with, uint8 ``[6144]``. For scale byte
    ``s`` and e2m1 magnitude code ``c``, ``v = e4m3_rn_satfinite(e2m1(c) * e4m3(s))``. Bytes
    ``16 s + c`` and ``16 s + 8 + c``: the high and low byte of v's f16 bits; byte ``4096 + 8 s +
    c``: v's e4m3 byte (the kernel applies the code's sign to either). Built from
    :func:`cpindex.formats.e4m3_rn_satfinite`, the function the reference dequantizes with, so
    the kernel's key values are the reference's bit for bit. (Every e4m3 value is exact in f16.)"""
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = quant.e2m1_decode(torch.arange(8, dtype=torch.uint8))
    vals = quant.e4m3_rn_satfinite(scales[:, None] * grid[None, :])
    bits = vals.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    f16 = torch.cat([bits >> 8, bits & 0xFF], dim=1).to(torch.uint8)
    e4m3 = vals.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([f16.reshape(-1), e4m3.reshape(-1)]).contiguous()


def div_magic(d: int) -> int:
    """ceil(2**16 / d): the kernel divides a query vector index x by d as (x * m) >> 16, exact
    while x * (d - 1) < 2**16 (keys.h, div_small); its indices stay under MAX_QUERY_LEN * 16."""
    if not 1 <= d <= 16:
        raise ValueError(f"a head count of 1 to 16 was expected, got {d}")
    return -(-(1 << 16) // d)


def cache_parts(index_cache: layouts.Cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the binding reads (or writes) keys through: ``(kv, ks)``. bf16/fp8: the cache and
    None. nvfp4 (a page-major tensor or the pair): zero-copy views of the values ``[pages, 128,
    64]`` and scales ``[pages, 128, 8]`` (:func:`cpindex.formats.nvfp4_views`), whose page and
    token strides the binding passes to the kernel. The cache was validated before
    (``validation.Checker``, ``formats.write_keys``), so this only splits it."""
    if isinstance(index_cache, tuple) or index_cache.dtype == torch.uint8:
        return layouts.nvfp4_views(index_cache, checked=True)
    return index_cache, None


class ErrorMonitor:
    """The kernel's error word: a device copy every CTA checks, and a pinned host mirror the
    host reads at every call without a sync (so checks stay cheap and graph-safe)."""

    def __init__(self, device: torch.device, rank: int, device_word_ptr: int | None = None):
        mod = load(device)
        self.rank = rank
        self._own = None
        if device_word_ptr is None:  # callers with peer memory place the word there instead
            self._own = torch.zeros(C.sizeof(structs.ErrorWord), dtype=torch.uint8, device=device)
            device_word_ptr = self._own.data_ptr()
        self.device_ptr = device_word_ptr
        self.host = torch.zeros(C.sizeof(structs.ErrorWord), dtype=torch.uint8, pin_memory=True)
        self.host_device_ptr = mod.host_device_pointer(self.host.data_ptr())
        # The mirror read in place through ctypes: no tensor op per call. ``self.host`` owns the
        # memory for as long as this monitor lives.
        self._word = structs.ErrorWord.from_address(self.host.data_ptr())

    @property
    def pending(self) -> bool:
        """Whether an error is recorded (reads host memory only)."""
        return self._word.code != 0

    def check(self) -> None:
        """Raise the recorded error, if any (reads host memory only)."""
        if self._word.code == 0:
            return
        w = structs.ErrorWord.from_buffer_copy(self._word)  # one consistent copy
        if w.code == structs.ERR_BAD_PAGE:
            raise BadBlockTableError(
                f"rank {w.rank}: block_table row {w.peer}, column {w.detail} names a page "
                f"outside index_cache (or a column past block_table's width); those scores are NaN"
            )
        if w.code == structs.ERR_WIDTH:
            raise BadBlockTableError(
                f"rank {w.rank}: request {w.peer} needs {w.detail} blocks (seq_lens), more than "
                "width or block_table's max_blocks; its scores past them are missing"
            )
        if w.code == structs.ERR_LENGTH:
            raise BadBlockTableError(
                f"rank {w.rank}: request {w.peer} has seq_lens {C.c_int64(w.detail).value}, "
                "shorter than "
                "query_len (a request's length counts its own query tokens); its scores are NaN"
            )
        if w.code == structs.ERR_SLOT:
            raise BadSlotError(
                f"write_keys: token {w.peer} has slot_mapping {C.c_int64(w.detail).value}, "
                "at or past the cache's pages * 128 slots; that key was not written"
            )
        if w.code == structs.ERR_MISMATCH:
            raise OutOfStepError(
                f"rank {w.rank}: call {w.call} paired with a different call on rank {w.peer} "
                f"(call identity {w.detail:#018x} there): the ranks called with other shapes, "
                "forcing counts or configurations, or one skipped a call. Nothing was exchanged; "
                "reset() to go on.",
                rank=w.rank,
                peer=w.peer,
                call=w.call,
            )
        if w.code == structs.ERR_TAG:
            raise OutOfStepError(
                f"rank {w.rank}: call {w.call} is out of step with rank {w.peer}: "
                f"{_tag(w.mine)} here, {_tag(w.detail)} on rank {w.peer} (a rank skipped, "
                "repeated or reordered a call). Nothing was scored; reset() to go on.",
                rank=w.rank,
                peer=w.peer,
                call=w.call,
            )
        if w.code in (structs.ERR_AGREEMENT, structs.ERR_REPLICA):
            what = (
                f"rank {w.peer} read other block-table entries or seq_lens (agreement hash "
                f"{w.detail:#018x} there, {w.mine:#018x} here)"
                if w.code == structs.ERR_AGREEMENT
                else f"rank {w.peer}'s queries differ from rank {w.detail}'s, which holds the "
                "same head"
            )
            raise OutOfStepError(
                f"rank {w.rank}: call {w.call}: the ranks disagree on their inputs: {what}. "
                "Every rank must pass the same block_table rows, seq_lens and (replicated "
                "heads) queries; this call's outputs are NaN. reset() to go on.",
                rank=w.rank,
                peer=w.peer,
                call=w.call,
            )
        phase = PHASES.get(w.code, f"code {w.code}")
        raise PeerTimeoutError(
            f"rank {w.rank}: call {w.call} timed out waiting for rank {w.peer}'s {phase} "
            f"(rank {w.peer} is late or skipped the call; flag stood at call {w.detail}). "
            "Every rank must make the same sequence of score_push calls; reset() to go on.",
            rank=w.rank,
            peer=w.peer,
            call=w.call,
            phase=phase,
        )

    def clear_host(self) -> None:
        """Forget the host mirror (after the device word was zeroed)."""
        self.host.zero_()

    def reset(self) -> None:
        """Zero both words (the device word only if this monitor owns it). Call with the
        device idle."""
        if self._own is not None:
            self._own.zero_()
            torch.cuda.synchronize(self._own.device)
        self.clear_host()


def _tag(word: int) -> str:
    return "no tag" if word == structs.NO_TAG else f"tag {word}"


class SelectTargets(NamedTuple):
    """Where a select call's candidates and results go (ScoreParams' select fields): the
    shard's top ``topk`` per (row, head h) to ``cand_dst[h * cand_copies + c]`` (``[rows,
    topk]`` int64 keys each); the merge reads ``cand`` (``[W, heads_per_rank, rows, topk]``)
    into ``ids_out`` and ``scores_out`` (``[heads_per_rank, rows, topk]``). Addresses."""

    topk: int
    heads_per_rank: int
    cand_copies: int
    cand_dst: tuple[int, ...]
    cand: int
    ids_out: int
    scores_out: int


class LaunchShape(NamedTuple):
    """Which kernel instance a call runs and on how many CTAs."""

    grid: int
    wgmma: bool  # the warpgroup-mma instance (sm_90a, four query tiles, large calls)
    split: int  # the split-page instance's warps per page (4 or 2); 0: a warp per item


class KernelScorer:
    """Launches the fused kernel for one (format, heads, rank, world) configuration."""

    def __init__(
        self,
        device: torch.device,
        fmt: str,
        *,
        num_heads: int,
        rank: int,
        world: int,
        sm_scale: float,
        monitor: ErrorMonitor,
        ranks_per_device: int = 1,
        portable: bool = False,
    ) -> None:
        self.mod = load(device, fmt, portable=portable)
        self.device = device
        self.fmt_id = structs.FORMAT_IDS[fmt]
        self.elem = 2 if fmt == "bf16" else 1
        # bytes in flight per CTA of a whole-page ring instance (CUDA tensor-core builds)
        ring = fmt in ("bf16", "fp8") and not portable and torch.version.hip is None
        self._ring_cta_bytes = (
            WARPS_PER_CTA * (RING_TILES - 1) * 16 * layouts.HEAD_DIM * self.elem if ring else 0
        )
        self.num_heads, self.rank, self.world, self.sm_scale = num_heads, rank, world, sm_scale
        self.monitor = monitor
        # score_local's parameter images per shape and output (fresh outputs each call: bounded)
        self._images: Memo[torch.Tensor] = Memo()
        self._lut = nvfp4_lut().to(device) if fmt == "nvfp4" else None
        props = torch.cuda.get_device_properties(device)
        self._sms, self._gpu = props.multi_processor_count, props.name
        self._ranks_per_device = ranks_per_device
        self._capacity: dict[tuple[int, int, bool, int], int] = {}
        self._has_wgmma: dict[int, bool] = {}  # per T * H: the build has a warpgroup instance
        self._splits: dict[int, int] = {}  # per format: the fewest warps a page splits over
        # grid() per (its arguments and the module's tunables, which tests patch)
        self._shapes: Memo[LaunchShape] = Memo()
        # nvfp4: a page-major cache's (values, scales) views; a pair's e4m3 scales as uint8
        self._views: PerTensor[tuple[torch.Tensor, torch.Tensor, int]] = PerTensor()
        self._scale_bytes: PerTensor[torch.Tensor] = PerTensor()

    def grid(
        self, requests: int, width: int, push: bool, query_len: int = 1, fmt_id: int | None = None
    ) -> LaunchShape:
        """The kernel instance and its persistent grid, from static sizes only; push grids must
        all be resident at once (every CTA may wait for peers) and deliver queries from CTAs
        0..world-1."""
        fid = self.fmt_id if fmt_id is None else fmt_id
        vectors = query_len * self.num_heads
        items = requests * -(-width // self.world)
        has = self._has_wgmma.get(vectors)
        if has is None:
            has = self._has_wgmma[vectors] = self.mod.has_wgmma(vectors)
        wgmma = (
            has
            and items * self._ranks_per_device >= WGMMA_MIN_ITEMS_PER_SM * self._sms
            and (not self._ring_cta_bytes or any(n in self._gpu for n in WGMMA_RING_GPUS))
        )
        # Split pages where the build has a split-page instance and the call's CTAs all fit its
        # resident grid at once (4 / split items a CTA), and past that where RING_SPLIT_PAGES
        # says so; otherwise four warps a CTA, one item each, on at most the whole-page
        # instance's resident grid.
        fewest = self._splits.get(fid)
        if fewest is None:
            fewest = self._splits[fid] = self.mod.split_warps(fid)
        split = 0
        for k in SPLIT_WARPS if fewest and not wgmma else ():
            if k >= fewest and -(-items * k // WARPS_PER_CTA) <= self._cap(fid, vectors, False, k):
                split = k
                break
        # the kernel's query tiles per pass (score.hip query_tiles); 0: several passes
        tiles = 1 if vectors <= 8 else 2 if vectors <= 16 else 4 if vectors <= 32 else 0
        every = next(
            (
                w
                for f, n, w, per_sm in RING_SPLIT_PAGES
                if structs.FORMAT_IDS[f] == fid
                and n == tiles
                and items * self._ranks_per_device >= per_sm * self._sms
            ),
            0,
        )
        if (
            not split
            and not wgmma
            and self._ring_cta_bytes
            and every in SPLIT_WARPS
            and 0 < fewest <= every
        ):
            split = every
            ctas = min(-(-items * split // WARPS_PER_CTA), self._cap(fid, vectors, False, split))
        elif split:
            ctas = -(-items * split // WARPS_PER_CTA)
        else:
            ctas = min(-(-items // WARPS_PER_CTA), self._cap(fid, vectors, wgmma, 0))
            if (
                self._ring_cta_bytes
                and RING_BYTES_PER_SM
                and not wgmma
                and items * self._ranks_per_device >= RING_MIN_ITEMS_PER_SM * self._sms
            ):
                per_sm = max(1, RING_BYTES_PER_SM // self._ring_cta_bytes)
                ctas = min(ctas, max(1, self._sms * per_sm // self._ranks_per_device))
        return LaunchShape(max(ctas, self.world if push else 1), wgmma, split)

    def _cap(self, fid: int, vectors: int, wgmma: bool, split: int) -> int:
        """The CTAs of this rank's share of the GPU that one kernel instance keeps resident
        (split: its warps per page, 0 for the whole-page instances)."""
        key = (fid, vectors, wgmma, split)
        cap = self._capacity.get(key)
        if cap is None:  # the instance depends on the load width, on T * H and on the mode
            per_sm = self.mod.occupancy(fid, vectors, wgmma, split)
            cap = self._capacity[key] = max(1, self._sms * per_sm // self._ranks_per_device)
        return cap

    def params(
        self,
        *,
        requests: int,
        query_len: int,
        width: int,
        init_blocks: int,
        local_blocks: int,
        q_ptr: int = 0,
        q_src_stride: int,
        q_row_stride: int,
        q_heads_per_src: int,
        dst: Sequence[int],
        dst_copies: int,
        shard_columns: bool,
        out_row_stride: int,
        ident: int = 0,
        agree: bool = False,
        poison: tuple[int, int] = (0, 0),
        trailer: tuple[int, int] = (0, 0),
        select: SelectTargets | None = None,
    ) -> torch.Tensor:
        """A ScoreParams image (pointers to keys, table and lengths are patched per call)."""
        p = structs.ScoreParams()
        p.q = q_ptr
        p.q_src_stride, p.q_row_stride, p.q_heads_per_src = (
            q_src_stride,
            q_row_stride,
            q_heads_per_src,
        )
        p.requests, p.query_len, p.width, p.num_heads = requests, query_len, width, self.num_heads
        p.q_src_magic, p.heads_magic = div_magic(q_heads_per_src), div_magic(self.num_heads)
        p.fp4_lut = self._lut.data_ptr() if self._lut is not None else 0
        p.rank, p.world = self.rank, self.world
        p.init_blocks, p.local_blocks = init_blocks, local_blocks
        p.scale = self.sm_scale
        for i, ptr in enumerate(dst):
            p.dst[i] = ptr
        p.dst_copies, p.shard_columns, p.out_row_stride = (
            dst_copies,
            int(shard_columns),
            out_row_stride,
        )
        p.ident = ident
        # pushed calls: hash what the call reads and compare it across ranks; on a mismatch
        # the kernel fills (address, elements) of this rank's outputs with NaN (select: its
        # ids and scores, poison's address unused)
        p.agree = int(agree)
        p.poison, p.poison_count = poison
        # local calls of the collective transport: (the trailers' offset in each source's
        # slot, its [calls, verdict] state); a kernel after the scoring compares the ranks'
        # trailers and on a mismatch overwrites ``poison`` (the shard) with NaN
        p.trailer, p.local_state = trailer
        if select is not None:  # select_blocks' fused selection
            p.topk, p.heads_per_rank = select.topk, select.heads_per_rank
            p.cand_copies, p.cand = select.cand_copies, select.cand
            for i, ptr in enumerate(select.cand_dst):
                p.cand_dst[i] = ptr
            p.ids_out, p.scores_out = select.ids_out, select.scores_out
        p.err, p.err_host = self.monitor.device_ptr, self.monitor.host_device_ptr
        return structs.image(p)

    def launch(
        self,
        q: torch.Tensor,
        index_cache: layouts.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        params: torch.Tensor,
        *,
        width: int,
        query_len: int,
        push: torch.Tensor | None = None,
        tag: int | None = None,
        cache_key: tuple | None = None,
    ) -> None:
        """One kernel launch on the current stream. ``tag`` (pushed calls): the caller's tag,
        compared with every peer's. ``cache_key``: see :meth:`parts`."""
        kv, ks, fid = self.parts(index_cache, cache_key)
        requests, pushed = block_table.shape[0], push is not None
        key = (
            requests, width, pushed, query_len, fid, WGMMA_MIN_ITEMS_PER_SM, WGMMA_RING_GPUS,
            SPLIT_WARPS, RING_BYTES_PER_SM, RING_MIN_ITEMS_PER_SM, RING_SPLIT_PAGES,
        )  # fmt: skip
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes.put(key, self.grid(requests, width, pushed, query_len, fid))
        word = -1 if tag is None else tag  # int64 on the way in: -1 is NO_TAG's bits
        self.mod.score(
            q, kv, ks, block_table, seq_lens, params, push, fid, shape.wgmma, shape.split,
            shape.grid, word,
        )  # fmt: skip

    def parts(
        self, index_cache: layouts.Cache, cache_key: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """What the binding reads keys through (:func:`cache_parts`) and the kernel instance's
        format id. The views nvfp4 needs are kept per tensor object (a page-major cache's two
        views, a pair's uint8 view of e4m3 scales), valid while that object lives and its
        metadata is unchanged; the binding is always handed uint8 views, as it reads bytes.
        ``cache_key``: the cache's :func:`~cpindex.memo.view_key` (a pair: of each part) as
        validation read it in this call, or None to read it here."""
        if isinstance(index_cache, tuple):
            kv, scales = index_cache
            ks = scales
            if scales.dtype != torch.uint8:
                key = None if cache_key is None else cache_key[1]
                ks = self._scale_bytes.get(scales, key)
                if ks is None:
                    ks = self._scale_bytes.put(scales, scales.view(torch.uint8), key)
            # 8-byte aligned nvfp4 tokens (vLLM's 72-byte tokens): their own kernel
            return kv, ks, structs.NVFP4_NARROW if kv.stride(1) % 16 else self.fmt_id
        if index_cache.dtype != torch.uint8:
            return index_cache, None, self.fmt_id  # bf16/fp8: the cache itself
        # A page-major nvfp4 cache: its views and the kernel instance they take.
        views = self._views.get(index_cache, cache_key)
        if views is None:
            kv, ks = cache_parts(index_cache)
            fid = structs.NVFP4_NARROW if kv.stride(1) % 16 else self.fmt_id
            views = self._views.put(index_cache, (kv, ks, fid), cache_key)
        return views

    def score_local(
        self,
        q: torch.Tensor,
        index_cache: layouts.Cache,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        *,
        init_blocks: int,
        local_blocks: int,
        width: int,
        query_len: int = 1,
        shard: bool = False,
        q_src_stride: int | None = None,
        q_heads_per_src: int | None = None,
        trailer: tuple[int, int] = (0, 0),
        select: SelectTargets | None = None,
        cache_key: tuple | None = None,
    ) -> torch.Tensor:
        """Local mode: this rank's columns for all heads into ``out``, ``[H, rows, width]`` (or
        ``[H, rows, ceil(width / world)]`` with ``shard=True``), ``rows = requests *
        query_len``. ``q`` is ``[.., rows, hps, 128]``; by default one source holding all heads
        (``[rows, H, 128]``). ``trailer`` (the collective transport's agreement): the byte
        offset of the trailers in each source's slot and the address of the int64 ``[calls,
        verdict]`` state; where they disagree ``out`` is all NaN. ``select`` (with
        ``shard=True``): the shard's top ``topk`` per (row, head) go to ``cand_dst`` as keys,
        for :meth:`merge` after they are exchanged. ``cache_key``: see :meth:`parts`. Returns
        the call's parameter image (:meth:`merge` takes it)."""
        requests = block_table.shape[0]
        rows = requests * query_len
        hps = q_heads_per_src or self.num_heads
        cols = out.shape[-1]
        key = (
            requests, query_len, width, init_blocks, local_blocks, shard, out.data_ptr(), cols,
            q_src_stride, hps, trailer, select,
        )  # fmt: skip
        img = self._images.get(key)
        if img is None:
            # What a disagreement poisons: the selection's outputs, else the shard (agreement on)
            if select is not None:
                poison = (0, select.heads_per_rank * rows * select.topk)
            elif trailer[0]:
                poison = (out.data_ptr(), self.num_heads * rows * cols)
            else:
                poison = (0, 0)
            img = self.params(
                requests=requests,
                query_len=query_len,
                width=width,
                init_blocks=init_blocks,
                local_blocks=local_blocks,
                q_src_stride=q_src_stride if q_src_stride is not None else 0,
                q_row_stride=hps * layouts.HEAD_DIM * self.elem,
                q_heads_per_src=hps,
                dst=[out.data_ptr() + h * rows * cols * 4 for h in range(self.num_heads)],
                dst_copies=1,
                shard_columns=shard,
                out_row_stride=cols,
                poison=poison,
                trailer=trailer,
                select=select,
            )
            self._images.put(key, img)
        self.launch(
            q, index_cache, block_table, seq_lens, img, width=width, query_len=query_len,
            cache_key=cache_key,
        )  # fmt: skip
        return img

    def merge(self, params: torch.Tensor) -> None:
        """The merge of a local select call (:meth:`score_local`'s image) once its candidates
        are in ``cand``: ids and scores, NaN and -1 where that call's ranks disagreed."""
        self.mod.merge(params, self.device.index)
