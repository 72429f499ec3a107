"""The lockstep scenarios of tests/test_lockstep.py for ``ipc`` in the one-process GPU world
(issue 14), through the public API only. Skipped without a GPU.

``ipc`` compares call identities in the kernel (the host sends nothing per call), so a refused
or skipped call shows up on its peers as a kernel timeout, and calls that differ as
``OutOfStepError``; both are recorded in the error word and raised by ``check()`` (or the next
call). The rules of the one-process world apply (docs/design.md): every rank synchronizes its
stream and meets the others at a host barrier before it allocates, copies or checks.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _gpu import assert_scores, expected, for_rank, kernel_copy, needs_gpu

from cpindex import (
    BadBlockTableError,
    BrokenInstanceError,
    ConfigMismatchError,
    CPIndexConfig,
    IndexCP,
    OutOfStepError,
    PeerTimeoutError,
    testing,
)
from cpindex.comm import Comm
from cpindex.world import run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"
W = 2
TIMEOUT = 0.5


def _cfg(**kw: Any) -> CPIndexConfig:
    base = dict(transport="ipc", cache_format="fp8", max_rows=8, max_width=32, timeout_s=TIMEOUT)
    return CPIndexConfig(**{**base, **kw})


def _prob(requests: int = 3, query_len: int = 1, seed: int = 0) -> testing.Problem:
    return testing.make_problem(
        requests, 12 * 128, "fp8", query_len=query_len, seed=40 + seed, device=DEV
    )


PROB = None


def _p() -> testing.Problem:
    global PROB
    if PROB is None:
        PROB = _prob()
    return PROB


def _args(cp: IndexCP, prob: testing.Problem, **over: Any) -> dict[str, Any]:
    args = dict(
        iq=prob.rank_queries(cp.rank, cp.world_size),
        index_cache=prob.index_cache,
        block_table=prob.block_table,
        seq_lens=prob.seq_lens,
        init_blocks=0,
        local_blocks=1,
        width=prob.width,
        query_len=prob.query_len,
    )
    args.update(over)
    return args


def _push(cp: IndexCP, **a: Any) -> torch.Tensor:
    """``cp.score_push`` on :func:`_args`' arguments, through a plan made for the call."""
    counts = ("init_blocks", "local_blocks", "width", "query_len")
    plan = cp.plan(a["block_table"], a["seq_lens"], **{k: a[k] for k in counts})
    return cp.score_push(a["iq"], a["index_cache"], plan, tag=a.get("tag"))


def _settle(comm: Comm) -> None:
    """Nothing of this rank in flight, and every rank here: safe to allocate and check."""
    torch.cuda.current_stream().synchronize()  # releases the GIL
    comm.barrier()


