"""Input checks of ``score_push``, ``select_blocks`` and :meth:`IndexCP.plan`: the one place
they live, run before anything is launched.

Transports trust what reaches them. Shape, dtype, device and size checks are host-only and run
on every call. Checks that read tensor *contents* (``width`` and ``block_table`` wide enough for
the longest row, page indices inside the cache) run here only when the tensors are on the CPU,
where they are free. On a GPU they would cost a device sync per call and break graph capture,
so the fused kernel makes them instead and records a failure in its error word, which the next
call (or :meth:`cpindex.IndexCP.check`) raises as :class:`~cpindex.BadBlockTableError`.

A step's shared inputs (block table, lengths, query length, forcing counts, width) are checked
once by :meth:`Checker.plan`, which records what it checked in the plan; each call then checks
its own ``iq`` and cache against the plan, and that the plan still is what was checked
(:meth:`Checker.planned`: a plan whose tensors were resized in place, or whose fields were
replaced, is refused, naming what changed). Any exception an argument raises while being checked
(an exotic tensor whose attributes raise) is reported as a ``TypeError`` naming that argument,
so a rank's bad input is always a refusal its peers hear about, never a crash inside the call.

A :class:`Checker` runs these checks for one instance (or op call site) and memoizes the verdicts
of the metadata checks, so a call whose tensors look like an earlier call's costs a few
dictionary lookups (docs/design.md, "The host path").
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral
from typing import Any, TypeVar

import torch

from . import fingerprint, formats
from .config import CPIndexConfig
from .memo import Memo, check_key, view_key
from .plan import Call, Plan

T = TypeVar("T")

#: Tags are compared across ranks as 64-bit values (the kernel keeps them in a u64 flag word).
TAG_LIMIT = 1 << 63


def _guarded(name: str, check: Callable[..., T], *args: Any) -> T:
    """Run ``check(*args)``; anything but the TypeError/ValueError it means to raise becomes a
    TypeError naming ``name`` (a nested or otherwise exotic tensor whose attributes raise)."""
    try:
        return check(*args)
    except (TypeError, ValueError):
        raise
    except Exception as e:
        raise TypeError(
            f"{name}: unsupported argument ({type(e).__name__}: {e}); expected a plain dense tensor"
        ) from e


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout)
        raise TypeError(f"{name}: expected a dense (strided) tensor, got a {kind} tensor")
    return t


def _count(name: str, v: object, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected {bound}, got {v}")
    return v


def _on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {_desc(t)}")


def _aligned(name: str, t: torch.Tensor, *, pages: bool = False) -> None:
    """The kernel reads 16 bytes at a time: a view that starts (or, for a cache, whose pages
    start) off a 16-byte boundary would fault on the GPU, so it is refused here."""
    if t.data_ptr() % 16:
        raise ValueError(
            f"{name}: data must start on a 16-byte boundary (the kernel reads 16 bytes at a "
            f"time); this view starts {t.data_ptr() % 16} bytes past one"
        )
    if pages and t.dim() > 1 and t.shape[0] > 1 and t.stride(0) * t.element_size() % 16:
        raise ValueError(
            f"{name}: pages must be a multiple of 16 bytes apart (the kernel reads 16 bytes "
            f"at a time), got a page stride of {t.stride(0) * t.element_size()} bytes"
        )


def _nvfp4_tokens_aligned(cache: formats.Cache) -> None:
    """The kernel reads a token's nvfp4 values 8 or 16 bytes at a time (16 when tokens lie a
    multiple of 16 bytes apart, as in a page-major cache; else 8, as in the pair views of a
    token-interleaved cache's 72-byte tokens) and its two scales of a lane as one 2-byte word.
    A page-major tensor always passes (token strides 64 and 8); only a pair can fail."""
    values, scales = formats.nvfp4_views(cache, checked=True)
    pair = isinstance(cache, tuple)
    if values.stride(1) % 8:
        raise ValueError(
            f"{'index_cache[0]' if pair else 'index_cache'}: nvfp4 value tokens must lie a "
            f"multiple of 8 bytes apart (the kernel reads them 8 or 16 bytes at a time), got a "
            f"token stride of {values.stride(1)} bytes"
        )
    if scales.stride(1) % 2:
        raise ValueError(
            f"{'index_cache[1]' if pair else 'index_cache'}: nvfp4 scale tokens must lie an "
            f"even number of bytes apart (the kernel reads two scales as one 2-byte word), got "
            f"a token stride of {scales.stride(1)} bytes"
        )


def check_tag(tag: object) -> int | None:
    """``None`` or an int in ``[0, 2**63)``."""
    if tag is None or (type(tag) is int and 0 <= tag < TAG_LIMIT):
        return tag  # the common cases, without the ABC check below
    if isinstance(tag, bool) or not isinstance(tag, Integral):
        raise TypeError(f"tag: expected an int or None, got {type(tag).__name__}")
    tag = int(tag)
    if not 0 <= tag < TAG_LIMIT:
        raise ValueError(f"tag: expected in [0, 2**63), got {tag}")
    return tag


def _iq(cfg: CPIndexConfig, heads_per_rank: int, device: torch.device, iq: object) -> torch.Tensor:
    iq = _tensor("iq", iq)
    qdt = formats.query_dtype(cfg.cache_format)
    if iq.dtype != qdt:
        raise TypeError(
            f"iq: expected {qdt} for cache_format '{cfg.cache_format}', got {_desc(iq)}"
        )
    given = iq
    if iq.dim() == 2 and heads_per_rank == 1:
        iq = iq.unsqueeze(1)
    if iq.dim() != 3 or iq.shape[1:] != (heads_per_rank, cfg.head_dim):
        raise ValueError(
            f"iq: expected [rows, {heads_per_rank}, {cfg.head_dim}]"
            + (f" or [rows, {cfg.head_dim}]" if heads_per_rank == 1 else "")
            + f", got {_desc(given)}"
        )
    if not iq.is_contiguous():
        raise ValueError(f"iq: expected a contiguous tensor, got strides {iq.stride()}")
    _on("iq", iq, device)
    _aligned("iq", iq)
    rows = iq.shape[0]
    if not 1 <= rows <= cfg.max_rows:
        raise ValueError(f"iq: rows must be in [1, max_rows={cfg.max_rows}], got {rows}")
    return iq


def _part_name(index_cache: object, k: int) -> str:
    return f"index_cache[{k}]" if isinstance(index_cache, tuple) else "index_cache"


def _cache(cfg: CPIndexConfig, device: torch.device, index_cache: object) -> formats.Cache:
    if not isinstance(index_cache, (torch.Tensor, tuple)):
        raise TypeError(
            f"index_cache: expected a tensor (or a (packed, scales) pair for nvfp4), "
            f"got {type(index_cache).__name__}"
        )
    parts = index_cache if isinstance(index_cache, tuple) else (index_cache,)
    for k, part in enumerate(parts):
        if isinstance(part, torch.Tensor):
            _tensor(_part_name(index_cache, k), part)
    formats.check_cache(index_cache, cfg.cache_format)
    for k, part in enumerate(parts):
        _on(_part_name(index_cache, k), part, device)
        _aligned(_part_name(index_cache, k), part, pages=True)
    if cfg.cache_format == "nvfp4":
        _nvfp4_tokens_aligned(index_cache)
    return index_cache


def _block_table(device: torch.device, block_table: object) -> torch.Tensor:
    block_table = _tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(
            f"block_table: expected torch.int32 [requests, max_blocks], got {_desc(block_table)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] < 1 or block_table.shape[1] < 1:
        raise ValueError(
            "block_table: expected torch.int32 [requests >= 1, max_blocks >= 1] (one row per "
            f"request), got {_desc(block_table)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(
            f"block_table: rows must be contiguous, got strides {block_table.stride()}"
        )
    _on("block_table", block_table, device)
    return block_table


def _seq_lens(device: torch.device, seq_lens: object, requests: int) -> torch.Tensor:
    seq_lens = _tensor("seq_lens", seq_lens)
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens: expected torch.int32 [{requests}], got {_desc(seq_lens)}")
    if seq_lens.shape != (requests,):
        raise ValueError(
            f"seq_lens: expected torch.int32 [{requests}] (one length per request), "
            f"got {_desc(seq_lens)}"
        )
    if not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens: expected a contiguous tensor, got strides {list(seq_lens.stride())}"
        )
    _on("seq_lens", seq_lens, device)
    return seq_lens


def _plan_args(
    cfg: CPIndexConfig,
    device: torch.device,
    block_table: object,
    seq_lens: object,
    query_len: int,
    init_blocks: object,
    local_blocks: object,
    width: object,
) -> int:
    """Every metadata check of a plan's arguments, in the order they are reported; returns the
    width (``None``: ``block_table.shape[1]``)."""
    bt = _guarded("block_table", _block_table, device, block_table)
    requests = bt.shape[0]
    if requests * query_len > cfg.max_rows:
        raise ValueError(
            f"block_table: {requests} requests x query_len {query_len} = "
            f"{requests * query_len} rows, more than max_rows={cfg.max_rows}"
        )
    _guarded("seq_lens", _seq_lens, device, seq_lens, requests)
    init_blocks = _count("init_blocks", init_blocks, 0)
    local_blocks = _count("local_blocks", local_blocks, 0)
    # Forcing counts past max_width (at most 2**20) force nothing more; bounding them keeps
    # every count the kernel receives inside its C int (rows <= max_rows <= 65536 likewise).
    for name, v in (("init_blocks", init_blocks), ("local_blocks", local_blocks)):
        if v > cfg.max_width:
            raise ValueError(f"{name}: expected <= max_width ({cfg.max_width}), got {v}")
    if width is None:
        width = bt.shape[1]
    return _count("width", width, 1, cfg.max_width)


_SIZE_NAMES = (
    "block_table's dtype", "block_table's shape", "block_table's strides",
    "seq_lens' dtype", "seq_lens' shape", "seq_lens' strides",
    "query_len", "init_blocks", "local_blocks", "width", "device",
)  # fmt: skip


def _changed(plan: Plan, device: torch.device) -> ValueError:
    """The error for a plan that no longer matches what :meth:`Checker.plan` checked, or was
    checked for another device than ``device``."""
    if plan.checked is None:
        return ValueError(
            "plan: not made by IndexCP.plan (a Plan built directly records no checks); make "
            "it with this instance's plan()"
        )
    try:
        now = plan.record()
    except Exception as e:  # a field replaced by something without a shape
        return ValueError(f"plan: changed since plan() checked it ({type(e).__name__}: {e})")
    if plan.checked == now:
        return ValueError(f"plan: its tensors are on {now[-1]}, this instance on {device}")
    diffs = [
        f"{name} {tuple(a) if isinstance(a, torch.Size) else a} -> "
        f"{tuple(b) if isinstance(b, torch.Size) else b}"
        for name, a, b in zip(_SIZE_NAMES, plan.checked, now, strict=True)
        if a != b
    ]
    return ValueError(
        "plan: changed since plan() checked it (" + "; ".join(diffs) + "): a plan's tensors "
        "must keep their shapes and its fields their values; make a new plan"
    )


class Checker:
    """The input checks of one call site: a configuration, its heads per rank and its device,
    and the fingerprint slot its plans carry (None: calls compare none).

    Checks that read only metadata are memoized (:mod:`cpindex.memo`): a passing verdict is
    stored under :func:`~cpindex.memo.check_key` of every tensor the check read (type, dtype,
    shape, strides, device, alignment) and the plain arguments it read. Only passing verdicts
    are stored, so an input that matches a stored key passes exactly the checks it passed
    before, and any other input runs them all, in the order they are reported (a warm cache
    never skips a check a new input fails). Contents are never memoized: CPU tensors' are
    checked, and the plan's fingerprint recomputed, on every call."""

    def __init__(
        self,
        cfg: CPIndexConfig,
        heads_per_rank: int,
        device: torch.device,
        fingerprint: torch.Tensor | None = None,
    ) -> None:
        self.cfg, self.heads_per_rank, self.device = cfg, heads_per_rank, device
        self.fingerprint = fingerprint
        self.on_cpu = device.type == "cpu"
        self._max_query_len = cfg.max_query_len
        self._iqs: Memo[bool] = Memo()
        self._caches: Memo[bool] = Memo()
        self._plans: Memo[int] = Memo()  # plan arguments -> the resolved width

    def query_len(self, query_len: object) -> int:
        if type(query_len) is int and 1 <= query_len <= self._max_query_len:
            return query_len
        return _count("query_len", query_len, 1, self._max_query_len)

    def iq(self, iq: object) -> tuple[torch.Tensor, int]:
        """``iq`` as ``[rows, heads_per_rank, 128]``, and its rows."""
        try:
            key = check_key(iq)
        except Exception:  # not a plain tensor: the full check says what it is
            key = None
        if key is None or key not in self._iqs:
            q = _guarded("iq", _iq, self.cfg, self.heads_per_rank, self.device, iq)
            if key is not None:
                self._iqs.put(key, True)
            return q, q.shape[0]
        shape = key[2]
        return (iq.unsqueeze(1) if len(shape) == 2 else iq), shape[0]  # type: ignore[union-attr]

    def cache(self, index_cache: object) -> tuple[formats.Cache, tuple | None]:
        """The cache, and its :func:`~cpindex.memo.view_key` (a pair: of each part; None
        where it has none). Keyed by the whole address, not its alignment alone: a layer's
        cache stays where it is, and the launch reuses the key (``Call.cache_key``)."""
        try:
            if isinstance(index_cache, tuple):
                packed, scales = index_cache  # not a pair: no key, the full check says so
                key: tuple | None = (view_key(packed), view_key(scales))
            else:
                key = view_key(index_cache)
        except Exception:
            key = None
        if key is None or key not in self._caches:
            _guarded("index_cache", _cache, self.cfg, self.device, index_cache)
            if key is not None:
                self._caches.put(key, True)
        return index_cache, key  # type: ignore[return-value]

    def plan(
        self,
        block_table: object,
        seq_lens: object,
        *,
        query_len: object = 1,
        init_blocks: object = 0,
        local_blocks: object = 1,
        width: object = None,
    ) -> Plan:
        """A step's shared inputs, validated (``TypeError``/``ValueError`` naming the
        argument); ``width`` None takes ``block_table.shape[1]``. The plan records what was
        checked (:attr:`Plan.checked`) and carries this checker's fingerprint slot, not yet
        computed (every call computes it)."""
        query_len = self.query_len(query_len)
        key = None
        # Exact ints only in a key: True == 1 and hashes alike, but is refused.
        if (
            type(init_blocks) is int
            and type(local_blocks) is int
            and (width is None or type(width) is int)
        ):
            try:
                key = (
                    check_key(block_table), check_key(seq_lens), query_len, init_blocks,
                    local_blocks, width,
                )  # fmt: skip
            except Exception:
                key = None
        w = self._plans.get(key) if key is not None else None
        if w is None:
            w = _plan_args(
                self.cfg, self.device, block_table, seq_lens, query_len, init_blocks,
                local_blocks, width,
            )  # fmt: skip
            if key is not None:
                self._plans.put(key, w)
        plan = Plan(
            block_table, seq_lens, query_len, init_blocks, local_blocks, w,  # type: ignore[arg-type]
            self.fingerprint, self.cfg,
        )  # fmt: skip
        object.__setattr__(plan, "checked", plan.record())
        if self.on_cpu:
            _check_contents(plan, None)
        return plan

    def planned(self, iq: object, index_cache: object, plan: object, tag: object = None) -> Call:
        """One call with a plan, validated: the plan's origin and that it still is what
        :meth:`plan` checked, ``iq`` against it, the cache, the tag. On the CPU the plan's
        contents are checked again (against this cache's pages). The plan's fingerprint is
        recomputed: the tensors' contents may have changed since the plan was made."""
        if not isinstance(plan, Plan):
            raise TypeError(
                f"plan: expected a cpindex Plan (IndexCP.plan), got {type(plan).__name__}"
            )
        cfg = self.cfg
        if plan.config is not cfg and plan.config != cfg:
            raise ValueError(
                "plan: made by an IndexCP with another configuration (or not by IndexCP.plan); "
                "make it with this instance's plan()"
            )
        try:  # plan.record() inline, the device as this instance's: the hot path
            bt, sl = plan.block_table, plan.seq_lens
            shape = bt.shape
            same = plan.checked == (
                bt.dtype, shape, bt.stride(), sl.dtype, sl.shape, sl.stride(), plan.query_len,
                plan.init_blocks, plan.local_blocks, plan.width, self.device,
            )  # fmt: skip
        except Exception:
            same = False
        if not same:
            raise _changed(plan, self.device)
        if tag is not None and (type(tag) is not int or not 0 <= tag < TAG_LIMIT):
            tag = check_tag(tag)
        iq, rows = self.iq(iq)
        if rows != shape[0] * plan.query_len:
            raise ValueError(
                f"iq: expected {plan.rows} rows (the plan's {plan.requests} requests x "
                f"query_len {plan.query_len}), got {rows}"
            )
        index_cache, key = self.cache(index_cache)
        if self.on_cpu:
            _check_contents(plan, index_cache)
        fp = self.fingerprint
        if plan.fingerprint is not fp:  # another instance's plan, or a bare one
            plan = plan.with_fingerprint(fp)
        if fp is not None:
            # The fingerprint of the tensors' current contents, which may have changed in
            # place since the plan was made (one launch on a GPU, captured with the call).
            plan.refresh()
        # Call(...) without the named tuple's Python-level __new__: made on every call
        return tuple.__new__(Call, (iq, index_cache, plan, tag, key))  # type: ignore[return-value]


