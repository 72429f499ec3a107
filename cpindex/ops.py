"""torch custom ops, so cpindex composes with ``torch.compile`` and graph capture.

* ``cpindex::block_scores``: the fused kernel alone on one device (all heads, all blocks; the
  reference on CPU). Also the no-CP baseline and the "kernel alone" column of the benchmark.
* ``cpindex::score_push``: ``IndexCP.score_push(iq, index_cache, plan, tag=tag)`` with the
  instance and the plan by handle (:func:`handle`, :func:`plan_handle`). Custom ops must return
  fresh tensors, so this returns a copy of the view ``IndexCP.score_push`` returns (one
  ``rows x width`` float copy); eager code should call ``IndexCP.score_push`` directly.
* ``cpindex::select_blocks``: :meth:`~cpindex.IndexCP.select_blocks` likewise; returns copies
  of the ids and the scores (``rows x topk`` each).

Both also take the plan's ``block_table``, ``seq_lens`` and ``width``: the tensors so that a
compiled graph orders the op after writes into them, the width for the fake implementation's
output shape. They must be the plan's own (the eager wrappers pass them); anything else is
refused with a ``ValueError``.

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
_PLAN_ARGS = "SymInt plan, Tensor block_table, Tensor seq_lens, SymInt width"
_lib.define(
    f"score_push(SymInt handle, Tensor iq, Tensor cache, Tensor? scales, {_PLAN_ARGS}, "
    "SymInt? tag=None) -> Tensor",
    tags=_TAGS,
)
_lib.define(
    f"select_blocks(SymInt handle, Tensor iq, Tensor cache, Tensor? scales, {_PLAN_ARGS}, "
    "SymInt topk=16, SymInt? tag=None) -> (Tensor, Tensor)",
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
    plan = checker.plan(
        block_table, seq_lens, query_len=query_len, init_blocks=init_blocks,
        local_blocks=local_blocks, width=width,
    )  # fmt: skip
    call = checker.planned(q, index_cache, plan)
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


def _plan_of(handle: int, block_table: torch.Tensor, seq_lens: torch.Tensor, width: int) -> Plan:
    """The plan named by ``handle``, checked to be the one these arguments describe."""
    p = _plans.get(handle)
    if p is None:
        raise ValueError(f"plan: no live plan has handle {handle} (ops.plan_handle(plan))")
    bt, sl = p.block_table, p.seq_lens
    if not (
        p.width == width
        and bt.data_ptr() == block_table.data_ptr()
        and bt.shape == block_table.shape
        and sl.data_ptr() == seq_lens.data_ptr()
        and sl.shape == seq_lens.shape
    ):
        raise ValueError(
            "plan: block_table, seq_lens and width must be the plan's own "
            "(plan.block_table, plan.seq_lens, plan.width)"
        )
    return p


def _score_push_fake(handle, iq, cache, scales, plan, block_table, seq_lens, width, tag=None):
    # heads_per_rank from iq's shape, not the handle: dynamo may turn the handle into a SymInt
    hpr = iq.shape[1] if iq.dim() == 3 else 1
    return iq.new_empty((hpr, iq.shape[0], width), dtype=torch.float32)


@_register("score_push", _score_push_fake)
def _score_push(handle, iq, cache, scales, plan, block_table, seq_lens, width, tag=None):
    p = _plan_of(plan, block_table, seq_lens, width)
    return _instances[handle].score_push(iq, _join(cache, scales), p, tag=tag).clone()


def score_push(
    cp: IndexCP, iq: torch.Tensor, index_cache: formats.Cache, plan: Plan, *, tag: int | None = None
) -> torch.Tensor:
    """``cp.score_push(iq, index_cache, plan, tag=tag)`` as a custom op (returns a copy).
    Inside ``torch.compile`` call ``torch.ops.cpindex.score_push(handle(cp), iq, cache,
    scales, plan_handle(plan), plan.block_table, plan.seq_lens, plan.width, tag)`` with the
    handles taken outside."""
    cache, scales = _split(index_cache)
    return torch.ops.cpindex.score_push(
        handle(cp), iq, cache, scales, plan_handle(plan), plan.block_table, plan.seq_lens,
        plan.width, tag,
    )  # fmt: skip


def _select_blocks_fake(handle, iq, cache, scales, plan, block_table, seq_lens, width, topk=16,
                        tag=None):  # fmt: skip
    hpr = iq.shape[1] if iq.dim() == 3 else 1  # from iq, not the handle (see score_push's)
    shape = (hpr, iq.shape[0], topk)
    return iq.new_empty(shape, dtype=torch.int32), iq.new_empty(shape, dtype=torch.float32)


@_register("select_blocks", _select_blocks_fake)
def _select_blocks(handle, iq, cache, scales, plan, block_table, seq_lens, width, topk=16,
                   tag=None):  # fmt: skip
    p = _plan_of(plan, block_table, seq_lens, width)
    ids, scores = _instances[handle].select_blocks(
        iq, _join(cache, scales), p, topk=topk, tag=tag, return_scores=True
    )
    return ids.clone(), scores.clone()


def select_blocks(
    cp: IndexCP,
    iq: torch.Tensor,
    index_cache: formats.Cache,
    plan: Plan,
    *,
    topk: int = 16,
    tag: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cp.select_blocks(iq, index_cache, plan, topk=topk, tag=tag, return_scores=True)`` as
    a custom op: copies of the int32 ids and float32 scores ``[heads_per_rank, rows, topk]``.
    Inside ``torch.compile`` call ``torch.ops.cpindex.select_blocks(handle(cp), iq, cache,
    scales, plan_handle(plan), plan.block_table, plan.seq_lens, plan.width, topk, tag)`` with
    the handles taken outside."""
    cache, scales = _split(index_cache)
    return torch.ops.cpindex.select_blocks(
        handle(cp), iq, cache, scales, plan_handle(plan), plan.block_table, plan.seq_lens,
        plan.width, topk, tag,
    )  # fmt: skip


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