def _try(fn) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"type": None}
    except Exception as e:
        out = {"type": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer", None)}
        out["cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
    out["s"] = time.monotonic() - t0
    return out


def _call_and_check(cp: IndexCP, comm: Comm, **args: Any) -> dict[str, Any]:
    """One call, then (after every rank settled) what it raised, at once or from check()."""
    res = _try(lambda: _push(cp, **args))
    _settle(comm)
    if res["type"] is None:
        res = _try(cp.check)
    return res


def _good(cp: IndexCP, comm: Comm) -> torch.Tensor:
    """A correct call after recovery; returns a copy of its output (compared by the test)."""
    p = _p()
    out = torch.empty(cp.heads_per_rank, p.rows, p.width, device=DEV)
    _settle(comm)
    kernel_copy(out, _push(cp, **_args(cp, p)))
    _settle(comm)
    return out


def _want(rank: int) -> torch.Tensor:
    return for_rank(expected(_p(), 0, 1), rank, W)


def _world(fn):
    _p()  # built before the ranks start: nothing allocates while a push may spin
    return run_threads(W, fn, device=DEV, timeout_s=60)


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("field", "values"),
    [("max_rows", (8, 16)), ("transport", ("ipc", "auto")), ("sm_scale", (0.1, 0.2))],
)
def test_construction_mismatch_raises_on_every_rank(field, values):
    def job(comm):
        return _try(lambda: IndexCP(_cfg(**{field: values[comm.rank]}), device=DEV, comm=comm))

    for r in _world(job):
        assert r["type"] == ConfigMismatchError.__name__, r
        assert f"{field}: rank 0: {values[0]!r}, rank 1: {values[1]!r}" in r["msg"]
        assert r["s"] < TIMEOUT + 1.5


# --------------------------------------------------------------------------- calls


def test_refused_input_times_out_the_peer_and_reset_recovers():
    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            width = 33 if comm.rank == 1 else _p().width  # past max_width on rank 1
            first = _call_and_check(cp, comm, **_args(cp, _p(), width=width))
            then = _try(lambda: _push(cp, **_args(cp, _p())))
            _settle(comm)
            cp.reset()
            return first, then, _good(cp, comm)

    (f0, t0, out0), (f1, t1, out1) = _world(job)
    assert f1["type"] == "ValueError" and "width" in f1["msg"]
    assert f0["type"] == PeerTimeoutError.__name__ and f0["peer"] == 1, f0
    for t in (t0, t1):
        assert t["type"] == BrokenInstanceError.__name__, t
    assert t0["cause"] == PeerTimeoutError.__name__ and t1["cause"] == "ValueError"
    assert_scores(out0, _want(0))
    assert_scores(out1, _want(1))


MISMATCHES = {
    "width": lambda: {"width": _p().width + 1},
    "init_blocks": lambda: {"init_blocks": 1},
    "local_blocks": lambda: {"local_blocks": 2},
}


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_ranks_with_different_calls_all_raise(field):
    change = MISMATCHES[field]()

    def job(comm):
        with IndexCP(_cfg(timeout_s=2.0), device=DEV, comm=comm) as cp:
            over = change if comm.rank == 1 else {}
            res = _call_and_check(cp, comm, **_args(cp, _p(), **over))
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == OutOfStepError.__name__, (rank, res)
        assert res["peer"] == 1 - rank
        assert_scores(out, _want(rank))


def test_ranks_with_different_rows_all_raise():
    other = _prob(requests=2, seed=1)

    def job(comm):
        with IndexCP(_cfg(timeout_s=2.0), device=DEV, comm=comm) as cp:
            prob = other if comm.rank == 1 else _p()
            res = _call_and_check(cp, comm, **_args(cp, prob))
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] in (OutOfStepError.__name__, PeerTimeoutError.__name__), (rank, res)
        assert_scores(out, _want(rank))


def test_two_instances_called_in_different_orders():
    def job(comm):
        a = IndexCP(_cfg(), device=DEV, comm=comm)
        b = IndexCP(_cfg(), device=DEV, comm=comm)
        first, second = (a, b) if comm.rank == 0 else (b, a)
        r1 = _call_and_check(first, comm, **_args(first, _p()))
        r2 = _call_and_check(second, comm, **_args(second, _p()))
        a.reset()
        b.reset()
        outs = _good(a, comm), _good(b, comm)
        a.close()
        b.close()
        return r1, r2, outs

    for rank, (r1, _r2, outs) in enumerate(_world(job)):
        # never wrong data: the first pairing fails on both ranks (identities or flags differ)
        assert r1["type"] in (OutOfStepError.__name__, PeerTimeoutError.__name__), (rank, r1)
        for out in outs:
            assert_scores(out, _want(rank))


def test_late_peer_times_out_refuses_calls_and_recovers():
    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            args = _args(cp, _p())
            if comm.rank == 1:
                time.sleep(3 * TIMEOUT)  # rank 0's kernel gives up meanwhile
            first = _try(lambda: _push(cp, **args))
            torch.cuda.current_stream().synchronize()
            checked = _try(cp.check)
            then = _try(lambda: _push(cp, **args))
            _settle(comm)
            cp.reset()
            return first, checked, then, _good(cp, comm)

    (_f0, c0, t0, out0), (_f1, c1, _t1, out1) = _world(job)
    assert c0["type"] == PeerTimeoutError.__name__ and c0["peer"] == 1, c0
    assert t0["type"] == BrokenInstanceError.__name__ and t0["cause"] == PeerTimeoutError.__name__
    # rank 1 came late: its kernel found rank 0 gone (no wrong data) and says so
    assert c1["type"] == PeerTimeoutError.__name__ and c1["peer"] == 0, c1
    assert_scores(out0, _want(0))
    assert_scores(out1, _want(1))


