"""The gate sweep (``cpindex bench --gate``, ``cpindex.bench.gate_sweep``) on a CPU: the
crossover it reports and its table from hand-made results (speed is never asserted), one tiny
sweep end to end in the CPU one-process world (both paths must agree bit for bit), and the
command line's run: its tables, the lines under them and the JSON, checked against each other
and against the timings the JSON holds."""

from __future__ import annotations

import json
import statistics

import pytest

from cpindex import cli
from cpindex.bench import gate_sweep


def _row(requests: int, ctx: int, blocks: int, cp_us: float, local_us: float, auto: bool):
    return {
        "requests": requests, "context": ctx, "blocks": blocks, "agree": True, "auto_cp": auto,
        "cp": {"median_ms": cp_us / 1e3}, "local": {"median_ms": local_us / 1e3},
    }  # fmt: skip


def _res(rows, **gate):
    return {
        "format": "nvfp4", "op": "score_push", "world": 4, "query_len": 1, "transport": "ipc",
        "device": "cuda:0", "distinct_gpus": True, "rows": rows, "iters": 50, "graphs": True,
        "gate": {"threshold": 4000, "source": "measured", "t_exchange_s": 9e-6,
                 "bandwidth": 4.8e12, "page_bytes": 9216, **gate},
    }  # fmt: skip


ROWS = [
    _row(1, 4096, 32, 20.0, 8.0, False),
    _row(8, 4096, 256, 22.0, 12.0, False),
    _row(1, 131072, 1024, 30.0, 31.0, False),  # CP wins here, but not at 2048
    _row(16, 16384, 2048, 33.0, 29.0, False),
    _row(32, 65536, 16384, 60.0, 180.0, True),
    _row(32, 131072, 32768, 100.0, 350.0, True),
]


def test_crossover_is_where_cp_wins_from_there_on():
    assert gate_sweep.crossover(ROWS) == 16384
    assert gate_sweep.crossover(ROWS[:4]) is None
    assert gate_sweep.crossover(ROWS[4:]) == 16384
    # two sizes of one block count: CP must win at both
    tie = [_row(2, 1024, 16, 10.0, 9.0, False), _row(1, 2048, 16, 9.0, 10.0, False)]
    assert gate_sweep.crossover([*tie, _row(4, 1024, 32, 10.0, 20.0, True)]) == 32


def test_table_renders():
    rows = [ROWS[0], ROWS[5], _row(4, 16384, 512, 24.0, 16.0, False)]
    text = gate_sweep.table(_res(rows))
    lines = text.splitlines()
    assert "nvfp4, score_push, W = 4" in lines[0] and "share" not in lines[0]
    assert lines[2].split() == ["1", "4K", "32", "20.0", "8.0", "0.40", "12.0", "local", "yes"]
    # CP is faster at this size: nothing saved
    assert lines[4].split() == ["32", "128K", "32768", "100.0", "350.0", "3.50", "-", "CP", "yes"]
    assert lines[5] == (
        "crossover: 32768 blocks (CP is faster at every size from there on; local at 512 "
        "blocks, the largest size below)"
    )
    assert lines[6] == (
        "below 32768 blocks, scoring locally saves per call: mean 10.0 us, median 10.0 us, "
        "sum 20.0 us over 2 sizes (mean 47 % of the CP time)"
    )
    assert "4000 blocks (measured: t_exchange 9.0 us, 4.80 TB/s, 9216-byte pages)" in lines[7]
    assert "faster path at 3 of 3 sizes; cp_min_blocks=32768 gates at the crossover" in lines[7]
    legend = gate_sweep.legend([_res(rows)])
    assert "saved us" in legend and "over 50 timed repetitions (CUDA graph" in legend


