"""Swapping the seed's ``IndexCP`` for cpindex's: one import line, the same calls.

    python examples/vllm_swap.py [--world 2] [--steps 3] [--format nvfp4]

A serving stack that scores MiniMax-M3's index blocks through vLLM's ROCm indexer CP module
changes its import and nothing else::

    -from vllm.models.minimax_m3.amd.ops.index_cp import IndexCP
    +from cpindex.vllm import IndexCP

The constructor ``IndexCP(rank, group, device, max_rows, max_width)`` and the call
``score_push(iq, index_cache, block_table, seq_lens, init_blocks, local_blocks, width)`` keep
their positions and meanings: heads = world size, rank r owns head r, ``iq`` is this rank's
head ``[rows, 128]``, ``rows = requests * T`` with T read off ``rows / block_table.shape[0]``,
and the result is this rank's head, float32 ``[1, rows, width]``. Everything else comes from
``CPINDEX_*`` variables (``--format`` sets ``CPINDEX_CACHE_FORMAT``).

One process per rank (NCCL, one GPU each, when there are enough GPUs; otherwise gloo on the
CPU). Each rank keeps a replicated page pool (nvfp4: vLLM's ``uint8 [pages, 128, 72]``),
writes every new token's key into its slot (``cpindex.formats.write_keys``), decodes T = 4
rows per request per step, captures the call in a CUDA graph after one eager step where the
transport allows it, and checks its head against ``cpindex.reference`` every step.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts (docs/design.md)

import torch

from cpindex import formats, reference
from cpindex.spawn import spawn_processes
from cpindex.vllm import IndexCP  # was: from vllm.models.minimax_m3.amd.ops.index_cp import ...

T = 4  # query rows per request per step
PROMPTS = [700, 300, 129]  # prefilled tokens per request
MAX_BLOCKS = 16  # per request: up to 2048 tokens; also the score width
PAGES = len(PROMPTS) * MAX_BLOCKS + 2


def empty_cache(fmt: str, device: torch.device) -> torch.Tensor:
    """The index-key page pool as the model allocates it, zeroed."""
    if fmt == "nvfp4":
        return torch.zeros(PAGES, 128, 72, dtype=torch.uint8, device=device)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    return torch.zeros(PAGES, 128, 128, device=device).to(dtype)


def rms_normed(gen: torch.Generator, n: int) -> torch.Tensor:
    x = torch.randn(n, 128, generator=gen)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def rank_main(rank: int, world: int, steps: int, use_cuda: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    requests = len(PROMPTS)
    cp = IndexCP(rank, None, device, requests * T, MAX_BLOCKS)  # collective, once
    try:
        decode(cp, rank, world, steps, device)
    finally:
        cp.close()  # collective


def decode(cp: IndexCP, rank: int, world: int, steps: int, device: torch.device) -> None:
    fmt, requests = cp.config.cache_format, len(PROMPTS)
    gen = torch.Generator().manual_seed(0)  # the same on every rank: a replicated cache
    cache = empty_cache(fmt, device)
    # Each request's blocks on pages scattered over the pool, as a paged-KV allocator leaves them.
    table_host = torch.randperm(PAGES, generator=gen)[: requests * MAX_BLOCKS]
    table_host = table_host.view(requests, MAX_BLOCKS).to(torch.int32)
    lens = list(PROMPTS)
    for r, n in enumerate(PROMPTS):  # prefill
        pos = torch.arange(n)
        slots = (table_host[r, pos // 128] * 128 + pos % 128).to(device)  # page * 128 + token
        formats.write_keys(cache, rms_normed(gen, n).to(device), slots)

    # Static inputs: a captured graph reads these addresses, so each step refreshes them in place.
    iq = torch.zeros(requests * T, 128, device=device).to(formats.query_dtype(fmt))
    table = table_host.to(device)
    seq_lens = torch.zeros(requests, dtype=torch.int32, device=device)
    graph, out = None, None
    if rank == 0:
        print(f"{world} ranks, transport {cp.transport_name}, cache {fmt} "
              f"{list(cache.shape)}, capturable {cp.capturable}")  # fmt: skip

    for step in range(steps):
        for r in range(requests):  # this step's T new tokens of each request
            pos = torch.arange(lens[r], lens[r] + T)
            slots = (table_host[r, pos // 128] * 128 + pos % 128).to(device)
            formats.write_keys(cache, rms_normed(gen, T).to(device), slots)
            lens[r] += T
        q_all = (torch.randn(requests * T, world, 128, generator=gen) * 2).to(iq.dtype)
        iq.copy_(q_all[:, rank].to(device))  # this rank's head only
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

        args = (iq, cache, table, seq_lens, 0, 1, MAX_BLOCKS)  # the seed's call
        if graph is not None:
            graph.replay()
        elif cp.capturable and step > 0:  # capture after one eager call on every rank
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = cp.score_push(*args)
            graph.replay()
        else:
            out = cp.score_push(*args)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

        want = reference.block_scores(
            q_all.to(device), cache, table, seq_lens, init_blocks=0, local_blocks=1,
            width=MAX_BLOCKS, query_len=T, sm_scale=cp.config.sm_scale,
        )[rank : rank + 1]  # fmt: skip
        assert out is not None and out.shape == (1, requests * T, MAX_BLOCKS)
        check(out, want, rank, step)
        if rank == 0:
            print(f"step {step}: {requests} requests x {T} rows, lengths {lens}, "
                  f"{'graph replay' if graph is not None else 'eager call'}; "
                  "matches the reference")  # fmt: skip


def check(got: torch.Tensor, want: torch.Tensor, rank: int, step: int) -> None:
    """Same -inf / forced pattern; scanned scores within 1e-5 of the largest |score| (fp32
    summation order on a GPU); equal on the CPU, where the reference itself scores."""
    finite = torch.isfinite(want) & (want.abs() < 1e29)
    same_pattern = torch.equal(got[~finite], want[~finite])
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got - want)[finite].abs().max().item() if finite.any() else 0.0
    if not same_pattern or err > 1e-5 * scale:
        raise SystemExit(f"rank {rank}, step {step}: scores differ from the reference ({err})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, choices=[1, 2, 4], help="ranks = heads")
    ap.add_argument("--steps", type=int, default=3, help="decode steps")
    ap.add_argument("--format", dest="fmt", default="nvfp4", choices=["bf16", "fp8", "nvfp4"])
    args = ap.parse_args()
    os.environ["CPINDEX_CACHE_FORMAT"] = args.fmt  # the ranks' IndexCP reads it
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus >= args.world  # one GPU per rank, else the CPU
    spawn_processes(
        args.world, rank_main, args.steps, use_cuda, backend="nccl" if use_cuda else "gloo"
    )
    print("vllm_swap: every rank matched the reference at every step")


if __name__ == "__main__":
    main()
