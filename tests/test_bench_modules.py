"""The benchmark modules on a CPU: they import without a GPU, their tables render hand-made
results (no timing here: speed is never asserted), and the write sweep's slot patterns and its
written-bytes check hold on CPU tensors."""

from __future__ import annotations

import torch

from cpindex import formats
from cpindex.bench import agree_cost, host_cost, write_sweep


def test_write_table_renders():
    res = {
        "copy_gbs": 3900.0,
        "write": [
            {
                "format": "nvfp4", "tokens": 32, "pattern": "decode", "sets": 16,
                "bytes": 32 * 336, "kernel_ms": 0.0021, "gbs": 5.1, "of_copy": 0.0013,
                "host_us": 7.5, "agree": True, "scatter_bytes": 32 * 152,
                "scatter_ms": 0.0030, "scatter_gbs": 1.6, "scatter_of_copy": 0.0004,
                "scatter_host_us": 9.1,
            },
            {
                "format": "bf16", "tokens": 65536, "pattern": "prefill", "sets": 16,
                "bytes": 65536 * 520, "kernel_ms": 0.021, "gbs": 1622.0, "of_copy": 0.416,
                "host_us": 8.0, "agree": False, "scatter_bytes": 65536 * 520,
                "scatter_ms": 0.042, "scatter_gbs": 811.0, "scatter_of_copy": 0.208,
                "scatter_host_us": 12.0,
            },
        ],
    }  # fmt: skip
    text = write_sweep.table(res)
    lines = text.splitlines()
    assert len(lines) == 4 and "3900 GB/s" in lines[0]
    assert "scatter us" in lines[1] and "agree" in lines[1]
    assert lines[2].split()[:3] == ["nvfp4", "32", "decode"] and lines[2].endswith("yes")
    assert "2.00x" in lines[3] and lines[3].endswith("NO")  # scatter 42 us over write 21 us
    assert "scatter" in write_sweep.LEGEND


def test_host_table_renders():
    base = {"format": "nvfp4", "rows": 8, "query_len": 4, "context": 32768, "bytes": 18 << 20}
    res = {
        "copy_gbs": 4000.0,
        "plan": True,
        "fingerprint": None,
        "host": [
            {**base, "entry": "IndexCP.score_push", "transport": "ipc", "host_us": 30.0,
             "host_p90_us": 41.0, "gpu_us": 10.0, "gpu_how": "graph"},
            {**base, "entry": "IndexCP.select_blocks(plan)", "transport": "collective",
             "host_us": 4.0, "host_p90_us": 5.0, "gpu_us": 40.0, "gpu_how": "events"},
            {**base, "entry": "Triton peer (bf16)", "transport": "", "host_us": 58.0,
             "host_p90_us": 60.0, "gpu_us": 20.0, "gpu_how": "graph", "bytes": 64 << 20},
        ],
    }  # fmt: skip
    text = host_cost.table(res)
    assert "nvfp4, 8 requests x 32K, T = 4" in text
    rows = [ln for ln in text.splitlines() if "IndexCP" in ln or "Triton" in ln]
    assert len(rows) == 3
    assert rows[0].split()[:3] == ["IndexCP.score_push", "ipc", "30.0"] and "3.00x" in rows[0]
    assert "events" in rows[1] and "0.10x" in rows[1]
    assert "no plan rows" in host_cost.table({**res, "plan": False})
    assert "fingerprint off" in host_cost.table({**res, "fingerprint": False})


def test_agree_table_renders():
    rec = {
        "format": "nvfp4", "rows": 32, "query_len": 4, "context": 131072, "world": 4,
        "call": "score_push", "form": "positional", "off_ms": 0.100, "on_ms": 0.101,
        "diff_us": 1.0, "diff_pct": 1.0, "agree": True, "bytes": 300 << 20,
        "copy_gbs": 4000.0, "refresh_ms": None,
    }  # fmt: skip
    plan = {**rec, "form": "plan", "on_ms": 0.0999, "diff_us": -0.1, "diff_pct": -0.1,
            "refresh_ms": 0.004, "agree": False}  # fmt: skip
    res = {"world": 4, "format": "nvfp4", "query_len": 4, "agree": [rec, plan]}
    lines = agree_cost.table(res).splitlines()
    assert "W = 4" in lines[0] and "4000 GB/s" in lines[0]
    assert lines[2].split()[:8] == [
        "32", "128K", "score_push", "positional", "100.00", "101.00", "+1.00", "+1.00%",
    ]  # fmt: skip
    assert "4.00" in lines[3] and "-0.10" in lines[3] and lines[3].endswith("NO")
    assert "NOTE" not in agree_cost.table(res)
    assert agree_cost.table({"skipped": "no field"}) == "bench --agree skipped: no field"


def test_agree_run_skips_without_the_field(monkeypatch):
    monkeypatch.setattr(agree_cost, "has_fingerprint", lambda: False)
    res = agree_cost.run()  # returns before any device work
    assert "fingerprint" in res["skipped"]


def test_write_slot_patterns_are_disjoint():
    gen = torch.Generator().manual_seed(0)
    for tokens, want in ((32, "decode"), (300, "decode"), (1024, "prefill"), (1100, "prefill")):
        assert write_sweep.pattern(tokens) == want
        pages, slots = write_sweep._slot_sets(tokens, 3, gen, torch.device("cpu"))
        assert slots.shape == (3, tokens) and slots.dtype == torch.int64 and slots.is_contiguous()
        flat = slots.view(-1)
        assert flat.unique().numel() == flat.numel()  # no two keys of any sets share a slot
        assert int(flat.min()) >= 0 and int(flat.max()) < pages * formats.PAGE_TOKENS
        page, token = slots // formats.PAGE_TOKENS, slots % formats.PAGE_TOKENS
        if want == "decode":  # a page per key
            assert page.view(-1).unique().numel() == flat.numel()
        else:  # whole pages in order: every 128 keys one page, tokens 0..127
            full = tokens // formats.PAGE_TOKENS * formats.PAGE_TOKENS
            assert torch.equal(token[:, :full] % formats.PAGE_TOKENS,
                               torch.arange(full).remainder(128).expand(3, -1))  # fmt: skip
            assert (page[:, :full].view(3, -1, 128) == page[:, :full:128, None]).all()


def test_written_bytes_read_what_quantize_stores():
    """The sweep's check reads each slot's bytes back; on a cache quantize filled, at scattered
    slots, they are quantize's bytes for those keys (and another key's bytes differ)."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 128, 128, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([255, 0, 130, 7, 128])
    flat = keys.view(-1, 128)
    for fmt in ("bf16", "fp8", "nvfp4"):
        cache = formats.quantize(keys, fmt)
        got = write_sweep.written_bytes(cache, fmt, slots)
        assert got.shape == (5, formats.BYTES_PER_TOKEN[fmt]) and got.dtype == torch.uint8
        assert torch.equal(got, write_sweep.expected_bytes(flat[slots], fmt)), fmt
        assert not torch.equal(got, write_sweep.expected_bytes(flat[(slots + 1) % 256], fmt)), fmt
