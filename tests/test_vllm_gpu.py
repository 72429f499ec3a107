"""``cpindex.vllm`` on one GPU: the drop-in inside the one-process world (one thread and stream
per rank, heads = ranks), its calls captured in a CUDA graph and replayed with new inputs
written in place, checked against ``cpindex.reference``.

The one-process world's rules (docs/design.md; tests/test_transports_gpu.py) shape the rank
bodies: every buffer is allocated before the first push, inputs are refreshed with kernels
(``kernel_copy``), and results leave the GPU only after every rank has synchronized and met.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import assert_scores, kernel_copy, needs_gpu, unambiguous

from cpindex import formats, reference, testing
from cpindex import vllm as dropin
from cpindex.world import in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"
TOPK = 16


def _vllm_cache(cache: formats.Cache) -> torch.Tensor:
    """The same keys in vLLM's nvfp4 cache tensor ``uint8 [pages, 128, 72]``."""
    values, scales = formats.nvfp4_views(cache)
    out = torch.empty(values.shape[0], 128, 72, dtype=torch.uint8)
    v, s = formats.nvfp4_views(out)
    v.copy_(values)
    s.copy_(scales)
    return out


@pytest.mark.parametrize(
    ("world", "t", "two_dim"), [(4, 4, True), (4, 1, False), (2, 8, True), (4, 8, False)]
)
def test_graph_capture_and_replay(world, t, two_dim, monkeypatch):
    """Each rank builds the drop-in with its comm, checks the eager view, captures
    ``score_push`` and ``select_blocks`` in one graph, then replays it 60 times over 3 sets of
    queries, lengths and block tables. Every replay must repeat its set's first result (outputs
    are poisoned before each), and those results must match the reference."""
    monkeypatch.setenv("CPINDEX_TRANSPORT", "ipc")
    monkeypatch.setenv("CPINDEX_CACHE_FORMAT", "nvfp4")
    requests, blocks, n_var, replays = 5, 40, 3, 60
    base = testing.make_problem(
        requests, blocks * 128, "nvfp4", query_len=t, num_heads=world, seed=world * 10 + t
    )
    cache_cpu = _vllm_cache(base.index_cache)
    pages, width, rows = cache_cpu.shape[0], base.width, base.rows
    gen = torch.Generator().manual_seed(t)
    var = []  # (q [rows, W, 128], seq_lens, block_table) on the CPU
    for v in range(n_var):
        q = testing.make_problem(
            requests, blocks * 128, "nvfp4", query_len=t, num_heads=world, seed=100 + v
        ).q
        lens = testing.random_lengths(requests, blocks * 128, gen, min_len=t)
        table = torch.randint(0, pages, (requests, blocks), generator=gen, dtype=torch.int32)
        var.append((q, lens, table))
    cache = cache_cpu.to(DEV)

    def rank_inputs(q: torch.Tensor, rank: int) -> torch.Tensor:
        iq = q[:, rank : rank + 1].contiguous()
        return (iq[:, 0] if two_dim else iq).contiguous().to(DEV)

    var_dev = [
        [(rank_inputs(q, r), lens.to(DEV), table.to(DEV)) for (q, lens, table) in var]
        for r in range(world)
    ]
    base_dev = [
        (rank_inputs(base.q, r), base.seq_lens.to(DEV), base.block_table.to(DEV))
        for r in range(world)
    ]

    def body(comm):
        r = comm.rank
        cp = dropin.IndexCP(r, None, DEV, rows, width, comm=comm)
        try:
            assert (cp.rank, cp.world_size, cp.transport_name) == (r, world, "ipc")
            assert cp.capturable
            iq, sl, bt = (x.clone() for x in base_dev[r])  # the graph's static inputs
            eager = torch.empty(1, rows, width, device=DEV)
            out = torch.empty(1, rows, width, device=DEV)
            ids = torch.empty(1, rows, TOPK, dtype=torch.int32, device=DEV)
            keep = [(torch.empty_like(out), torch.empty_like(ids)) for _ in range(n_var)]
            seen = torch.zeros(1, rows, width, dtype=torch.bool, device=DEV)
            seen_ids = torch.zeros(1, rows, TOPK, dtype=torch.bool, device=DEV)
            diff = torch.empty_like(seen)
            diff_ids = torch.empty_like(seen_ids)
            torch.cuda.current_stream().synchronize()
            comm.barrier()  # every rank's buffers exist before any push

            # Eager, as the seed is called: a [1, rows, width] float32 view of the instance's
            # memory, the same memory on the next call.
            a = cp.score_push(iq, cache, bt, sl, 0, 1, width)
            kernel_copy(eager, a)
            b = cp.score_push(iq, cache, bt, sl, 0, 1, width, 0)
            view = (tuple(a.shape), a.dtype, a.data_ptr() == b.data_ptr())
            cp.select_blocks(iq, cache, bt, sl, 0, 1, width)
            torch.cuda.current_stream().synchronize()
            comm.barrier()

            graph = torch.cuda.CUDAGraph()

            def capture():  # one rank at a time: concurrent captures from threads fail
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    kernel_copy(out, cp.score_push(iq, cache, bt, sl, 0, 1, width))
                    kernel_copy(ids, cp.select_blocks(iq, cache, bt, sl, 0, 1, width, topk=TOPK))

            in_turn(comm, capture)
            torch.cuda.current_stream().synchronize()
            comm.barrier()
            for i in range(replays):
                v = i % n_var
                vq, vsl, vbt = var_dev[r][v]
                kernel_copy(iq, vq)
                kernel_copy(sl, vsl)
                kernel_copy(bt, vbt)
                out.fill_(float("nan"))
                ids.fill_(-7)
                graph.replay()
                if i < n_var:
                    kernel_copy(keep[v][0], out)
                    kernel_copy(keep[v][1], ids)
                else:  # the same inputs again: the same result (NaN, unwritten, differs too)
                    torch.ne(out, keep[v][0], out=diff)
                    torch.ne(ids, keep[v][1], out=diff_ids)
                    seen.logical_or_(diff)
                    seen_ids.logical_or_(diff_ids)
                if i % 20 == 19:  # bound the work in flight
                    torch.cuda.current_stream().synchronize()
            torch.cuda.current_stream().synchronize()  # releases the GIL; .cpu() would hold it
            comm.barrier()  # no push in flight anywhere: host copies are safe now
            return (
                view,
                eager.cpu(),
                [(s.cpu(), k.cpu()) for s, k in keep],
                int(seen.sum()) + int(seen_ids.sum()),
            )
        finally:
            cp.close()

    res = run_threads(world, body, device=DEV)

    want_base = reference.block_scores(
        base.q, cache_cpu, base.block_table, base.seq_lens, init_blocks=0, local_blocks=1,
        width=width, query_len=t,
    )  # fmt: skip
    wants = []
    for q, lens, table in var:
        kw = dict(init_blocks=0, local_blocks=1, width=width, query_len=t)
        scores = reference.block_scores(q, cache_cpu, table, lens, **kw)
        sel = reference.select_blocks(q, cache_cpu, table, lens, topk=TOPK, **kw)
        wants.append((scores, sel))
    for rank, (view, eager, kept, differing) in enumerate(res):
        assert view == ((1, rows, width), torch.float32, True), f"rank {rank}: {view}"
        assert_scores(eager, want_base[rank : rank + 1])
        assert differing == 0, f"rank {rank}: {differing} elements of replays differed"
        for (scores, ids), (want_scores, want_ids) in zip(kept, wants, strict=True):
            assert_scores(scores, want_scores[rank : rank + 1])
            ok = unambiguous(want_scores[rank : rank + 1], TOPK)
            assert torch.equal(ids[ok], want_ids[rank : rank + 1][ok]), f"rank {rank}"