def check_topk(cfg: CPIndexConfig, topk: object, return_scores: object = False) -> int:
    """Validates ``select_blocks``' own arguments; raises ``TypeError``/``ValueError`` naming
    them. ``topk`` is bounded by ``config.max_topk``, which sized the result buffers."""
    if type(topk) is int and 1 <= topk <= cfg.max_topk and type(return_scores) is bool:
        return topk
    topk = _count("topk", topk, 1)
    if topk > cfg.max_topk:
        raise ValueError(f"topk: expected in [1, config.max_topk={cfg.max_topk}], got {topk}")
    if not isinstance(return_scores, bool):
        raise TypeError(f"return_scores: expected a bool, got {type(return_scores).__name__}")
    return topk


def _check_contents(plan: Plan, index_cache: formats.Cache | None) -> None:
    """Checks that read CPU tensors' contents (see the module docstring); the page check only
    with a cache."""
    seq_lens, block_table, query_len = plan.seq_lens, plan.block_table, plan.query_len
    short = (seq_lens < query_len).nonzero()
    if short.numel():
        r = int(short[0, 0])
        raise ValueError(
            f"seq_lens: request {r} has length {int(seq_lens[r])}, but each request's length "
            f"counts its own query tokens, so it must be >= query_len ({query_len})"
        )
    longest = int(seq_lens.max())
    need = -(-longest // fingerprint.BLOCK_SIZE)
    if need > plan.width:
        raise ValueError(
            f"width: the longest row ({longest} tokens) needs {need} columns, got "
            f"width={plan.width}"
        )
    if need > block_table.shape[1]:
        raise ValueError(
            f"block_table: the longest row ({longest} tokens) needs {need} blocks, "
            f"got max_blocks={block_table.shape[1]}"
        )
    if index_cache is not None:
        _check_pages(plan, index_cache)


def _check_pages(plan: Plan, index_cache: formats.Cache) -> None:
    """Every page the scan reads lies inside ``index_cache`` (CPU tensors)."""
    block_table = plan.block_table
    pages = (index_cache[0] if isinstance(index_cache, tuple) else index_cache).shape[0]
    n = (plan.seq_lens.to(torch.int64) + fingerprint.BLOCK_SIZE - 1) // fingerprint.BLOCK_SIZE
    j = torch.arange(block_table.shape[1])
    scanned = (j < (n - plan.local_blocks).unsqueeze(1)) & (j >= plan.init_blocks)
    used = block_table[scanned]
    bad = (used < 0) | (used >= pages)
    if bad.any():
        row, col = scanned.nonzero()[bad.nonzero()[0, 0]].tolist()
        raise ValueError(
            f"block_table: row {row}, block {col} names page {int(block_table[row, col])}, "
            f"outside index_cache's {pages} pages"
        )
