"""A decode loop as a serving stack would run it, with cpindex scoring the index blocks.

    python examples/decode_step.py [--world 2] [--steps 4] [--format nvfp4]

One process per rank: NCCL with one GPU each when there are at least two GPUs, otherwise gloo
processes on the CPU (a single GPU cannot hold one process per rank; examples/ab_transports.py
shows the one-process world that can). Every process:

1. joins torch.distributed, then calls ``cpindex.init(config)`` once; the decode loop reaches the
   instance through ``cpindex.get()``;
2. keeps the index-key cache as a pool of pages that is identical on every rank (the index keys
   have one head shared by all index heads, so tensor parallelism replicates them); each new
   token's key is written into its slot by ``cpindex.formats.write_keys``, which quantizes it;
3. decodes ``T = 4`` tokens per request per step (speculative / multi-token prediction): ``iq``
   has ``requests * T`` rows, request-major, and ``block_table``/``seq_lens`` one row per request;
4. makes the step's plan (``cp.plan``) once over static ``block_table``/``seq_lens`` tensors that
   every step refills in place, so one plan serves every step and layer; on a GPU whose transport
   can be captured, records the call in a CUDA graph once and replays it every step;
5. checks this rank's scores against ``cpindex.reference.block_scores`` every step;
6. calls ``cpindex.shutdown()`` at the end.

The ids sparse attention reads come from ``select_blocks`` (same inputs; docs/contract.md §6),
called here once per step after the scores are checked.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts (docs/design.md)

import torch

import cpindex
from cpindex import formats, partition, reference
from cpindex.spawn import spawn_processes

T = 4  # query tokens per request per step
REQUESTS = 3
MAX_BLOCKS = 24  # per request: up to 3072 tokens
HEADS = 4  # MiniMax-M3's index heads
PROMPTS = [2500, 260, 131]  # prefilled tokens per request


class Cache:
    """A page pool with a per-request block table, as a paged-KV serving stack keeps it."""

    def __init__(self, fmt: str, pages: int, device: torch.device) -> None:
        self.fmt = fmt
        self.pages = formats.quantize(torch.zeros(pages, 128, 128), fmt).to(device)
        self.free = list(range(pages))
        self.table = torch.zeros(REQUESTS, MAX_BLOCKS, dtype=torch.int32)  # host copy
        self.lens = [0] * REQUESTS

    def append(self, request: int, keys: torch.Tensor) -> None:
        """Store the keys of the request's next tokens (float ``[n, 128]``)."""
        n = keys.shape[0]
        pos = torch.arange(self.lens[request], self.lens[request] + n)
        for block in sorted(set((pos // 128).tolist())):
            if block * 128 >= self.lens[request]:  # a new block: take a page from the pool
                self.table[request, block] = self.free.pop(0)
        slots = self.table[request, pos // 128].long() * 128 + pos % 128  # page * 128 + token
        device = self.pages.device
        formats.write_keys(self.pages, keys.to(device), slots.to(device))
        self.lens[request] += n


def rms_normed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random keys with unit RMS, like MiniMax-M3's normalized index keys."""
    x = torch.randn(*shape, generator=gen)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def rank_main(rank: int, world: int, steps: int, fmt: str, use_cuda: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    config = cpindex.CPIndexConfig(
        cache_format=fmt, max_rows=REQUESTS * T, max_query_len=T, max_width=MAX_BLOCKS
    )
    cpindex.init(config, device=device)  # collective: every rank, once
    try:
        decode(rank, world, steps, fmt, device)
    finally:
        cpindex.shutdown()  # collective: releases buffers and peer mappings


def decode(rank: int, world: int, steps: int, fmt: str, device: torch.device) -> None:
    cp = cpindex.get()
    heads = partition.heads_of_rank(rank, HEADS, world)  # the heads whose scores land here
    gen = torch.Generator().manual_seed(0)  # same seed on every rank: a replicated cache
    cache = Cache(fmt, REQUESTS * MAX_BLOCKS + 4, device)
    for r, n in enumerate(PROMPTS):  # prefill
        cache.append(r, rms_normed(gen, n, 128))

    # Static inputs: a captured graph reads these addresses, so they are refreshed in place.
    iq = torch.zeros(REQUESTS * T, len(heads), 128, device=device).to(formats.query_dtype(fmt))
    table = torch.zeros(REQUESTS, MAX_BLOCKS, dtype=torch.int32, device=device)
    lens = torch.zeros(REQUESTS, dtype=torch.int32, device=device)
    graph, out, plan = None, None, None
    if rank == 0:
        print(f"transport {cp.transport_name}, {world} ranks, format {fmt}, capturable "
              f"{cp.capturable}; rank 0 owns heads {heads}")  # fmt: skip

    for step in range(steps):
        for r in range(REQUESTS):  # this step's T new tokens per request
            cache.append(r, rms_normed(gen, T, 128))
        q_all = (torch.randn(REQUESTS * T, HEADS, 128, generator=gen) * 2).to(iq.dtype)
        iq.copy_(q_all[:, heads[0] : heads[-1] + 1].to(device))
        table.copy_(cache.table.to(device))
        lens.copy_(torch.tensor(cache.lens, dtype=torch.int32).to(device))
        if plan is None:  # one plan for the whole decode: its tensors are refilled in place
            plan = cp.plan(table, lens, query_len=T, width=MAX_BLOCKS)

        # The tag names the call on every rank: its layer here (one layer). A captured call
        # replays with the tag it was captured with, so a per-layer tag suits graphs.
        if graph is not None:
            graph.replay()
        elif cp.capturable and step > 0:  # capture after one eager call on every rank
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = cp.score_push(iq, cache.pages, plan, tag=0)
            graph.replay()
        else:
            out = cp.score_push(iq, cache.pages, plan, tag=0)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

        want = reference.block_scores(
            q_all.to(device), cache.pages, table, lens, init_blocks=0, local_blocks=1,
            width=MAX_BLOCKS, query_len=T, sm_scale=cp.config.sm_scale,
        )[heads[0] : heads[-1] + 1]  # fmt: skip
        check(out, want, rank, step)
        # What sparse attention reads: block-table columns [hpr, rows, 16], -1 padded.
        top = cp.select_blocks(iq, cache.pages, plan, tag=1)
        if rank == 0:
            print(f"step {step}: {REQUESTS} requests x {T} tokens, lengths {cache.lens}, "
                  f"{'graph replay' if graph is not None else 'eager call'}; matches the "
                  f"reference; request 0, token 0, head {heads[0]} reads blocks "
                  f"{[b for b in top[0, 0].tolist() if b >= 0]}")  # fmt: skip


def check(got: torch.Tensor, want: torch.Tensor, rank: int, step: int) -> None:
    """Same -inf/forced pattern; scanned scores within 1e-5 of the row's largest |score|
    (docs/contract.md §3); equal on CPU, where the reference itself scores."""
    finite = torch.isfinite(want) & (want.abs() < 1e29)
    same_pattern = torch.equal(got[~finite], want[~finite])
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got - want)[finite].abs().max().item() if finite.any() else 0.0
    if not same_pattern or err > 1e-5 * scale:
        raise SystemExit(f"rank {rank}, step {step}: scores differ from the reference ({err})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, choices=[1, 2, 4], help="ranks")
    ap.add_argument("--steps", type=int, default=4, help="decode steps")
    ap.add_argument("--format", dest="fmt", default="nvfp4", choices=["bf16", "fp8", "nvfp4"])
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus >= args.world  # one GPU per rank, else the CPU
    spawn_processes(
        args.world,
        rank_main,
        args.steps,
        args.fmt,
        use_cuda,
        backend="nccl" if use_cuda else "gloo",
    )
    print("decode_step: every rank matched the reference at every step")


if __name__ == "__main__":
    main()
