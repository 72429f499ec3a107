"""torch custom ops, so cpindex composes with ``torch.compile`` and graph capture.

* ``cpindex::block_scores``: the fused kernel alone on one device (all heads, all blocks; the
  reference on CPU). Also the no-CP baseline and the "kernel alone" column of the benchmark.
* ``cpindex::score_push``: an :class:`~cpindex.IndexCP` call by handle. Custom ops must return
  fresh tensors, so this returns a copy of the view ``IndexCP.score_push`` returns (one
  ``rows x width`` float copy); eager code should call ``IndexCP.score_push`` directly.
* ``cpindex::select_blocks``: :meth:`~cpindex.IndexCP.select_blocks` by handle; returns copies
  of the ids and the scores (``rows x topk`` each).

Both take the call's ``tag`` and, optionally, a plan by handle (:func:`plan_handle`): the op
then runs the plan form, provided the tensors and counts it is given are the plan's own (they
always are through the eager wrappers, which take a :class:`~cpindex.plan.Plan` in place of
``block_table``); otherwise it runs the positional form, validating them.

All have fake (meta) implementations that only compute output shapes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import formats, reference
from .api import IndexCP
from .config import CPIndexConfig
from .memo import Memo
from .plan import Plan
from .validation import Checker

_instances: weakref.WeakValueDictionary[int, IndexCP] = weakref.WeakValueDictionary()
_plans: weakref.WeakValueDictionary[int, Plan] = weakref.WeakValueDictionary()
_scorers: dict[tuple, object] = {}
#: What formats.detect_format answered for a single tensor of this (dtype, shape): it reads
#: nothing else, and a page-major nvfp4 cache would otherwise be inspected on every call.
_FORMATS: Memo[str] = Memo()


def _split(index_cache: formats.Cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    return index_cache if isinstance(index_cache, tuple) else (index_cache, None)


def _join(cache: torch.Tensor, scales: torch.Tensor | None) -> formats.Cache:
    return cache if scales is None else (cache, scales)


def _kernel_scorer(device: torch.device, fmt: str, heads: int, sm_scale: float):
    from .kernels.launcher import ErrorMonitor, KernelScorer

    key = (device, fmt, heads, sm_scale)
    if key not in _scorers:
        _scorers[key] = KernelScorer(
            device, fmt, num_heads=heads, rank=0, world=1, sm_scale=sm_scale,
            monitor=ErrorMonitor(device, 0),
        )  # fmt: skip
    return _scorers[key]


@functools.lru_cache(maxsize=64)
def _op_checker(heads: int, fmt: str, rows: int, width: int, device: torch.device) -> Checker:
    """The checks one ``block_scores`` call shape is validated with: bounds from the call
    itself, verdicts memoized across calls (cached, not built per call)."""
    cfg = CPIndexConfig(
        num_heads=heads, world_size=1, cache_format=fmt, max_rows=rows, max_width=width
    )
    return Checker(cfg, heads, device)


# The ops are registered with torch.library directly: torch.library.custom_op's Python wrapper
# costs tens of µs per eager call, the dispatcher's own path a few.
_lib = torch.library.Library("cpindex", "DEF")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_lib.define(
    "block_scores(Tensor q, Tensor cache, Tensor? scales, Tensor block_table, Tensor seq_lens, "
    "SymInt init_blocks, SymInt local_blocks, SymInt width, float sm_scale, SymInt query_len=1) "
    "-> Tensor",
    tags=_TAGS,
)
_lib.define(
    "score_push(SymInt handle, Tensor iq, Tensor cache, Tensor? scales, Tensor block_table, "
    "Tensor seq_lens, SymInt init_blocks, SymInt local_blocks, SymInt width, "
    "SymInt query_len=1, SymInt? tag=None, SymInt plan=0) -> Tensor",
    tags=_TAGS,
)
_lib.define(
    "select_blocks(SymInt handle, Tensor iq, Tensor cache, Tensor? scales, Tensor block_table, "
    "Tensor seq_lens, SymInt init_blocks, SymInt local_blocks, SymInt width, "
    "SymInt query_len=1, SymInt topk=16, SymInt? tag=None, SymInt plan=0) -> (Tensor, Tensor)",
    tags=_TAGS,
)


def _register(name: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Registers the decorated function as ``cpindex::name``'s kernel on the devices cpindex
    runs on (CUDA covers HIP), and ``fake`` as its fake (meta) implementation."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        for key in ("CPU", "CUDA"):
            _lib.impl(name, fn, key)
        torch.library.register_fake(f"cpindex::{name}", fake, lib=_lib)
        return fn

    return wrap


def _block_scores_fake(q, cache, scales, block_table, seq_lens, init, local, width, sm_scale, t=1):
    return q.new_empty((q.shape[1], q.shape[0], width), dtype=torch.float32)


@_register("block_scores", _block_scores_fake)
def _block_scores(
    q: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    width: int,
    sm_scale: float,
    query_len: int = 1,
) -> torch.Tensor:
    index_cache = _join(cache, scales)
    shape = q.shape
    if len(shape) != 3:
        raise ValueError(f"q: expected [rows, heads, 128], got {list(shape)}")
    rows, heads = shape[0], shape[1]
    fmt = "nvfp4" if scales is not None else _FORMATS.get((cache.dtype, cache.shape))
    if fmt is None:  # a new kind of cache, or one it cannot tell (it raises)
        fmt = _FORMATS.put((cache.dtype, cache.shape), formats.detect_format(index_cache))
    device = q.device
    checker = _op_checker(heads, fmt, max(1, rows), max(1, width), device)
    call = checker.call(
        q, index_cache, block_table, seq_lens, init_blocks, local_blocks, width, query_len
    )
    if device.type != "cuda":
        return reference.block_scores(
            q, index_cache, block_table, seq_lens, init_blocks=init_blocks,
            local_blocks=local_blocks, width=width, sm_scale=sm_scale, query_len=query_len,
        )  # fmt: skip
    scorer = _kernel_scorer(device, fmt, heads, sm_scale)
    scorer.monitor.check()
    out = torch.empty(heads, rows, width, device=device)
    scorer.score_local(
        q, index_cache, block_table, seq_lens, out,
        init_blocks=init_blocks, local_blocks=local_blocks, width=width, query_len=query_len,
        cache_key=call.cache_key,
    )  # fmt: skip
    return out


def block_scores(
    q: torch.Tensor,
    index_cache: formats.Cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    init_blocks: int = 0,
    local_blocks: int = 1,
    width: int | None = None,
    sm_scale: float = 128**-0.5,
    query_len: int = 1,
) -> torch.Tensor:
    """All heads' scores ``[H, rows, width]`` on one device: the fused kernel on GPU, the
    reference on CPU. ``q`` is ``[requests * query_len, H, 128]`` (H <= 8), ``block_table`` and
    ``seq_lens`` one row per request. Inputs are validated like ``score_push``'s. Inside
    ``torch.compile`` call ``torch.ops.cpindex.block_scores`` with the same arguments (cache
    and nvfp4 scales as two tensors, scales ``None`` otherwise).

    An eager call that the dispatcher would hand straight to the op's kernel calls that kernel
    itself (:func:`_direct`): the same checks and result, without the dispatcher's cost."""
    cache, scales = _split(index_cache)
    width = block_table.shape[1] if width is None else width
    sm_scale = float(sm_scale)
    if (
        type(init_blocks) is int
        and type(local_blocks) is int
        and type(width) is int
        and type(query_len) is int
        and _direct(q, cache, scales, block_table, seq_lens)
    ):
        return _block_scores(
            q, cache, scales, block_table, seq_lens, init_blocks, local_blocks, width, sm_scale,
            query_len,
        )  # fmt: skip
    return torch.ops.cpindex.block_scores(
        q, cache, scales, block_table, seq_lens, init_blocks, local_blocks, width, sm_scale,
        query_len,
    )  # fmt: skip