def test_no_crossover_in_the_range_is_said_so():
    never = gate_sweep.table(_res(ROWS[:1], t_exchange_s=None, source="shared device"))
    assert (
        "crossover: none found in the swept range (32 to 32 blocks): local is faster at the "
        "largest size, so any crossover lies above 32 blocks" in never
    )
    assert "at every size of the sweep (all below any crossover), scoring locally saves" in never
    assert "(shared device)" in never and "gates at the crossover" not in never
    always = gate_sweep.table(_res(ROWS[4:]))
    assert (
        "crossover: none found in the swept range (16384 to 32768 blocks): CP is faster at "
        "every size, so the crossover lies at or below 16384 blocks" in always
    )
    assert "below the crossover: no size of the sweep, nothing saved" in always


def test_a_tiny_sweep_on_the_cpu():
    res = gate_sweep.run(world=2, requests=[1, 2], contexts=[300], iters=2, op="select_blocks")
    assert [r["blocks"] for r in res["rows"]] == [3, 6]
    assert all(r["agree"] for r in res["rows"])
    assert res["gate"]["threshold"] == 0 and res["transport"] == "collective"
    assert res["spec"]["transport"] == "auto" and res["summary"]["sizes"] == 2
    assert "CPU ranks" in gate_sweep.table(res)


def _expected_crossover(rows: list[dict]) -> int | None:
    """The crossover from the JSON's timings, worked out here apart from the module's: the
    smallest block count from which CP's median is below local's at every size."""
    counts = sorted({r["blocks"] for r in rows})
    wins = {
        b: all(r["cp"]["median_ms"] < r["local"]["median_ms"] for r in rows if r["blocks"] == b)
        for b in counts
    }
    start = [b for i, b in enumerate(counts) if all(wins[c] for c in counts[i:])]
    return start[0] if start else None


def test_bench_gate_through_the_cli(capsys, tmp_path):
    """``cpindex bench --gate`` on two CPU ranks, two query lengths: one table per T, each with
    a row per size, the crossover (or that there is none in the range), the saved figures and
    auto's threshold; the JSON holds the same, and both follow from the JSON's timings."""
    out = tmp_path / "gate.json"
    argv = ["bench", "--gate", "--world", "2", "--rows", "1,2", "--context", "300,1k",
            "--iters", "2", "--query-len", "1,2", "--out", str(out)]  # fmt: skip
    code = cli.main(argv)
    stdout, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["gate"] is True
    sweeps = data["gate"]
    assert [(s["query_len"], s["op"], s["transport"]) for s in sweeps] == [
        (1, "score_push", "collective"), (2, "score_push", "collective"),
    ]  # fmt: skip
    tables = stdout.split("\n\n")
    assert len(tables) == 2, stdout
    for sweep, text in zip(sweeps, tables, strict=True):
        lines = text.splitlines()
        assert lines[0].startswith(f"CP gate: nvfp4, score_push, W = 2, T = {sweep['query_len']}")
        assert lines[1].split() == [
            "req", "ctx", "blocks", "CP", "us", "local", "us", "local/CP", "saved", "us", "auto",
            "agree",
        ]  # fmt: skip
        rows = sweep["rows"]
        assert sorted((r["requests"], r["context"], r["blocks"]) for r in rows) == [
            (1, 300, 3), (1, 1024, 8), (2, 300, 6), (2, 1024, 16),
        ]  # fmt: skip
        assert all(r["agree"] for r in rows)
        by_blocks = {r["blocks"]: r for r in rows}
        for ln in lines[2:6]:  # a size per line, fewest blocks first, times as in the JSON
            cells = ln.split()
            r = by_blocks[int(cells[2])]
            cp, local = r["cp"]["median_ms"] * 1e3, r["local"]["median_ms"] * 1e3
            assert cells[3:5] == [f"{cp:.1f}", f"{local:.1f}"], ln
            assert cells[6] == (f"{cp - local:.1f}" if local < cp else "-"), ln
        assert [int(ln.split()[2]) for ln in lines[2:6]] == [3, 6, 8, 16]

        s = sweep["summary"]
        cross = _expected_crossover(rows)
        assert s["crossover_blocks"] == cross
        below = [r for r in rows if cross is None or r["blocks"] < cross]
        saved = [(r["cp"]["median_ms"] - r["local"]["median_ms"]) * 1e3 for r in below]
        assert s["sizes_below"] == len(below)
        if saved:
            assert s["saved_us"]["mean"] == pytest.approx(statistics.mean(saved))
            assert s["saved_us"]["median"] == pytest.approx(statistics.median(saved))
            assert s["saved_us"]["sum"] == pytest.approx(sum(saved))
        else:
            assert s["saved_us"] is None
        crossover, saved_line, auto_line = lines[6:9]
        if cross is not None and cross > 3:
            assert crossover.startswith(f"crossover: {cross} blocks (CP is faster"), crossover
            assert saved_line.startswith(f"below {cross} blocks, scoring locally saves"), text
        else:
            assert crossover.startswith("crossover: none found in the swept range (3 to 16"), text
        if saved:
            assert (
                f"mean {s['saved_us']['mean']:.1f} us, median {s['saved_us']['median']:.1f} us, "
                f"sum {s['saved_us']['sum']:.1f} us over {len(below)} sizes" in saved_line
            ), saved_line
        # the CPU one-process world shares one device: auto is 0, every size goes CP
        assert s["auto_threshold"] == 0 and s["auto_source"] == "shared device"
        assert all(r["auto_cp"] for r in rows)
        assert auto_line.startswith("cp_min_blocks='auto' on these ranks: 0 blocks (shared")
        assert f"faster path at {s['auto_faster_at']} of 4 sizes" in auto_line
    assert "Times: median per call in us over 2 timed repetitions (eager calls)" in stdout
    assert stdout.rstrip().endswith(f"wrote {out}")


