"""Bad input to ``IndexCP.score_push`` raises TypeError/ValueError naming the argument and what
was expected; checked through a real instance in a one-rank in-process world."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

import cpindex
from cpindex import formats, reference, testing
from cpindex.config import CPIndexConfig
from cpindex.world import run_threads

ROWS, MAX_LEN = 3, 600  # needs 5 columns; max_width is 16
QDT = {"bf16": "torch.bfloat16", "fp8": "torch.float8_e4m3fn", "nvfp4": "torch.float8_e4m3fn"}

IQ_SHAPE_BUG = (
    "validation unsqueezes a 2-D iq before the shape check, so the error describes "
    "a tensor the caller never passed ('got ... [3, 1, 64]' for an iq of shape [3, 64])"
)


def _args(fmt: str) -> dict:
    prob = testing.make_problem(ROWS, MAX_LEN, fmt, num_heads=1, seed=1)
    return dict(
        iq=prob.q,
        index_cache=prob.index_cache,
        block_table=prob.block_table,
        seq_lens=prob.seq_lens,
        init_blocks=0,
        local_blocks=1,
        width=prob.width,
    )


def _call(cp: cpindex.IndexCP, a: dict, **kw) -> torch.Tensor:
    """``cp.score_push`` on the arguments ``a`` (as :func:`_args` names them): its plan first."""
    counts = {k: a[k] for k in ("init_blocks", "local_blocks", "width") if k in a}
    plan = cp.plan(a["block_table"], a["seq_lens"], **counts)
    return cp.score_push(
        a["iq"], a["index_cache"], plan, **({"tag": a["tag"]} if "tag" in a else {}), **kw
    )


def _push(fmt: str, edit: Callable[[dict], None] | None = None, **cfg) -> torch.Tensor:
    """One score_push on a fresh 1-rank instance after ``edit`` broke the arguments."""
    args = _args(fmt)
    if edit is not None:
        edit(args)

    def rank(comm):
        config = CPIndexConfig(max_rows=4, max_width=16, cache_format=fmt, num_heads=1, **cfg)
        with cpindex.IndexCP(config, device="cpu", comm=comm) as cp:
            return _call(cp, args).clone()

    return run_threads(1, rank)[0]


def _set(**kv) -> Callable[[dict], None]:
    return lambda a: a.update(kv)


FORMATS = ["bf16", "fp8", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_valid_call_matches_reference(fmt):
    args = _args(fmt)
    out = _push(fmt)
    want = reference.block_scores(
        args["iq"], args["index_cache"], args["block_table"], args["seq_lens"],
        init_blocks=0, local_blocks=1, width=args["width"],
    )  # fmt: skip
    assert out.shape == (1, ROWS, 5) and out.dtype == torch.float32
    assert torch.equal(out, want)


# --------------------------------------------------------------------------- iq


@pytest.mark.parametrize("fmt", FORMATS)
def test_iq_wrong_dtype(fmt):
    bad = torch.bfloat16 if fmt != "bf16" else torch.float8_e4m3fn

    def edit(a):
        a["iq"] = a["iq"].float().to(bad)

    msg = rf"iq: expected {QDT[fmt]} for cache_format '{fmt}', got {bad} \[3, 1, 128\]"
    with pytest.raises(TypeError, match=msg):
        _push(fmt, edit)
    with pytest.raises(TypeError, match=r"iq: expected .* got torch.float32"):
        _push(fmt, lambda a: a.update(iq=a["iq"].float()))


@pytest.mark.parametrize(
    "shape",
    [
        (3, 2, 128),
        (3, 1, 64),
        (3, 64),
        (3,),
        (1, 3, 1, 128),
        (3, 128, 1),
    ],
)
def test_iq_wrong_shape(shape):
    q = torch.randn(*shape).to(torch.float8_e4m3fn)
    got = str(list(shape)).replace("[", r"\[").replace("]", r"\]")
    msg = rf"iq: expected \[rows, 1, 128\] or \[rows, 128\], got torch.float8_e4m3fn {got}"
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", _set(iq=q))


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype)
    view = buf[1 : 1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 and torch.equal(view.view(torch.uint8), t.view(torch.uint8))
    return view


@pytest.mark.parametrize("fmt", FORMATS)
def test_iq_off_a_16_byte_boundary(fmt):
    with pytest.raises(ValueError, match=r"iq: data must start on a 16-byte boundary"):
        _push(fmt, lambda a: a.update(iq=_shifted(a["iq"])))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_cache_off_a_16_byte_boundary(fmt):
    with pytest.raises(ValueError, match=r"index_cache: data must start on a 16-byte boundary"):
        _push(fmt, lambda a: a.update(index_cache=_shifted(a["index_cache"])))


def test_cache_pages_not_16_bytes_apart():
    def edit(a):
        cache = a["index_cache"]  # nvfp4 [pages, 9216] uint8
        wide = torch.empty(cache.shape[0], cache.shape[1] + 8, dtype=cache.dtype)
        wide[:, : cache.shape[1]] = cache
        a["index_cache"] = wide[:, : cache.shape[1]]  # pages 9224 bytes apart

    with pytest.raises(ValueError, match=r"index_cache: pages must be a multiple of 16 bytes"):
        _push("nvfp4", edit)


def test_iq_two_dim_accepted_when_one_head():
    out3 = _push("fp8")
    out2 = _push("fp8", lambda a: a.update(iq=a["iq"][:, 0].contiguous()))
    assert torch.equal(out2, out3)


def test_iq_non_contiguous():
    def edit(a):
        a["iq"] = a["iq"][:, 0].t().contiguous().t()  # [3, 128], column-major

    with pytest.raises(ValueError, match=r"iq: expected a contiguous tensor, got strides"):
        _push("nvfp4", edit)


def test_iq_too_many_rows():
    def edit(a):
        a["iq"] = torch.randn(5, 1, 128).to(torch.float8_e4m3fn)

    with pytest.raises(ValueError, match=r"iq: rows must be in \[1, max_rows=4\], got 5"):
        _push("nvfp4", edit)


def test_iq_zero_rows():
    def edit(a):
        a["iq"] = torch.empty(0, 1, 128, dtype=torch.float8_e4m3fn)

    with pytest.raises(ValueError, match=r"iq: rows must be in \[1, max_rows=4\], got 0"):
        _push("nvfp4", edit)


def test_iq_not_a_tensor():
    with pytest.raises(TypeError, match=r"iq: expected a torch\.Tensor, got list"):
        _push("nvfp4", _set(iq=[[0.0] * 128] * 3))


def test_wrong_device_named():
    # the meta device stands in for "another device" on a CPU-only machine
    def on_meta(name):
        return lambda a: a.update({name: a[name].to("meta")})

    for name in ("iq", "block_table", "seq_lens"):
        with pytest.raises(ValueError, match=rf"{name}: expected a tensor on cpu, got .* on meta"):
            _push("fp8", on_meta(name))
    with pytest.raises(ValueError, match=r"index_cache: expected a tensor on cpu, got .* meta"):
        _push("fp8", on_meta("index_cache"))

    def pair_on_meta(a):
        packed, scales = formats.to_nvfp4_pair(a["index_cache"])
        a["index_cache"] = (packed.to("meta"), scales.to("meta"))

    with pytest.raises(ValueError, match=r"index_cache\[0\]: expected a tensor on cpu"):
        _push("nvfp4", pair_on_meta)


# --------------------------------------------------------------------------- index_cache


@pytest.mark.parametrize(
    ("fmt", "bad_dtype"),
    [("bf16", torch.float16), ("bf16", torch.float8_e4m3fn), ("fp8", torch.bfloat16),
     ("fp8", torch.uint8), ("nvfp4", torch.int8), ("nvfp4", torch.bfloat16)],
)  # fmt: skip
def test_index_cache_wrong_dtype(fmt, bad_dtype):
    def edit(a):
        a["index_cache"] = torch.ones(a["index_cache"].shape, dtype=torch.float32).to(bad_dtype)

    expected = {
        "bf16": r"torch.bfloat16 \[pages, 128, 128\]",
        "fp8": r"torch.float8_e4m3fn \[pages, 128, 128\]",
        "nvfp4": r"torch.uint8 \[pages, 9216\]",
    }[fmt]
    msg = rf"index_cache: expected {expected}.* for cache_format '{fmt}', got {bad_dtype}"
    with pytest.raises(TypeError, match=msg):
        _push(fmt, edit)


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [("bf16", (9, 128, 64)), ("bf16", (9, 128 * 128)), ("fp8", (9, 64, 128)),
     ("nvfp4", (9, 9215)), ("nvfp4", (9, 128, 73))],
)  # fmt: skip
def test_index_cache_wrong_shape(fmt, shape):
    dt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt]
    cache = torch.ones(shape).to(dt)
    with pytest.raises(ValueError, match=rf"index_cache: expected .*'{fmt}', got {dt}"):
        _push(fmt, _set(index_cache=cache))


@pytest.mark.parametrize("bad", [None, [1, 2], "cache", 3.0])
def test_index_cache_not_a_tensor(bad):
    with pytest.raises(TypeError, match=r"index_cache: expected a tensor \(or a \(packed, sca"):
        _push("nvfp4", _set(index_cache=bad))


def test_index_cache_bad_nvfp4_pair():
    def bad_scales(a):
        packed, scales = formats.to_nvfp4_pair(a["index_cache"])
        a["index_cache"] = (packed, scales.float())

    with pytest.raises(TypeError, match=r"index_cache\[1\] \(scales\): expected"):
        _push("nvfp4", bad_scales)

    def short_scales(a):
        packed, scales = formats.to_nvfp4_pair(a["index_cache"])
        a["index_cache"] = (packed, scales[:-1])

    with pytest.raises(ValueError, match="index_cache: NVFP4 pair disagrees"):
        _push("nvfp4", short_scales)


def test_nvfp4_pair_accepted():
    plain = _push("nvfp4")

    def pair(a):
        a["index_cache"] = formats.to_nvfp4_pair(a["index_cache"])

    assert torch.equal(_push("nvfp4", pair), plain)


# --------------------------------------------------------------------------- block_table


def test_block_table_wrong_dtype():
    msg = r"block_table: expected torch.int32 \[requests, max_blocks\], got torch.int64 \[3, 5\]"
    with pytest.raises(TypeError, match=msg):
        _push("nvfp4", lambda a: a.update(block_table=a["block_table"].long()))


def test_block_table_wrong_rows():
    with pytest.raises(ValueError, match=r"seq_lens: expected torch.int32 \[2\] \(one length per"):
        _push("nvfp4", lambda a: a.update(block_table=a["block_table"][:2]))
    with pytest.raises(ValueError, match=r"iq: expected 2 rows \(the plan's 2 requests x query"):
        _push(
            "nvfp4",
            lambda a: a.update(block_table=a["block_table"][:2], seq_lens=a["seq_lens"][:2]),
        )
    msg = r"block_table: expected torch.int32 \[requests >= 1, max_blocks >= 1\] \(one row per"
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", lambda a: a.update(block_table=a["block_table"].reshape(-1)))
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", lambda a: a.update(block_table=a["block_table"][:, :0], width=5))


def test_block_table_non_contiguous_rows():
    def edit(a):
        a["block_table"] = a["block_table"].t().contiguous().t()

    with pytest.raises(ValueError, match=r"block_table: rows must be contiguous, got strides"):
        _push("nvfp4", edit)


def test_block_table_row_stride_is_free():
    """A row stride larger than the row (a slice of a wider table) is fine."""
    plain = _push("nvfp4")

    def edit(a):
        wide = torch.full((ROWS, 9), 10**6, dtype=torch.int32)  # poison outside the slice
        wide[:, :5] = a["block_table"]
        a["block_table"] = wide[:, :5]

    assert torch.equal(_push("nvfp4", edit), plain)


def test_block_table_narrower_than_longest_row():
    msg = r"block_table: the longest row \(600 tokens\) needs 5 blocks, got max_blocks=4"
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", lambda a: a.update(block_table=a["block_table"][:, :4].contiguous()))


# --------------------------------------------------------------------------- seq_lens


def test_seq_lens_wrong_dtype():
    with pytest.raises(TypeError, match=r"seq_lens: expected torch.int32 \[3\], got torch.int64"):
        _push("nvfp4", lambda a: a.update(seq_lens=a["seq_lens"].long()))


@pytest.mark.parametrize("shape", [(3, 1), (2,), (4,), ()])
def test_seq_lens_wrong_shape(shape):
    lens = torch.full(shape, 100, dtype=torch.int32)
    msg = r"seq_lens: expected (torch.int32 \[3\]|a contiguous tensor)"
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", _set(seq_lens=lens))


def test_seq_lens_not_a_tensor():
    with pytest.raises(TypeError, match=r"seq_lens: expected a torch\.Tensor, got list"):
        _push("nvfp4", _set(seq_lens=[600, 1, 5]))


# --------------------------------------------------------------------------- width and counts


def test_width_above_max_width():
    with pytest.raises(ValueError, match=r"width: expected in \[1, 16\], got 17"):
        _push("nvfp4", _set(width=17))


def test_width_zero():
    with pytest.raises(ValueError, match=r"width: expected in \[1, 16\], got 0"):
        _push("nvfp4", _set(width=0))


def test_width_below_longest_row():
    msg = r"width: the longest row \(600 tokens\) needs 5 columns, got width=4"
    with pytest.raises(ValueError, match=msg):
        _push("nvfp4", _set(width=4))


def test_width_defaults_to_block_table_width():
    out = _push("fp8", lambda a: a.pop("width"))
    assert out.shape == (1, ROWS, 5)


@pytest.mark.parametrize("name", ["init_blocks", "local_blocks"])
def test_forced_counts_negative(name):
    with pytest.raises(ValueError, match=rf"{name}: expected >= 0, got -1"):
        _push("nvfp4", _set(**{name: -1}))


@pytest.mark.parametrize("name", ["init_blocks", "local_blocks", "width"])
@pytest.mark.parametrize(("bad", "kind"), [(1.0, "float"), (True, "bool"), ("1", "str")])
def test_counts_must_be_int(name, bad, kind):
    with pytest.raises(TypeError, match=rf"{name}: expected an int, got {kind}"):
        _push("nvfp4", _set(**{name: bad}))


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("bad", [{"max_rows": 4}, "nvfp4", 4])
def test_config_not_a_config(bad):
    def rank(comm):
        cpindex.IndexCP(bad, device="cpu", comm=comm)

    with pytest.raises(TypeError, match=r"config: expected CPIndexConfig, got"):
        run_threads(1, rank)


def test_group_and_comm_exclusive():
    def rank(comm):
        cpindex.IndexCP(CPIndexConfig(), group=object(), device="cpu", comm=comm)

    with pytest.raises(ValueError, match="pass either group or comm"):
        run_threads(1, rank)


def test_config_world_size_mismatch():
    def rank(comm):
        cpindex.IndexCP(CPIndexConfig(world_size=2), device="cpu", comm=comm)

    with pytest.raises(ValueError, match=r"config\.world_size is 2 but the process group has 1"):
        run_threads(1, rank)


def test_explicit_ipc_on_cpu_unavailable():
    def rank(comm):
        cpindex.IndexCP(CPIndexConfig(transport="ipc", max_rows=4), device="cpu", comm=comm)

    with pytest.raises(cpindex.TransportUnavailable, match=r"'ipc'.*needs a GPU") as ei:
        run_threads(1, rank)
    assert isinstance(ei.value, cpindex.CPIndexError)


@pytest.mark.parametrize("prefer_mori", [False, True])
def test_auto_on_cpu_resolves_collective(prefer_mori):
    def rank(comm):
        cfg = CPIndexConfig(max_rows=4, max_width=16, prefer_mori=prefer_mori)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            assert "collective" in repr(cp)
            return cp.transport_name, cp.rank, cp.world_size, cp.heads_per_rank

    assert run_threads(1, rank) == [("collective", 0, 1, 4)]


def test_errors_leave_the_instance_usable_and_close_is_final():
    args = _args("nvfp4")

    def rank(comm):
        cfg = CPIndexConfig(max_rows=4, max_width=16, num_heads=1)
        cp = cpindex.IndexCP(cfg, device="cpu", comm=comm)
        with pytest.raises(ValueError, match="width"):
            _call(cp, {**args, "width": 99})
        good = _call(cp, args).clone()
        cp.close()
        cp.close()  # idempotent
        with pytest.raises(cpindex.CPIndexError, match="closed"):
            _call(cp, args)
        return good

    want = reference.block_scores(
        args["iq"], args["index_cache"], args["block_table"], args["seq_lens"],
        init_blocks=0, local_blocks=1, width=args["width"],
    )  # fmt: skip
    assert torch.equal(run_threads(1, rank)[0], want)


@pytest.mark.parametrize(
    ("tok_values", "tok_scales", "bad"),
    [(72, 72, None), (80, 8, None), (68, 8, "index_cache\\[0\\]"), (64, 9, "index_cache\\[1\\]")],
)
def test_nvfp4_pair_token_strides(tok_values, tok_scales, bad):
    """Strided pair views: value tokens a multiple of 8 bytes apart, scale tokens an even
    number; others are refused before any launch, naming the tensor."""
    prob = testing.make_problem(ROWS, MAX_LEN, "nvfp4", num_heads=1, seed=1)
    packed, scales = formats.to_nvfp4_pair(prob.index_cache)
    pages = packed.shape[0]
    pool_v = torch.zeros(pages, 128, tok_values, dtype=torch.uint8)
    pool_s = torch.zeros(pages, 128 * tok_scales + 16, dtype=torch.uint8)
    pool_v[:, :, :64] = packed
    sv = pool_s[:, : 128 * tok_scales].view(pages, 128, tok_scales)
    sv[:, :, :8] = scales.view(torch.uint8)
    pair = (pool_v[:, :, :64], sv[:, :, :8])
    edit = _set(index_cache=pair)
    if bad is None:
        out = _push("nvfp4", edit)
        want = reference.block_scores(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
            init_blocks=0, local_blocks=1, width=prob.width,
        )  # fmt: skip
        assert torch.equal(out, want)
    else:
        with pytest.raises(ValueError, match=bad + ": nvfp4"):
            _push("nvfp4", edit)


# --------------------------------------------------------------------------- plans and tags


def _with_cp(fn, **cfg):
    def rank(comm):
        config = CPIndexConfig(
            **{"max_rows": 4, "max_width": 16, "cache_format": "nvfp4", "num_heads": 1, **cfg}
        )
        with cpindex.IndexCP(config, device="cpu", comm=comm) as cp:
            return fn(cp)

    return run_threads(1, rank)[0]


def test_one_plan_serves_every_layer():
    a = _args("nvfp4")

    def fn(cp):
        plan = cp.plan(a["block_table"], a["seq_lens"], width=a["width"])
        assert (plan.requests, plan.rows, plan.width, plan.query_len) == (ROWS, ROWS, 5, 1)
        layers = [cp.score_push(a["iq"], a["index_cache"], plan, tag=k).clone() for k in range(3)]
        ids = cp.select_blocks(a["iq"], a["index_cache"], plan, topk=3, tag=4).clone()
        return layers, ids, _call(cp, a).clone()

    layers, ids, fresh = _with_cp(fn)
    assert all(torch.equal(x, fresh) for x in layers)
    want = reference.select_blocks(
        a["iq"],
        a["index_cache"],
        a["block_table"],
        a["seq_lens"],
        init_blocks=0,
        local_blocks=1,
        width=a["width"],
        topk=3,
    )
    assert torch.equal(ids, want)


def test_plan_refusals_name_the_argument():
    a = _args("nvfp4")

    def fn(cp):
        plan = cp.plan(a["block_table"], a["seq_lens"])
        with pytest.raises(TypeError, match=r"plan: expected a cpindex Plan"):
            cp.score_push(a["iq"], a["index_cache"], a["block_table"])
        with pytest.raises(ValueError, match=r"iq: expected 3 rows \(the plan's 3 requests x"):
            cp.score_push(a["iq"][:2], a["index_cache"], plan)
        with pytest.raises(ValueError, match=r"block_table: 3 requests x query_len 2 = 6 rows"):
            cp.plan(a["block_table"], a["seq_lens"], query_len=2)
        with pytest.raises(ValueError, match=r"width: the longest row \(600 tokens\) needs 5"):
            cp.plan(a["block_table"], a["seq_lens"], width=4)
        with pytest.raises(TypeError, match=r"seq_lens: expected torch.int32 \[3\]"):
            cp.plan(a["block_table"], a["seq_lens"].long())
        other = CPIndexConfig(max_rows=8, max_width=16, num_heads=1)
        foreign = cpindex.Plan(a["block_table"], a["seq_lens"], width=5, config=other)
        with pytest.raises(ValueError, match=r"plan: made by an IndexCP with another config"):
            cp.score_push(a["iq"], a["index_cache"], foreign)
        # contents are checked against the cache at every call on the CPU
        small = a["index_cache"][:2]
        with pytest.raises(ValueError, match=r"block_table: row 0, block \d names page"):
            cp.score_push(a["iq"], small, plan)
        return cp.score_push(a["iq"], a["index_cache"], plan).clone()  # still usable (W = 1)

    assert _with_cp(fn).shape == (1, ROWS, 5)


def _changed_plans(cp: cpindex.IndexCP, a: dict) -> dict[str, tuple[object, str]]:
    """Plans whose tensors changed shape after plan(), or that were forged with other fields,
    each with the message that must name what changed."""
    out: dict[str, tuple[object, str]] = {}
    bt, sl = a["block_table"].clone(), a["seq_lens"].clone()
    plan = cp.plan(bt, sl, width=5)
    out["width"] = (dataclasses.replace(plan, width=100000), r"width 5 -> 100000")
    out["query_len"] = (dataclasses.replace(plan, query_len=2), r"query_len 1 -> 2")
    out["init_blocks"] = (dataclasses.replace(plan, init_blocks=3), r"init_blocks 0 -> 3")
    out["unchecked"] = (cpindex.Plan(bt, sl, width=5, config=cp.config), "not made by")
    bt2, sl2 = a["block_table"].clone(), a["seq_lens"].clone()
    resized = cp.plan(bt2, sl2, width=5)
    sl2.resize_(2)
    bt2.resize_(2, bt2.shape[1])
    out["resized"] = (resized, r"block_table's shape \(3, \d+\) -> \(2, \d+\); seq_lens' "
                      r"shape \(3,\) -> \(2,\)")  # fmt: skip
    bt3 = a["block_table"].clone()
    strided = cp.plan(bt3, a["seq_lens"], width=5)
    bt3.t_()
    out["strides"] = (strided, r"block_table's shape .*block_table's strides")
    return out


def test_changed_or_forged_plan_is_refused_naming_what_changed():
    """A plan resized in place after plan(), or forged with dataclasses.replace, is refused
    before any launch with a ValueError naming what changed, and the instance stays usable."""
    a = _args("nvfp4")

    def fn(cp):
        errors = {}
        for name, (plan, _) in _changed_plans(cp, a).items():
            for op in (cp.score_push, cp.select_blocks):
                try:
                    op(a["iq"], a["index_cache"], plan)
                except ValueError as e:
                    errors[name, op.__name__] = str(e)
        return errors, _call(cp, a).clone()

    errors, after = _with_cp(fn)
    a2 = _args("nvfp4")
    for name, (_, pattern) in _with_cp(lambda cp: _changed_plans(cp, a2)).items():
        for op in ("score_push", "select_blocks"):
            msg = errors.get((name, op))
            assert msg is not None and msg.startswith("plan: "), (name, op, msg)
            assert re.search(pattern, msg), (name, msg)
    want = reference.block_scores(
        a["iq"], a["index_cache"], a["block_table"], a["seq_lens"], init_blocks=0,
        local_blocks=1, width=a["width"],
    )  # fmt: skip
    assert torch.equal(after, want)


@pytest.mark.parametrize("gated", [False, True], ids=["cp", "below-gate"])
def test_changed_plan_with_peers(gated):
    """W = 2, every rank's plan resized: every rank raises the ValueError naming the change,
    before anything is exchanged. Below the CP gate no peer waits: the instance stays usable.
    Above it the call was the ranks' call N (a refusal round tells the peers at once): every
    rank raises, and reset() brings the instance back with exact results."""
    prob = testing.make_problem(ROWS, MAX_LEN, "fp8", seed=5)

    def rank(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=16, timeout_s=30,
                            cp_min_blocks=10**6 if gated else 0)  # fmt: skip
        iq = prob.rank_queries(comm.rank, 2)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            sl = prob.seq_lens.clone()
            plan = cp.plan(prob.block_table, sl, width=prob.width)
            sl.resize_(2)
            try:
                cp.score_push(iq, prob.index_cache, plan)
                err = None
            except ValueError as e:
                err = str(e)
            if not gated:
                cp.reset()
            fresh = cp.plan(prob.block_table, prob.seq_lens, width=prob.width)
            return err, cp.score_push(iq, prob.index_cache, fresh).clone()

    want = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=0,
        local_blocks=1, width=prob.width,
    )  # fmt: skip
    for r, (err, out) in enumerate(run_threads(2, rank)):
        assert err is not None and "seq_lens' shape (3,) -> (2,)" in err, err
        assert torch.equal(out, want[2 * r : 2 * r + 2])


def test_plan_sees_tensors_changed_in_place():
    """A plan holds the tensors themselves: a call reads their current contents (and, on the
    CPU, checks them again)."""
    a = _args("nvfp4")
    other = testing.make_problem(ROWS, MAX_LEN, "nvfp4", num_heads=1, seed=2)

    def fn(cp):
        bt, sl = a["block_table"].clone(), a["seq_lens"].clone()
        plan = cp.plan(bt, sl, width=5)
        first = cp.score_push(a["iq"], a["index_cache"], plan).clone()
        bt.copy_(other.block_table[:, :5])
        sl.copy_(other.seq_lens.clamp(max=640))
        second = cp.score_push(a["iq"], a["index_cache"], plan).clone()
        bt[0, 0] = -1
        with pytest.raises(ValueError, match=r"block_table: row 0, block 0 names page -1"):
            cp.score_push(a["iq"], a["index_cache"], plan)
        return first, second, sl.clone()

    first, second, lens = _with_cp(fn)
    want = reference.block_scores(
        a["iq"],
        a["index_cache"],
        other.block_table[:, :5],
        lens,
        init_blocks=0,
        local_blocks=1,
        width=5,
    )
    assert torch.equal(second, want) and not torch.equal(first, second)


@pytest.mark.parametrize(
    ("tag", "error"),
    [(-1, ValueError), (1 << 63, ValueError), (2.0, TypeError), (False, TypeError),
     ("1", TypeError)],
)  # fmt: skip
def test_tag_must_be_an_int_below_2_63(tag, error):
    with pytest.raises(error, match=r"tag: expected"):
        _push("fp8", _set(tag=tag))


def test_tag_accepts_integral_types():
    import numpy as np

    assert torch.equal(_push("fp8", _set(tag=np.int64(5))), _push("fp8", _set(tag=(1 << 63) - 1)))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_iq_is_a_type_error():
    def edit(a):
        a["iq"] = torch.nested.nested_tensor([r.float() for r in a["iq"].unbind(0)]).to(
            torch.float8_e4m3fn
        )

    with pytest.raises(TypeError, match=r"iq: expected a dense \(strided\) tensor, got a nested"):
        _push("nvfp4", edit)


class _Exotic(torch.Tensor):
    """A tensor whose shape cannot be read (as some wrapper subclasses behave)."""

    @property
    def shape(self):  # type: ignore[override]
        raise RuntimeError("this tensor has no sizes")


@pytest.mark.parametrize("name", ["iq", "block_table", "seq_lens"])
def test_an_exotic_tensor_is_a_type_error_naming_it(name):
    def edit(a):
        a[name] = torch.Tensor._make_subclass(_Exotic, a[name])

    with pytest.raises(TypeError, match=rf"{name}: unsupported argument \(RuntimeError: this"):
        _push("fp8", edit)