_Tensor = torch.Tensor
_no_interpreter = torch._C._functorch.peek_interpreter_stack


def _direct(
    q: object, cache: object, scales: object, block_table: object, seq_lens: object
) -> bool:
    """Whether the dispatcher would run ``cpindex::block_scores`` eagerly as a plain call of
    :func:`_block_scores` (the kernel registered for CPU and CUDA), so that the eager wrapper may
    call it itself: every tensor a plain ``torch.Tensor`` (no subclass such as a fake tensor) on
    the CPU or a GPU (meta tensors take the fake kernel), none needing a gradient (the autograd
    fallback would record one), and nothing the dispatcher hands an op to first: no
    ``torch.compile`` tracing, torch dispatch mode (``FakeTensorMode``), torch function mode,
    functorch transform or ``torch.jit`` tracer. Otherwise the call goes through the op."""
    return (
        type(q) is _Tensor
        and type(cache) is _Tensor
        and type(block_table) is _Tensor
        and type(seq_lens) is _Tensor
        and (scales is None or type(scales) is _Tensor)
        and (q.is_cuda or q.is_cpu)
        and (cache.is_cuda or cache.is_cpu)
        and (block_table.is_cuda or block_table.is_cpu)
        and (seq_lens.is_cuda or seq_lens.is_cpu)
        and (scales is None or scales.is_cuda or scales.is_cpu)
        and not q.requires_grad
        and not cache.requires_grad
        and (scales is None or not scales.requires_grad)
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._len_torch_function_stack() == 0
        and _no_interpreter() is None
        and torch._C._get_tracing_state() is None
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _plan_of(
    handle: int,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    width: int,
    query_len: int,
) -> Plan | None:
    """The plan named by ``handle`` if these are its inputs, else None (the positional form
    then validates them)."""
    p = _plans.get(handle) if handle else None
    if p is None:
        return None
    same = (p.init_blocks, p.local_blocks, p.width, p.query_len) == (
        init_blocks, local_blocks, width, query_len,
    )  # fmt: skip
    if same and _same(p.block_table, block_table) and _same(p.seq_lens, seq_lens):
        return p
    return None


def _unpack(
    block_table: torch.Tensor | Plan,
    seq_lens: torch.Tensor | None,
    init_blocks: int,
    local_blocks: int,
    width: int | None,
    query_len: int,
) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int]:
    """The op's arguments for a plan or the positional form, and the plan's handle (0: none)."""
    if isinstance(block_table, Plan):
        p = block_table
        if seq_lens is not None:
            raise TypeError("plan: pass either a plan or block_table and seq_lens, not both")
        return (
            p.block_table, p.seq_lens, p.init_blocks, p.local_blocks, p.width, p.query_len,
            plan_handle(p),
        )  # fmt: skip
    width = block_table.shape[1] if width is None else width
    return block_table, seq_lens, init_blocks, local_blocks, width, query_len, 0  # type: ignore[return-value]


