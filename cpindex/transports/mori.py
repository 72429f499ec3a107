"""``mori``: the peer push of :mod:`.peer` over MORI shmem symmetric memory (ROCm only).

Each rank takes its region from MORI's symmetric heap (uncached by default, so peers' stores and
flags are seen without cache maintenance) and asks MORI for every peer's address of it
(``shmem_ptr_p2p``: the XGMI mapping, or 0 for a peer reachable only by RDMA). From there the
push is exactly ``ipc``'s: the fused kernel stores into peers' regions and raises flags; no MORI
device code runs.

MORI is imported lazily (:func:`mori_status`), never at ``import cpindex``. It keeps one shmem
world per process, so the transport initialises it once and counts its users: several
:class:`cpindex.IndexCP` instances over one group share the initialisation, and the last
``close()`` finalizes it. MORI API used (``python/mori/shmem/api.py``, ``docs/MORI-SHMEM-GUIDE.md``
in ROCm/mori): ``shmem_torch_process_group_init``, ``shmem_mype``, ``shmem_npes``,
``shmem_malloc_align``, ``shmem_ptr_p2p``, ``shmem_free``, ``shmem_finalize``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import kernels
from ..errors import TransportUnavailable
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
    view_bytes,
)

log = logging.getLogger("cpindex")

INSTALL = "pip install cpindex[rocm]"
_ALIGN = 256  # region base alignment: PeerLayout's offsets assume 256-byte aligned bases


@functools.cache
def mori_status() -> tuple[bool, str]:
    """Can ``mori.shmem`` be imported here? ``(ok, reason)``; the import is tried once."""
    needs = (
        f"install it with `{INSTALL}` (PyPI amd-mori), which needs a ROCm build of torch and the "
        "ROCm 7 runtime (libamdhip64, libhsa-runtime64)"
    )
    if sys.version_info[:2] not in ((3, 10), (3, 12)):
        needs += (
            "; amd-mori publishes wheels for CPython 3.10 and 3.12 only (this is "
            f"{sys.version_info[0]}.{sys.version_info[1]})"
        )
    try:
        import mori.shmem  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "mori":
            return False, f"MORI is not installed (no module 'mori'): {needs}"
        return False, f"MORI is not importable (ModuleNotFoundError: {e}): {needs}"
    except ImportError as e:
        return False, f"MORI is not importable (ImportError: {e}): {needs}"
    except OSError as e:
        return False, f"MORI is installed, its ROCm libraries did not load (OSError: {e}): {needs}"
    except Exception as e:  # a broken install must not crash transport selection
        return False, f"`import mori.shmem` failed ({type(e).__name__}: {e}): {needs}"
    try:
        from importlib.metadata import version

        return True, f"MORI {version('amd-mori')}"
    except Exception:
        return True, "MORI (version unknown)"


def _shmem() -> Any:
    import mori.shmem

    return mori.shmem


# ---- one MORI shmem world per process, shared by every instance over the same ranks ----------


@dataclass
class _Session:
    ranks: tuple[int, ...]  # global ranks of the group MORI was initialised over
    name: str  # the name the bootstrap group is registered under
    boot: Any  # the CPU (gloo) group MORI bootstraps over
    own_boot: bool  # created here (destroyed at finalize)
    refs: int = 1


_lock = threading.Lock()
_session: _Session | None = None
_names = itertools.count()


def _session_ranks() -> tuple[int, ...] | None:
    with _lock:
        return _session.ranks if _session is not None else None


def _acquire(ctx: Context, ranks: tuple[int, ...], fresh: bool) -> _Session:
    """Initialise MORI over ``ranks`` (collective when ``fresh``) or take another reference."""
    global _session
    with _lock:
        if not fresh:
            assert _session is not None and _session.ranks == ranks
            _session.refs += 1
            return _session
        shmem = _shmem()
        group = ctx.comm.group  # type: ignore[attr-defined]
        # MORI's bootstrap exchanges host buffers, so it needs a CPU-capable group.
        if "gloo" in str(dist.get_backend(group)):
            boot, own = group, False
        else:
            boot = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            own = True
        name = f"cpindex_mori_{os.getpid()}_{next(_names)}"
        torch._C._distributed_c10d._register_process_group(name, boot)
        session = _Session(ranks, name, boot, own)
        with torch.cuda.device(ctx.device):
            status = shmem.shmem_torch_process_group_init(name)
        if status not in (0, None):
            _forget(session)
            raise RuntimeError(f"shmem_torch_process_group_init returned {status}")
        _session = session
        pe, npes = shmem.shmem_mype(), shmem.shmem_npes()
        if (pe, npes) != (ctx.rank, ctx.world):
            _release(session)
            raise RuntimeError(
                f"MORI numbers this process PE {pe} of {npes}, but it is rank {ctx.rank} of "
                f"{ctx.world} in the cpindex group; peer addresses would go to the wrong ranks"
            )
        return session


def _forget(session: _Session) -> None:
    unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
    if unregister is not None:
        try:
            unregister(session.name)
        except Exception as e:
            log.debug("cpindex: unregistering %s: %s", session.name, e)
    if session.own_boot:
        try:
            dist.destroy_process_group(session.boot)
        except Exception as e:
            log.debug("cpindex: destroying MORI's bootstrap group: %s", e)


def _release(session: _Session) -> None:
    """Drop one reference; the last one finalizes MORI. Idempotent per reference."""
    global _session
    if session.refs <= 0:
        return
    session.refs -= 1
    if session.refs:
        return
    if _session is session:
        _session = None
    try:
        _shmem().shmem_finalize()
    finally:
        _forget(session)


@register
class MoriTransport(PeerPushTransport):
    name = "mori"

    @classmethod
    def probe(cls, ctx: Context) -> tuple[bool, str]:
        if ctx.device.type != "cuda":
            return False, f"needs a ROCm GPU (this rank runs on {ctx.device.type})"
        if torch.version.hip is None:
            if torch.version.cuda:
                return False, f"mori needs ROCm; this torch is built for CUDA {torch.version.cuda}"
            return False, "mori needs ROCm; this torch is CPU-only"
        if ctx.comm.same_process:
            return False, (
                "the one-process world has no MORI (MORI runs one PE per process); use ipc there"
            )
        ok, why = mori_status()
        if not ok:
            return False, why
        if os.environ.get("MORI_SHMEM_HEAP_TYPE", "").lower() == "normal":
            return False, (
                "MORI_SHMEM_HEAP_TYPE=normal makes the symmetric heap cached; the push handshake "
                "needs MORI's default uncached heap (unset MORI_SHMEM_HEAP_TYPE)"
            )
        ok, kwhy = push_probe(ctx)
        if not ok:
            return False, kwhy
        return True, f"{why}: fused kernel writes scores into peers' symmetric-heap regions"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._raw = 0  # what shmem_malloc_align returned (freed at close)
        self._ptr = 0  # the 256-aligned region base inside it
        self._session: _Session | None = None
        self.engine: PushEngine | None = None
        try:
            self._setup(ctx)
        except BaseException:
            self._teardown()  # every rank raises here: agree/guarded made the failure common
            raise

    def _setup(self, ctx: Context) -> None:
        mod = kernels.load(ctx.device)
        dev = ctx.device.index
        ids = ctx.comm.all_gather_object(
            guarded(ctx, "mori device identity", lambda: identity(ctx))
        )
        shared = shared_gpu_reason(ctx, ids)
        agree(ctx, shared is None, shared or "", "mori placement check")

        def group_ranks() -> tuple[int, ...]:
            group = getattr(ctx.comm, "group", None)
            if group is None:
                raise TransportUnavailable("mori needs a torch.distributed group (TorchComm)")
            return tuple(dist.get_process_group_ranks(group))

        ranks = guarded(ctx, "mori process-group lookup", group_ranks)
        held = ctx.comm.all_gather_object(_session_ranks())
        fresh = held[ctx.rank] is None
        ok = all(h == held[0] for h in held) and (fresh or held[ctx.rank] == ranks)
        agree(
            ctx,
            ok,
            f"MORI is already initialised in this process over ranks {held[ctx.rank]}; MORI "
            f"keeps one shmem world per process (this group: ranks {list(ranks)})",
            "mori initialisation state",
        )

        def init() -> None:
            self._session = _acquire(ctx, ranks, fresh)

        guarded(ctx, "MORI shmem initialisation (shmem_torch_process_group_init)", init)

        layout = PeerLayout(ctx.config, ctx.world)

        def alloc() -> None:
            shmem = _shmem()
            with torch.cuda.device(ctx.device):
                torch.cuda.synchronize(ctx.device)
                self._raw = int(shmem.shmem_malloc_align(_ALIGN, layout.total + _ALIGN))
                if self._raw == 0:
                    raise RuntimeError(
                        f"shmem_malloc_align of {layout.total + _ALIGN} bytes returned 0 "
                        "(symmetric heap exhausted? raise MORI_SHMEM_HEAP_SIZE before the first "
                        "init)"
                    )
                # shmem_malloc_align rounds the size, not the address: align the base here.
                self._ptr = -(-self._raw // _ALIGN) * _ALIGN
                view_bytes(self._ptr, layout.total, ctx.device).zero_()
                torch.cuda.synchronize(ctx.device)

        guarded(ctx, "MORI symmetric-heap allocation (shmem_malloc_align)", alloc)

        def peers() -> list[int]:
            shmem = _shmem()
            return [
                self._ptr if p == ctx.rank else int(shmem.shmem_ptr_p2p(self._ptr, ctx.rank, p))
                for p in range(ctx.world)
            ]

        bases: list[int] = guarded(ctx, "MORI peer lookup (shmem_ptr_p2p)", peers)  # type: ignore[assignment]
        far = [p for p, b in enumerate(bases) if b == 0]
        agree(
            ctx,
            not far,
            "; ".join(
                f"peer {p} is not reachable by P2P; off-node peers need MORI's device-side RDMA "
                "API, not implemented yet (also check MORI_DISABLE_P2P)"
                for p in far
            ),
            "MORI peer addresses",
        )
        ctx.comm.barrier()  # every region zeroed before any peer can write into it
        ticks = mod.clock_ticks_per_second(dev)
        self.engine = guarded(  # type: ignore[assignment]
            ctx, "mori push engine", lambda: PushEngine(ctx, layout, bases, ticks)
        )

    def close(self) -> None:
        if self._raw == 0 and self._session is None:
            return
        torch.cuda.synchronize(self.ctx.device)
        self.ctx.comm.barrier()  # no peer still writes into memory about to go away
        self._teardown()

    def _teardown(self) -> None:
        self.engine = None
        try:
            if self._raw:
                raw, self._raw, self._ptr = self._raw, 0, 0
                _shmem().shmem_free(raw)
        finally:
            session, self._session = self._session, None
            if session is not None:
                with _lock:
                    _release(session)
