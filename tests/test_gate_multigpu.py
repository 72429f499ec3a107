"""``cp_min_blocks="auto"`` on distinct GPUs (one process per GPU over NCCL): the fixed costs
are measured at construction (gate.py's model), each op gets its threshold from them, and every
rank holds the same two thresholds. Skipped unless the machine has 2 GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from cpindex import CPIndexConfig, IndexCP, gate
from cpindex.spawn import spawn_processes

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _rank(rank: int, world: int, path: str) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    report = {}
    for t in ("ipc", "collective"):
        cfg = CPIndexConfig(transport=t, max_rows=32, max_width=1024, cp_min_blocks="auto")
        with IndexCP(cfg, device=dev) as cp:
            g = cp.gate
            report[t] = {
                "source": g.source,
                "thresholds": [g.threshold_for(op) for op in gate.OPS],
                "extra_s": list(g.extra_s or ()),
                "model": [
                    gate.crossover_blocks(d, g.bandwidth, g.page_bytes, world)
                    for d in (g.extra_s or ())
                ],
                "cp_min_blocks": cp.cp_min_blocks,
            }
    with open(f"{path}/rank{rank}.json", "w") as f:
        json.dump(report, f)


def test_auto_measures_each_op_on_distinct_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    spawn_processes(2, _rank, str(tmp_path), backend="nccl")
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for t in ("ipc", "collective"):
        a, b = reps[0][t], reps[1][t]
        assert a["source"] == "measured", a
        assert a["thresholds"] == b["thresholds"] and a["extra_s"] == b["extra_s"], (a, b)
        # the ranks' largest D(op) gives the ranks' largest threshold
        assert a["thresholds"] == a["model"], a
        assert a["cp_min_blocks"] == a["thresholds"][0]
        assert a["extra_s"][0] > 0, a  # the exchange costs something; select may not
