"""``IndexCP.uses_cp`` answers per op: ``score_push`` and ``select_blocks`` have a threshold each
(cpindex/gate.py), and the answer for a plan equals the one for its ``(requests, width)``."""

from __future__ import annotations

import pytest
import torch

from cpindex import CPIndexConfig, IndexCP, gate
from cpindex.world import run_threads


def test_uses_cp_answers_per_op(monkeypatch):
    monkeypatch.setattr(gate, "resolve", lambda *a: gate.Gate(24, "model", select_threshold=30))
    cfg = CPIndexConfig(cache_format="fp8", num_heads=2, max_rows=16, max_width=24)

    def body(comm):
        with IndexCP(cfg, device="cpu", comm=comm) as cp:
            table = torch.zeros(2, 14, dtype=torch.int32)
            plan = cp.plan(table, torch.full((2,), 14 * 128, dtype=torch.int32))  # 28 blocks
            got = [cp.uses_cp(plan), cp.uses_cp(plan, "select_blocks"), cp.uses_cp((2, 16))]
            got.append(cp.uses_cp((2, 16), "select_blocks"))
            with pytest.raises(ValueError, match="op"):
                cp.uses_cp(plan, "topk")
            return got

    assert run_threads(2, body) == [[True, False, True, True]] * 2
