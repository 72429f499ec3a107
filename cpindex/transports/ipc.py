"""``ipc``: raw peer writes into memory mapped through CUDA/HIP IPC handles.

Each rank allocates one region (cudaMalloc on CUDA; uncached, fine-grained
``hipExtMallocWithFlags(hipDeviceMallocUncached)`` on ROCm, so peers' stores and flags are seen
without cache maintenance), exports an IPC handle, and opens every peer's handle once, at
construction. In a one-process world (:func:`cpindex.world.run_threads`) the regions are plain
allocations of the shared GPU and their addresses are exchanged as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels
from .base import Context, register
from .peer import (
    PeerLayout,
    PeerPushTransport,
    PushEngine,
    agree,
    guarded,
    identity,
    push_probe,
    shared_gpu_reason,
)


def peer_access_verdict(ctx: Context, ids: list[dict]) -> tuple[bool, str]:
    """Can this rank write into every peer's memory? Decided from the gathered identities."""
    me = ids[ctx.rank]
    shared = shared_gpu_reason(ctx, ids)
    if shared:
        return False, shared
    for p, other in enumerate(ids):
        if other["host"] != me["host"]:
            return False, f"rank {p} is on another host ({other['host']}); ipc is intra-node"
        if p == ctx.rank:
            continue
        if other["uuid"] in me["visible"] and other["uuid"] != me["uuid"]:
            peer_index = me["visible"].index(other["uuid"])
            if not kernels.load(ctx.device).can_access_peer(me["index"], peer_index):
                return (
                    False,
                    f"no peer access from GPU {me['index']} to rank {p}'s GPU {peer_index}",
                )
    return True, "peer access between every pair"


@register
class IpcTransport(PeerPushTransport):
    name = "ipc"

    @classmethod
    def probe(cls, ctx: Context) -> tuple[bool, str]:
        ok, why = push_probe(ctx)
        if not ok:
            return False, why
        return True, "fused kernel writes scores straight into peers' buffers"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._ptr = 0
        self._opened: list[int] = []
        self.engine: PushEngine | None = None
        mod = kernels.load(ctx.device)
        ids = ctx.comm.all_gather_object(identity(ctx))
        ok, why = peer_access_verdict(ctx, ids)
        agree(ctx, ok, why, "ipc peer-access check")
        self.peer_access = why
        layout = PeerLayout(ctx.config, ctx.world)
        dev = ctx.device.index
        self._ptr = guarded(
            ctx, "ipc buffer allocation", lambda: mod.peer_malloc(layout.total, dev)
        )
        if ctx.comm.same_process:
            bases = ctx.comm.all_gather_object(self._ptr)
        else:
            handles = ctx.comm.all_gather_object(mod.ipc_handle(self._ptr, dev))

            def open_all() -> list[int]:
                out = []
                for p, h in enumerate(handles):
                    if p == ctx.rank:
                        out.append(self._ptr)
                    else:
                        out.append(mod.ipc_open(h, dev))
                        self._opened.append(out[-1])
                return out

            bases = guarded(ctx, "opening peers' IPC handles", open_all)
        self.engine = PushEngine(ctx, layout, bases, mod.clock_ticks_per_second(dev))

    def close(self, meet: Callable[[], object] | None = None) -> None:
        if self._ptr == 0:
            return
        mod = kernels.load(self.ctx.device)
        dev = self.ctx.device.index
        torch.cuda.synchronize(self.ctx.device)
        (meet or self.ctx.comm.barrier)()  # no peer still writes into memory about to go away
        for p in self._opened:
            mod.ipc_close(p, dev)
        self._opened.clear()
        self.engine = None
        mod.peer_free(self._ptr, dev)
        self._ptr = 0