def _deploy_res(op: str, rows: list[dict], threshold: int) -> dict:
    res = _res(rows, threshold=threshold, source="model", t_exchange_s=8e-6)
    res.update(op=op, mode="deployment", distinct_gpus=False)
    return res


def _deploy_row(requests, ctx, blocks, cp_us, local_us, auto, host_cp, host_local):
    row = _row(requests, ctx, blocks, cp_us, local_us, auto)
    best = min(cp_us, local_us)
    row["auto_within"] = (cp_us if auto else local_us) <= best * 1.05
    row["host_us"] = {"cp": host_cp, "local": host_local}
    return row


def test_deployment_tables_and_the_targets_under_them():
    """One GPU's deployment mode (hand-made results): host columns in the table, auto within
    5 % per sweep, and under the tables each op's crossover and threshold per format and T
    with the local path's targets (select/score host ratio, select's graph overhead)."""
    score = _deploy_res(
        "score_push",
        [
            _deploy_row(1, 4096, 32, 20.0, 8.0, False, 25.0, 24.0),
            _deploy_row(32, 131072, 32768, 100.0, 350.0, True, 26.0, 24.0),
        ],
        4000,
    )
    select = _deploy_res(
        "select_blocks",
        [
            _deploy_row(1, 4096, 32, 22.0, 10.0, False, 27.0, 28.0),
            _deploy_row(32, 131072, 32768, 101.0, 352.5, True, 28.0, 27.0),
        ],
        2000,
    )
    for res in (score, select):
        res["summary"] = gate_sweep.summary(res)
        assert res["summary"]["auto_within_5pct_at"] == 2
    lines = gate_sweep.table(select).splitlines()
    assert "one GPU, per rank per call as 4 GPUs would see it" in lines[0]
    assert lines[1].split()[-4:] == ["host", "CP", "host", "loc"]
    assert lines[2].split()[-2:] == ["27.0", "28.0"]
    assert "within 5 % of the faster path at 2 of 2 sizes" in gate_sweep.table(select)
    assert "host us per eager call (median over the sizes): CP 27.5, local 27.5" in (
        gate_sweep.table(select)
    )
    legend = gate_sweep.legend([score, select])
    want = (
        "  nvfp4 T=1: score_push crossover 32768, auto 4000 (within 5 % at 2/2); "
        "select_blocks crossover 32768, auto 2000 (within 5 % at 2/2); local select/score "
        "host 1.15x, local select - scan in a graph at most 2.5 us"
    )
    assert want in legend.splitlines(), legend
