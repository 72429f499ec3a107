"""Nonsense is refused with a message that names it, and NaN/Inf inputs have one defined result
(issue 14: bounds, NaN/Inf, messages). Fast: no processes, one- and two-rank in-process worlds.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

import cpindex
from cpindex import formats, partition, reference, selection, testing
from cpindex.config import SM_SCALE_RANGE, CPIndexConfig
from cpindex.transports.peer import PeerLayout
from cpindex.world import run_threads

# --------------------------------------------------------------------------- the digest


def test_digest_is_stable_and_covers_exactly_the_shared_fields():
    base = CPIndexConfig()
    assert base.digest() == CPIndexConfig().digest() != 0
    assert base.digest() == CPIndexConfig.from_env({}).digest()
    for field in CPIndexConfig.LOCAL_FIELDS:  # a rank may set these on its own
        other = {"timeout_s": 2.5, "error_check": "sync", "max_buffer_bytes": 1 << 33}[field]
        assert CPIndexConfig(**{field: other}).digest() == base.digest(), field
    shared = dict(
        transport="collective", world_size=2, num_heads=8, cache_format="fp8", max_rows=17,
        max_query_len=4, max_width=333, max_topk=8, sm_scale=0.5, prefer_mori=True,
        ipc_self_test=False, fingerprint=False, cp_min_blocks=64,
    )  # fmt: skip
    assert set(shared) | CPIndexConfig.LOCAL_FIELDS | {"head_dim", "block_size"} == set(
        CPIndexConfig.model_fields
    )
    for field, value in shared.items():
        assert CPIndexConfig(**{field: value}).digest() != base.digest(), field


def test_digest_is_the_same_in_another_process():
    import subprocess
    import sys

    code = "from cpindex.config import CPIndexConfig; print(CPIndexConfig(max_rows=7).digest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == CPIndexConfig(max_rows=7).digest()


# --------------------------------------------------------------------------- config bounds

NUMBER_FIELDS = [
    "world_size", "num_heads", "max_rows", "max_query_len", "max_width", "max_topk",
    "max_buffer_bytes", "sm_scale", "timeout_s",
]  # fmt: skip


@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_bools_are_not_numbers(field):
    with pytest.raises(ValidationError, match=rf"(?s){field}.*got the bool True"):
        CPIndexConfig(**{field: True})


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, 1e-300, 1e7, 1e-7])
def test_sm_scale_must_be_finite_and_in_range(value):
    with pytest.raises(ValidationError, match="sm_scale"):
        CPIndexConfig(sm_scale=value)


def test_sm_scale_range_ends_are_accepted():
    lo, hi = SM_SCALE_RANGE
    assert CPIndexConfig(sm_scale=lo).sm_scale == lo
    assert CPIndexConfig(sm_scale=hi).sm_scale == hi
    # the bound's reason: fp8 dots are at most 128 * 448**2; scaled, far below the forced 1e29
    assert 128 * 448.0**2 * hi < 1e29 / 1e10


@pytest.mark.parametrize("raw", ["inf", "Infinity", "nan", "1e300", "1e-300"])
def test_sm_scale_from_env_is_bounded(raw):
    with pytest.raises(ValidationError, match="sm_scale"):
        CPIndexConfig.from_env({"CPINDEX_SM_SCALE": raw})


def test_sm_scale_from_files_is_bounded(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"sm_scale": Infinity}')
    with pytest.raises(ValidationError, match="sm_scale"):
        CPIndexConfig.from_file(p)
    p = tmp_path / "c.yaml"
    p.write_text("sm_scale: .inf\n")
    with pytest.raises(ValidationError, match="sm_scale"):
        CPIndexConfig.from_file(p)
    p.write_text("timeout_s: .nan\n")
    with pytest.raises(ValidationError, match="timeout_s"):
        CPIndexConfig.from_file(p)


def _allocated(cp: cpindex.IndexCP) -> int:
    """Bytes of every tensor the instance's transport holds (select outputs included)."""
    seen: set[int] = set()
    total = 0

    def add(obj: object) -> None:
        nonlocal total
        for v in vars(obj).values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
            elif isinstance(v, selection.Outputs):
                add(v)

    add(cp._transport)
    return total


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_buffer_bytes_covers_what_the_transports_allocate(world, fmt):
    cfg = CPIndexConfig(cache_format=fmt, max_rows=12, max_width=50, max_topk=5)

    def rank_fn(comm):
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            return _allocated(cp)

    collective = max(run_threads(world, rank_fn))
    bound = cfg.with_world_size(world)
    hpr = bound.heads_per_rank()
    peer = PeerLayout(bound, world).total + hpr * 12 * 5 * 8  # + select_blocks' outputs
    need = bound.buffer_bytes()
    assert collective <= need and peer <= need
    assert need <= max(collective, peer) + 4096  # and not much more: it is what is allocated


