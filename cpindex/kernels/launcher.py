"""Launching the fused kernel from Python: parameter images, launches, error words.

A :class:`KernelScorer` is one call site (fixed format, heads, rank, world). Everything that
depends only on the call's static shape (rows, width, forcing counts) is packed into a struct
image once and cached; a call patches pointers in C++ and launches the instance and grid that
:mod:`.variants` chooses. What a launch derives from its tensors' metadata is cached too
(docs/design.md, "The host path"): that choice per shape, and the nvfp4 views of a cache per
cache tensor (:class:`cpindex.memo.PerTensor`).
"""

from __future__ import annotations

import ctypes as C
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import layouts, quant
from ..errors import BadBlockTableError, BadSlotError, OutOfStepError, PeerTimeoutError
from ..memo import Memo, PerTensor
from . import structs, variants
from .build import device_arch, load

PHASES = {structs.ERR_TIMEOUT_QUERIES: "queries", structs.ERR_TIMEOUT_SCORES: "scores"}


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
        self.fmt, self.fmt_id = fmt, structs.FORMAT_IDS[fmt]
        self.elem = 2 if fmt == "bf16" else 1
        self.build = variants.build_of(device_arch(device), portable=portable)
        self.num_heads, self.rank, self.world, self.sm_scale = num_heads, rank, world, sm_scale
        self.monitor = monitor
        # score_local's parameter images per shape and output (fresh outputs each call: bounded)
        self._images: Memo[torch.Tensor] = Memo()
        self._lut = nvfp4_lut().to(device) if fmt == "nvfp4" else None
        props = torch.cuda.get_device_properties(device)
        self.gpu = variants.Gpu(props.multi_processor_count, props.name, ranks_per_device)
        self._occupancy: dict[variants.Variant, int] = {}
        # grid() per (its arguments and variants' tunables, which tests patch)
        self._shapes: Memo[variants.LaunchShape] = Memo()
        # nvfp4: a page-major cache's (values, scales) views; a pair's e4m3 scales as uint8
        self._views: PerTensor[tuple[torch.Tensor, torch.Tensor, int]] = PerTensor()
        self._scale_bytes: PerTensor[torch.Tensor] = PerTensor()

    def grid(
        self, requests: int, width: int, push: bool, query_len: int = 1, fmt_id: int | None = None
    ) -> variants.LaunchShape:
        """The kernel instance and its persistent grid (:func:`variants.choose`), from static
        sizes only."""
        return variants.choose(
            self.build, self.fmt_id if fmt_id is None else fmt_id, self.gpu, requests=requests,
            width=width, vectors=query_len * self.num_heads, world=self.world, push=push,
            occupancy=self.occupancy,
        )  # fmt: skip

    def occupancy(self, variant: variants.Variant) -> int:
        """CTAs per SM of one kernel instance (asked once: it depends on the instance only)."""
        ctas = self._occupancy.get(variant)
        if ctas is None:
            ctas = self._occupancy[variant] = self.mod.occupancy(*variant)
        return ctas

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
        key = (requests, width, pushed, query_len, fid, variants.tunables())
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes.put(key, self.grid(requests, width, pushed, query_len, fid))
        word = -1 if tag is None else tag  # int64 on the way in: -1 is NO_TAG's bits
        self.mod.score(
            q, kv, ks, block_table, seq_lens, params, push, *shape.variant, shape.grid, word
        )

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
            return kv, ks, variants.cache_format(self.fmt, kv.stride(1))
        if index_cache.dtype != torch.uint8:
            return index_cache, None, self.fmt_id  # bf16/fp8: the cache itself
        # A page-major nvfp4 cache: its views and the kernel instance they take.
        views = self._views.get(index_cache, cache_key)
        if views is None:
            kv, ks = cache_parts(index_cache)
            fid = variants.cache_format(self.fmt, kv.stride(1))
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