def _score_push_fake(handle, iq, cache, scales, bt, sl, init, local, width, t=1, tag=None, plan=0):
    # heads_per_rank from iq's shape, not the handle: dynamo may turn the handle into a SymInt
    hpr = iq.shape[1] if iq.dim() == 3 else 1
    return iq.new_empty((hpr, iq.shape[0], width), dtype=torch.float32)


@_register("score_push", _score_push_fake)
def _score_push(
    handle: int,
    iq: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    width: int,
    query_len: int = 1,
    tag: int | None = None,
    plan: int = 0,
) -> torch.Tensor:
    cp = _instances[handle]
    p = _plan_of(plan, block_table, seq_lens, init_blocks, local_blocks, width, query_len)
    if p is not None:
        out = cp.score_push(iq, _join(cache, scales), p, tag=tag)
    else:
        out = cp.score_push(
            iq, _join(cache, scales), block_table, seq_lens, init_blocks, local_blocks, width,
            query_len=query_len, tag=tag,
        )  # fmt: skip
    return out.clone()


def score_push(
    cp: IndexCP,
    iq: torch.Tensor,
    index_cache: formats.Cache,
    block_table: torch.Tensor | Plan,
    seq_lens: torch.Tensor | None = None,
    init_blocks: int = 0,
    local_blocks: int = 1,
    width: int | None = None,
    *,
    query_len: int = 1,
    tag: int | None = None,
) -> torch.Tensor:
    """``cp.score_push(...)`` as a custom op (returns a copy): with a plan
    (``score_push(cp, iq, index_cache, plan, tag=...)``) or the positional form. Inside
    ``torch.compile`` call ``torch.ops.cpindex.score_push(handle(cp), iq, cache, scales,
    block_table, seq_lens, init_blocks, local_blocks, width, query_len, tag, plan_handle(plan))``
    with the handles taken outside."""
    cache, scales = _split(index_cache)
    bt, sl, init, local, w, t, ph = _unpack(
        block_table, seq_lens, init_blocks, local_blocks, width, query_len
    )
    return torch.ops.cpindex.score_push(
        handle(cp), iq, cache, scales, bt, sl, init, local, w, t, tag, ph
    )