def test_configs_past_max_buffer_bytes_are_refused():
    cfg = CPIndexConfig(max_rows=65536, max_width=1 << 20)  # unbound: not known yet
    with pytest.raises(ValidationError, match=r"needs [\d,]+ bytes of buffers per rank at "):
        cfg.with_world_size(4)
    small = CPIndexConfig(max_buffer_bytes=1 << 20)
    with pytest.raises(ValidationError, match="more than max_buffer_bytes=1,048,576"):
        small.with_world_size(1)
    assert CPIndexConfig(max_buffer_bytes=1 << 40, max_rows=65536).with_world_size(4)


def test_a_rank_refusing_its_buffers_stops_every_rank():
    """One rank's local limit refuses the config: it raises its own error, its peer names it,
    both at once (construction agrees before anything else)."""

    def rank_fn(comm):
        limit = 1 << 20 if comm.rank == 1 else 1 << 32
        cfg = CPIndexConfig(max_buffer_bytes=limit, timeout_s=5.0)
        try:
            cpindex.IndexCP(cfg, device="cpu", comm=comm)
        except Exception as e:
            return type(e).__name__, str(e)
        return None

    (t0, m0), (t1, m1) = run_threads(2, rank_fn, timeout_s=10)
    assert t1 == "ValidationError" and "max_buffer_bytes" in m1
    assert t0 == "CPIndexError" and "failed on rank 1: ValidationError" in m0


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("meta", "expected a cpu or cuda device, got meta"),
        ("not-a-device", "device: "),
        pytest.param(
            "cuda:7",
            "cuda:7",
            marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="has 8 GPUs"),
        ),
    ],
)
def test_devices_must_be_cpu_or_an_existing_gpu(device, match):
    def rank_fn(comm):
        cpindex.IndexCP(CPIndexConfig(), device=device, comm=comm)

    with pytest.raises(ValueError, match=match):
        run_threads(1, rank_fn)


# --------------------------------------------------------------------------- messages


def test_empty_environment_value_is_named():
    with pytest.raises(ValueError, match="CPINDEX_MAX_ROWS is set but empty; unset it"):
        CPIndexConfig.from_env({"CPINDEX_MAX_ROWS": ""})
    with pytest.raises(ValidationError, match="input_value='none'"):  # not input_value=None
        CPIndexConfig.from_env({"CPINDEX_MAX_ROWS": "none"})


@pytest.mark.parametrize(("name", "text"), [("c.json", '{"max_rows": 4,}'), ("c.yaml", "a: [1")])
def test_syntax_errors_name_the_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    kind = "JSON" if name.endswith("json") else "YAML"
    with pytest.raises(ValueError, match=rf"config file {p}: not valid {kind}"):
        CPIndexConfig.from_file(p)


def test_dump_file_writes_only_what_from_file_reads(tmp_path):
    p = tmp_path / "x.txt"
    with pytest.raises(ValueError, match=r"must end in \.json, \.yaml or \.yml"):
        CPIndexConfig().dump_file(p)
    assert not p.exists()


# --------------------------------------------------------------------------- call bounds


def _one_rank_push(**over):
    prob = testing.make_problem(2, 300, "fp8", num_heads=1, seed=3)
    args = dict(
        iq=prob.q, index_cache=prob.index_cache, block_table=prob.block_table,
        seq_lens=prob.seq_lens, init_blocks=0, local_blocks=1, width=prob.width,
    )  # fmt: skip
    args.update(over)

    def rank_fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", num_heads=1, max_rows=4, max_width=16)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            names = ("init_blocks", "local_blocks", "width", "query_len")
            counts = {k: args[k] for k in names if k in args}
            plan = cp.plan(args["block_table"], args["seq_lens"], **counts)
            return cp.score_push(args["iq"], args["index_cache"], plan).clone()

    return run_threads(1, rank_fn)


@pytest.mark.parametrize("name", ["init_blocks", "local_blocks"])
@pytest.mark.parametrize("value", [2**63, 2**64, 17])
def test_forcing_counts_past_max_width_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"{name}: expected <= max_width \(16\), got {value}"):
        _one_rank_push(**{name: value})


@pytest.mark.parametrize("name", ["init_blocks", "local_blocks", "width", "query_len"])
def test_bool_counts_are_refused(name):
    with pytest.raises(TypeError, match=rf"{name}: expected an int, got bool"):
        _one_rank_push(**{name: True})