def test_reset_is_bounded_and_names_who_did_not_come():
    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            if comm.rank == 1:
                time.sleep(1.5 * TIMEOUT)  # misses rank 0's first reset, joins its second
            first = _try(cp.reset)
            # rank 0 resets again; rank 1's one late reset walks past the round rank 0 gave up
            # on and meets rank 0's second
            second = _try(cp.reset) if comm.rank == 0 else {"type": None}
            return first, second, _good(cp, comm)

    (f0, s0, out0), (f1, s1, out1) = _world(job)
    assert f0["type"] == PeerTimeoutError.__name__ and f0["peer"] == 1, f0
    assert f0["s"] < TIMEOUT + 1.5
    assert f1["type"] is None, f1
    assert s0["type"] is None and s1["type"] is None, (s0, s1)
    assert_scores(out0, _want(0))
    assert_scores(out1, _want(1))


def test_close_is_bounded_and_names_who_did_not_come():
    """ipc ranks meet before freeing memory their peers write into; a rank that does not come
    is named within timeout_s and the memory is kept (not freed under a late peer)."""

    def job(comm):
        cp = IndexCP(_cfg(), device=DEV, comm=comm)
        _good(cp, comm)
        if comm.rank == 1:
            time.sleep(1.5 * TIMEOUT)  # rank 0 gives up waiting for this rank's close
        return _try(cp.close)

    c0, c1 = _world(job)
    assert c0["type"] == PeerTimeoutError.__name__ and c0["peer"] == 1, c0
    assert "close timed out" in c0["msg"], c0
    assert c0["s"] < TIMEOUT + 1.5
    assert c1["type"] == PeerTimeoutError.__name__  # came after rank 0 gave up: told at once


def test_sync_error_check_raises_in_the_failing_call():
    def job(comm):
        with IndexCP(_cfg(error_check="sync"), device=DEV, comm=comm) as cp:
            over = {"init_blocks": 1} if comm.rank == 1 else {}
            res = _try(lambda: _push(cp, **_args(cp, _p(), **over)))
            _settle(comm)
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == OutOfStepError.__name__, (rank, res)
        assert_scores(out, _want(rank))


# --------------------------------------------------------------------------- bounds, NaN


def test_negative_length_is_reported_by_the_kernel_and_reset_recovers():
    lens = _p().seq_lens.clone()
    lens[1] = -5

    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            res = _call_and_check(cp, comm, **_args(cp, _p(), seq_lens=lens))
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == BadBlockTableError.__name__ and "seq_lens -5" in res["msg"], res
        assert_scores(out, _want(rank))


def test_nan_inputs_score_like_the_reference():
    """A NaN dot never wins on the GPU either (fmaxf from -inf): equal to the reference."""
    prob = testing.make_problem(2, 3 * 128, "fp8", seed=11, lengths=torch.tensor([384, 384]))
    nan = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    p0, p1 = int(prob.block_table[0, 0]), int(prob.block_table[0, 1])
    prob.index_cache[p1, 5, 7] = nan
    prob.index_cache[p0] = nan
    prob.q[1, 2, 0] = nan
    prob = prob.to(DEV)
    want = expected(prob, 0, 1)

    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            out = torch.empty(cp.heads_per_rank, prob.rows, prob.width, device=DEV)
            _settle(comm)
            kernel_copy(out, _push(cp, **_args(cp, prob)))
            _settle(comm)
            return out

    for rank, out in enumerate(_world(job)):
        assert_scores(out, for_rank(want, rank, W))