def _select_blocks_fake(
    handle, iq, cache, scales, bt, sl, init, local, width, t=1, topk=16, tag=None, plan=0
):
    hpr = iq.shape[1] if iq.dim() == 3 else 1  # from iq, not the handle (see score_push's)
    shape = (hpr, iq.shape[0], topk)
    return iq.new_empty(shape, dtype=torch.int32), iq.new_empty(shape, dtype=torch.float32)


@_register("select_blocks", _select_blocks_fake)
def _select_blocks(
    handle: int,
    iq: torch.Tensor,
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    width: int,
    query_len: int = 1,
    topk: int = 16,
    tag: int | None = None,
    plan: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    cp = _instances[handle]
    p = _plan_of(plan, block_table, seq_lens, init_blocks, local_blocks, width, query_len)
    if p is not None:
        ids, scores = cp.select_blocks(
            iq, _join(cache, scales), p, topk=topk, return_scores=True, tag=tag
        )
    else:
        ids, scores = cp.select_blocks(
            iq, _join(cache, scales), block_table, seq_lens, init_blocks, local_blocks, width,
            query_len=query_len, topk=topk, return_scores=True, tag=tag,
        )  # fmt: skip
    return ids.clone(), scores.clone()


def select_blocks(
    cp: IndexCP,
    iq: torch.Tensor,
    index_cache: formats.Cache,
    block_table: torch.Tensor | Plan,
    seq_lens: torch.Tensor | None = None,
    init_blocks: int = 0,
    local_blocks: int = 1,
    width: int | None = None,
    *,
    query_len: int = 1,
    topk: int = 16,
    tag: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cp.select_blocks(..., return_scores=True)`` as a custom op: copies of the int32 ids and
    float32 scores ``[heads_per_rank, rows, topk]``; with a plan or the positional form. Inside
    ``torch.compile`` call ``torch.ops.cpindex.select_blocks(handle(cp), ..., query_len, topk,
    tag, plan_handle(plan))`` with the handles taken outside."""
    cache, scales = _split(index_cache)
    bt, sl, init, local, w, t, ph = _unpack(
        block_table, seq_lens, init_blocks, local_blocks, width, query_len
    )
    return torch.ops.cpindex.select_blocks(
        handle(cp), iq, cache, scales, bt, sl, init, local, w, t, topk, tag, ph
    )


def handle(cp: IndexCP) -> int:
    """An int naming ``cp`` for the ``cpindex::score_push`` and ``cpindex::select_blocks`` ops
    (kept while ``cp`` lives)."""
    _instances[id(cp)] = cp
    return id(cp)


def plan_handle(plan: Plan) -> int:
    """An int naming ``plan`` for the ``cpindex::score_push`` and ``cpindex::select_blocks``
    ops (kept while ``plan`` lives)."""
    _plans[id(plan)] = plan
    return id(plan)