def test_negative_lengths_are_refused_on_the_host():
    prob = testing.make_problem(2, 300, "fp8", num_heads=1, seed=3)
    lens = prob.seq_lens.clone()
    lens[1] = -5
    with pytest.raises(ValueError, match="seq_lens: request 1 has length -5"):
        _one_rank_push(seq_lens=lens)


def test_the_kernels_head_divisions_are_exact_over_their_range():
    """The kernel divides query vector indices (under MAX_QUERY_LEN x 16) by the head count with
    the launcher's magic number (keys.h, div_small): exact there, refused past 16 heads."""
    from cpindex.config import MAX_QUERY_LEN
    from cpindex.kernels.launcher import div_magic

    for d in range(1, 17):
        m = div_magic(d)
        assert all((x * m) >> 16 == x // d for x in range(MAX_QUERY_LEN * 16))
    for d in (0, 17, -1):
        with pytest.raises(ValueError, match="head count of 1 to 16"):
            div_magic(d)


# --------------------------------------------------------------------------- NaN and Inf


def _nan_problem():
    """fp8 problem, 2 requests of 3 blocks; request 0's block 1 has one NaN key token, its
    block 0 only NaN keys; head 2's query of request 1 is NaN."""
    prob = testing.make_problem(2, 3 * 128, "fp8", seed=11, lengths=torch.tensor([384, 384]))
    cache = prob.index_cache.clone()
    nan = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    p0, p1 = int(prob.block_table[0, 0]), int(prob.block_table[0, 1])
    cache[p1, 5, 7] = nan
    cache[p0] = nan
    q = prob.q.clone()
    q[1, 2, 0] = nan
    prob.index_cache, prob.q = cache, q
    return prob


def test_a_nan_dot_never_wins():
    prob = _nan_problem()
    got = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=0, local_blocks=1, width=3,
    )  # fmt: skip
    assert not got.isnan().any()
    # block 0 of request 0: every dot is NaN -> -inf (never selected)
    assert (got[:, 0, 0] == float("-inf")).all()
    # block 1: the max over the 127 tokens whose dots are not NaN
    page = int(prob.block_table[0, 1])
    keys = formats.dequantize(prob.index_cache[page : page + 1], "fp8")[0].double()
    dots = prob.q[0].double() @ keys.T  # [H, 128]
    assert dots[:, 5].isnan().all()
    want = dots[:, torch.arange(128) != 5].amax(dim=1) * 128**-0.5
    assert torch.equal(got[:, 0, 1], want.float())
    # a NaN query row: all its scanned blocks -inf for that head, other heads unaffected
    assert (got[2, 1, :2] == float("-inf")).all()
    assert torch.isfinite(got[[0, 1, 3], 1, :2]).all()
    # selection never picks a NaN block: request 0 head 0 picks blocks 1 and 2 only
    ids = reference.select_blocks(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=0, local_blocks=1, width=3, topk=3,
    )  # fmt: skip
    assert ids[0, 0].tolist() == [1, 2, -1]


def test_nan_inputs_give_the_reference_over_the_collective_transport():
    prob = _nan_problem()
    want = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=0, local_blocks=1, width=3,
    )  # fmt: skip

    def rank_fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8, transport="collective")
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            q = prob.rank_queries(comm.rank, 2)
            plan = cp.plan(prob.block_table, prob.seq_lens)
            return cp.score_push(q, prob.index_cache, plan).clone()

    for rank, got in enumerate(run_threads(2, rank_fn)):
        assert torch.equal(got, want[partition.heads_of_rank(rank, 4, 2)])


def test_bf16_inf_keys():
    """bf16 can hold inf: inf * 0 is NaN (that dot is dropped), inf * x > 0 is +inf."""
    prob = testing.make_problem(1, 2 * 128, "bf16", seed=12, lengths=torch.tensor([256]))
    cache = prob.index_cache.clone()
    page = int(prob.block_table[0, 0])
    cache[page, :, :] = 0
    cache[page, 3, 0] = float("inf")  # token 3: inf in dim 0, zeros elsewhere
    q = prob.q.clone()
    q[0, 0, 0], q[0, 1, 0], q[0, 2, 0] = 1.0, -1.0, 0.0
    got = reference.block_scores(
        q, cache, prob.block_table, prob.seq_lens, init_blocks=0, local_blocks=1, width=2
    )
    assert got[0, 0, 0] == float("inf")  # +inf wins the block
    assert got[1, 0, 0] == 0.0  # -inf loses to the zero dots of the other tokens
    assert got[2, 0, 0] == 0.0  # 0 * inf = NaN is dropped; the zeros remain
    assert (got[:, 0, 1] == 1e29).all()  # the forced local column is untouched
