"""``cpindex.bench.gate_sweep`` on a CPU: the crossover it reports, its table from hand-made
results (speed is never asserted), and one tiny sweep end to end in the CPU one-process world,
where both paths must agree bit for bit."""

from __future__ import annotations

from cpindex.bench import gate_sweep


def _row(requests: int, ctx: int, blocks: int, cp_us: float, local_us: float, auto: bool):
    return {
        "requests": requests, "context": ctx, "blocks": blocks, "agree": True, "auto_cp": auto,
        "cp": {"median_ms": cp_us / 1e3}, "local": {"median_ms": local_us / 1e3},
    }  # fmt: skip


def _res(rows, **gate):
    return {
        "format": "nvfp4", "op": "score_push", "world": 4, "query_len": 1, "transport": "ipc",
        "device": "cuda:0", "distinct_gpus": True, "rows": rows,
        "gate": {"threshold": 4000, "source": "measured", "t_exchange_s": 9e-6,
                 "bandwidth": 4.8e12, "page_bytes": 9216, **gate},
    }  # fmt: skip


def test_crossover_is_where_cp_wins_from_there_on():
    rows = [
        _row(1, 4096, 32, 20.0, 8.0, False),
        _row(8, 4096, 256, 22.0, 12.0, False),
        _row(1, 131072, 1024, 30.0, 31.0, False),  # CP wins here, but not at 2048
        _row(16, 16384, 2048, 33.0, 29.0, False),
        _row(32, 65536, 16384, 60.0, 180.0, True),
        _row(32, 131072, 32768, 100.0, 350.0, True),
    ]
    assert gate_sweep.crossover(rows) == 16384
    assert gate_sweep.crossover(rows[:4]) is None
    assert gate_sweep.crossover(rows[4:]) == 16384


def test_table_renders():
    rows = [
        _row(1, 4096, 32, 20.0, 8.0, False),
        _row(32, 131072, 32768, 100.0, 350.0, True),
        _row(4, 16384, 512, 24.0, 16.0, False),
    ]
    text = gate_sweep.table(_res(rows))
    lines = text.splitlines()
    assert "nvfp4, score_push, W = 4" in lines[0] and "share" not in lines[0]
    assert lines[2].split() == ["1", "4K", "32", "20.0", "8.0", "0.40", "12.0", "local", "yes"]
    assert lines[4].split()[:3] == ["32", "128K", "32768"] and lines[4].split()[-2] == "CP"
    assert "crossover at 32768 blocks" in text
    assert "saves 10.0 us per call on average (47 % of the CP time; 2 sizes)" in text
    assert "4000 blocks (measured: t_exchange 9.0 us, 4.80 TB/s, 9216-byte pages)" in text
    assert "faster path at 3 of 3 sizes" in text
    never = gate_sweep.table(_res(rows[:1], t_exchange_s=None, source="shared device"))
    assert "CP is not faster" in never and "(shared device)" in never
    assert "saved us" in gate_sweep.LEGEND


def test_a_tiny_sweep_on_the_cpu():
    res = gate_sweep.run(world=2, requests=[1, 2], contexts=[300], iters=2, op="select_blocks")
    assert [r["blocks"] for r in res["rows"]] == [3, 6]
    assert all(r["agree"] for r in res["rows"])
    assert res["gate"]["threshold"] == 0 and res["transport"] == "collective"
    assert "CPU ranks" in gate_sweep.table(res)
