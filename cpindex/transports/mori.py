"""``mori``: the peer push of :mod:`.peer` over MORI shmem symmetric memory (ROCm only).

Each rank takes its region from MORI's static symmetric heap (uncached by default, so peers'
stores and flags are seen without cache maintenance) and asks MORI for every peer's address of
it (``shmem_ptr_p2p``: the XGMI mapping, or 0 for a peer reachable only by RDMA). From there
the push is exactly ``ipc``'s: the fused kernel stores into peers' regions and raises flags; no
MORI device code runs.

MORI keeps one shmem world per process. The ranks decide together (:func:`_join`) how to get
one, from what each finds in its process:

- MORI not initialised: rank 0 of the cpindex group asks for a unique id, every rank receives
  it through the cpindex comm and calls ``shmem_init_attr`` with its cpindex rank. Any group
  works (no global rank 0, no extra process group). cpindex initialised it, so the last
  ``close()`` finalizes it.
- MORI initialised by the application (MORI-EP, ...): used as it is when its PE numbers are the
  cpindex ranks; never finalized by cpindex.
- MORI initialised by an earlier instance over the same ranks: shared, reference counted.

MORI is imported lazily (:func:`mori_status`), never at ``import cpindex``. API used (ROCm/mori
``python/mori/shmem/api.py``): ``shmem_get_unique_id``, ``shmem_init_attr`` with
``MORI_SHMEM_INIT_WITH_UNIQUEID``, ``shmem_mype``, ``shmem_npes``, ``shmem_malloc_align``,
``shmem_ptr_p2p``, ``shmem_free``, ``shmem_finalize``, plus the C++ ``ShmemIsInitialized`` that
the Python API does not bind (:func:`_native_is_initialized`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import re
import secrets
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import kernels
from ..config import CPIndexConfig
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
#: CPython versions amd-mori publishes wheels for (it ships no sdist).
WHEEL_PYTHONS = ((3, 10), (3, 12))
#: MORI's static symmetric heap per GPU when MORI_SHMEM_HEAP_SIZE is unset.
DEFAULT_HEAP_BYTES = 4 << 30
#: What MORI takes from the heap it sets up: a 256-byte initial offset and a 1 KiB barrier buffer.
MORI_HEAP_OVERHEAD = 256 + 1024
_ALIGN = 256  # region base alignment: PeerLayout's offsets assume 256-byte aligned bases
_ROCM_PATH = "/opt/rocm"  # where MORI's JIT looks for ROCm when ROCM_PATH is unset


def _round(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


def heap_bytes(cfg: CPIndexConfig, world: int) -> int:
    """Bytes one instance takes from each GPU's symmetric heap: its :class:`PeerLayout` region
    plus 256 bytes to align the base (``shmem_malloc_align`` rounds the size, not the address),
    rounded up to 256 bytes as MORI rounds it."""
    return _round(PeerLayout(cfg, world).total + _ALIGN)


# ---- can MORI be imported? -------------------------------------------------------------------

_SHARED_LIB = re.compile(r"(lib[\w.+-]*?\.so(?:\.[\w.]+)?)")
_ROCM_LIBS = ("libamdhip64", "libhsa-runtime64", "libhsakmt", "libamd_comgr", "libhiprtc")
_UNSHIPPED_LIBS = ("grpc", "gpr", "protobuf", "absl", "upb", "re2", "cares")


def _not_installed(python: tuple[int, int]) -> str:
    if python not in WHEEL_PYTHONS:
        return (
            "MORI is not installed, and PyPI has no amd-mori for this Python: it publishes wheels "
            f"for CPython 3.10 and 3.12 only (this is {python[0]}.{python[1]}, where `{INSTALL}` "
            "installs nothing)"
        )
    return (
        f"MORI is not installed (no module 'mori'): install it with `{INSTALL}` (PyPI amd-mori; "
        "needs a ROCm build of torch and the ROCm 7 runtime)"
    )


def _load_failure(e: BaseException) -> str:
    """Which library kept ``mori.shmem`` from loading, and what provides it."""
    found = _SHARED_LIB.search(str(e))
    lib = found.group(1) if found else None
    what = f"{type(e).__name__}: {e}"
    if lib is not None and lib.startswith(_ROCM_LIBS):
        return (
            f"MORI is installed but the ROCm libraries are missing ({lib} did not load; {what}): "
            f"install the ROCm 7 runtime (libamdhip64, libhsa-runtime64; `{INSTALL}` does not)"
        )
    if lib is not None and any(name in lib for name in _UNSHIPPED_LIBS):
        return (
            f"MORI is installed but {lib} did not load ({what}): the amd-mori wheel links "
            "gRPC/protobuf/absl libraries it does not ship (the 1.2.4 cp312 wheel does); install "
            f"them system-wide or use another amd-mori build (`{INSTALL}`)"
        )
    if lib is not None:
        return f"MORI is installed but {lib} did not load ({what}); reinstall with `{INSTALL}`"
    return f"MORI is installed but `import mori.shmem` failed ({what}); reinstall with `{INSTALL}`"


@functools.cache
def mori_status() -> tuple[bool, str]:
    """Can ``mori.shmem`` be imported here? ``(ok, reason)``; the import is tried once.

    The reason names what is missing: the ``mori`` module (and whether PyPI has it for this
    Python), the ROCm libraries, or libraries the wheel links without shipping them."""
    try:
        import mori.shmem  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "mori":
            return False, _not_installed(sys.version_info[:2])
        return False, _load_failure(e)
    except Exception as e:  # ImportError, OSError; a broken install must not crash selection
        return False, _load_failure(e)
    try:
        from importlib.metadata import version

        return True, f"MORI {version('amd-mori')}"
    except Exception:
        return True, "MORI (version unknown)"


def _shmem() -> Any:
    return importlib.import_module("mori.shmem")


# ---- the environment MORI reads --------------------------------------------------------------

# MORI_SHMEM_MODE values MORI recognises (exact spellings) whose heaps have no peer pointers:
# isolation has no static heap and a VMM heap has no static-heap base, so shmem_ptr_p2p
# returns 0 for every peer; VMM chunks may also be cached memory, which flags cannot poll.
_MODES_WITHOUT_PEER_POINTERS = ("isolation", "ISOLATION", "vmm_heap", "VMM_HEAP")
_CACHED_HEAP_TYPES = ("normal", "NORMAL")  # MORI_SHMEM_HEAP_TYPE: plain (cached) hipMalloc
_FALSE = ("0", "false", "off", "no")
_SIZE = re.compile(r"(\d+)(GiB|gib|MiB|mib|KiB|kib|GB|gb|Gb|MB|mb|Mb|KB|kb|Kb|G|g|M|m|K|k)?")
_UNIT = {"g": 1 << 30, "m": 1 << 20, "k": 1 << 10}


@dataclass(frozen=True)
class MoriEnv:
    """What MORI will find when it initialises: the variables it reads and the JIT tools it
    looks up (under ``ROCM_PATH``, not on ``PATH``)."""

    shmem_mode: str = ""  # MORI_SHMEM_MODE
    heap_type: str = ""  # MORI_SHMEM_HEAP_TYPE
    heap_size: str = ""  # MORI_SHMEM_HEAP_SIZE
    disable_p2p: str = ""  # MORI_DISABLE_P2P
    rocm_path: str = _ROCM_PATH  # ROCM_PATH
    missing_tools: tuple[str, ...] = ()  # of hipcc, llvm-link, opt


def _jit_tool_dirs(rocm: str) -> dict[str, list[str]]:
    """Where MORI's JIT (``mori/jit/config.py``) looks for each tool."""
    llvm = [os.path.join(rocm, "lib", "llvm", "bin"), os.path.join(rocm, "bin")]
    return {"hipcc": [os.path.join(rocm, "bin")], "llvm-link": llvm, "opt": llvm}


def read_env(environ: Mapping[str, str] | None = None) -> MoriEnv:
    """Read, once, what MORI will read (``environ`` defaults to ``os.environ``)."""
    env = os.environ if environ is None else environ
    rocm = env.get("ROCM_PATH", _ROCM_PATH)
    missing = tuple(
        tool
        for tool, dirs in _jit_tool_dirs(rocm).items()
        if shutil.which(tool, path=os.pathsep.join(dirs)) is None
    )
    return MoriEnv(
        shmem_mode=env.get("MORI_SHMEM_MODE", ""),
        heap_type=env.get("MORI_SHMEM_HEAP_TYPE", ""),
        heap_size=env.get("MORI_SHMEM_HEAP_SIZE", ""),
        disable_p2p=env.get("MORI_DISABLE_P2P", ""),
        rocm_path=rocm,
        missing_tools=missing,
    )


def parse_heap_size(text: str) -> int | None:
    """``MORI_SHMEM_HEAP_SIZE`` in bytes, as MORI parses it (digits, then K/M/G, KB/MB/GB or
    KiB/MiB/GiB, all powers of 1024); None for text MORI would misread."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        return None
    unit = m.group(2)
    return int(m.group(1)) * (_UNIT[unit[0].lower()] if unit else 1)


def env_refusals(env: MoriEnv, need: int) -> list[str]:
    """Why MORI, initialised in ``env``, could not serve an instance that takes ``need`` bytes
    of symmetric heap per GPU (empty when it could)."""
    why = []
    if env.shmem_mode in _MODES_WITHOUT_PEER_POINTERS:
        why.append(
            f"MORI_SHMEM_MODE={env.shmem_mode}: that heap gives no peer pointers "
            "(shmem_ptr_p2p returns 0 for every peer) and may be cached memory the flag handshake "
            "cannot poll; unset it or set MORI_SHMEM_MODE=static_heap"
        )
    if env.heap_type in _CACHED_HEAP_TYPES:
        why.append(
            f"MORI_SHMEM_HEAP_TYPE={env.heap_type} makes the symmetric heap cached memory; the "
            "flag handshake needs MORI's default uncached heap (unset MORI_SHMEM_HEAP_TYPE)"
        )
    if env.disable_p2p.strip() and env.disable_p2p.strip().lower() not in _FALSE:
        why.append(
            f"MORI_DISABLE_P2P={env.disable_p2p} makes every peer RDMA-only; the mori push "
            "needs P2P (XGMI) peers (unset MORI_DISABLE_P2P)"
        )
    if env.heap_size:
        size = parse_heap_size(env.heap_size)
        if size is None:
            why.append(
                f"MORI_SHMEM_HEAP_SIZE={env.heap_size!r} is not a size MORI reads correctly "
                "(digits with an optional K, M, G, KB, MB, GB, KiB, MiB or GiB)"
            )
        elif size < MORI_HEAP_OVERHEAD + need:
            why.append(
                f"MORI_SHMEM_HEAP_SIZE={env.heap_size} ({size} bytes) is smaller than the "
                f"{MORI_HEAP_OVERHEAD + need} bytes MORI and one cpindex instance need from it"
            )
    if env.missing_tools:
        dirs = _jit_tool_dirs(env.rocm_path)
        where = "; ".join(f"{t} in {' or '.join(dirs[t])}" for t in env.missing_tools)
        why.append(
            "MORI compiles its device module at its first initialisation and cannot find "
            f"{', '.join(env.missing_tools)} (it looks for {where}): install ROCm's compiler "
            "or point ROCM_PATH at it"
        )
    return why


# ---- one MORI shmem world per process ---------------------------------------------------------

Origin = Literal["cpindex", "application", "unknown"]


@dataclass
class _World:
    """The MORI shmem world this process's instances use, and who initialised it."""

    uid: bytes | None  # the unique id cpindex initialised it with (None: the application did)
    pe: int
    npes: int
    # At the last release: "cpindex" is finalized, "application" forgotten untouched, and
    # "unknown" (cpindex called init but MORI cannot say whether that did anything) kept.
    origin: Origin
    refs: int = 0


_lock = threading.Lock()
_world: _World | None = None

# bool mori::shmem::ShmemIsInitialized(), as the Itanium C++ ABI names it.
_IS_INITIALIZED = "_ZN4mori5shmem18ShmemIsInitializedEv"


def _native_is_initialized() -> Callable[[], bool] | None:
    """MORI's own answer to "is shmem initialised in this process?", or None where no loaded
    MORI library exports it.

    The Python API has no such query, and ``shmem_mype()`` before initialisation dereferences a
    null pointer, so this looks the C++ function up in the MORI extension that ``import
    mori.shmem`` loaded (a symbol lookup on a library handle also searches its dependencies)."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith("libmori") else None
        if not path:
            continue
        try:
            fn = getattr(ctypes.CDLL(path), _IS_INITIALIZED)
        except (OSError, AttributeError):
            continue
        fn.argtypes = []
        fn.restype = ctypes.c_bool
        return lambda fn=fn: bool(fn())
    return None


def _device(ctx: Context) -> torch.cuda.device:
    """MORI keeps per-device state keyed on the calling thread's current device."""
    return torch.cuda.device(ctx.device)


View = tuple[str, bytes | None, int, int]  # (state, uid, pe, npes) as one rank sees it


def _local_view(ctx: Context) -> View:
    with _lock:
        world = _world
    if world is not None:
        return "joined", world.uid, world.pe, world.npes
    shmem = _shmem()  # loads MORI's extension, where the query lives
    query = _native_is_initialized()
    if query is None:
        return "unknown", None, -1, -1
    with _device(ctx):
        if not query():
            return "none", None, -1, -1
        return "application", None, int(shmem.shmem_mype()), int(shmem.shmem_npes())


def _describe(view: View) -> str:
    state, uid, pe, npes = view
    if state == "joined":
        by = "cpindex" if uid is not None else "the application"
        return f"MORI in use by cpindex (initialised by {by}) as PE {pe} of {npes}"
    if state == "application":
        return f"MORI initialised by the application as PE {pe} of {npes}"
    if state == "none":
        return "MORI not initialised"
    return "cannot tell whether MORI is initialised"


def _join(ctx: Context) -> _World:
    """Collective: take one reference on the process's MORI world, initialising it over the
    cpindex ranks when no rank has one. Raises on every rank, holding nothing, on failure."""
    global _world
    mine = guarded(ctx, "MORI state query", lambda: _local_view(ctx))
    views: list[View] = ctx.comm.all_gather_object(mine)
    states = {v[0] for v in views}
    if len(states) > 1:
        raise TransportUnavailable(
            "ranks find MORI in different states: "
            + "; ".join(f"rank {r}: {_describe(v)}" for r, v in enumerate(views))
        )
    state = states.pop()
    if state in ("joined", "application"):
        wrong = [
            r for r, v in enumerate(views) if (v[2], v[3]) != (r, ctx.world) or v[1] != views[0][1]
        ]
        if wrong:
            raise TransportUnavailable(
                "MORI keeps one shmem world per process and the one here does not number the "
                f"cpindex ranks 0..{ctx.world - 1} as its PEs: "
                + "; ".join(f"rank {r}: {_describe(views[r])}" for r in wrong)
            )
        with _lock:
            if state == "application" and _world is None:
                _world = _World(None, ctx.rank, ctx.world, "application")
            if _world is None:
                raise TransportUnavailable("MORI's world was released while joining it")
            _world.refs += 1
            return _world

    # No rank holds a world: initialise one over exactly these ranks.
    origin: Origin = "cpindex" if state == "none" else "unknown"
    shmem = _shmem()

    def unique_id() -> bytes:
        # The group's first rank makes the id; cpindex's own comm carries it to the others,
        # so any group works, not only one holding global rank 0.
        if ctx.rank != 0:
            return b""
        uid = shmem.shmem_get_unique_id()
        if not isinstance(uid, bytes) or not uid:
            raise RuntimeError(f"shmem_get_unique_id returned {uid!r}")
        return uid

    first = guarded(ctx, "MORI unique id (shmem_get_unique_id)", unique_id)
    uid: bytes = ctx.comm.all_gather_object(first)[0]
    held: list[_World] = []

    def init() -> None:
        global _world
        with _device(ctx):
            status = shmem.shmem_init_attr(
                shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, ctx.rank, ctx.world, uid
            )
            if status != 0:
                raise RuntimeError(
                    f"shmem_init_attr returned {status} (MORI's log says why; MORI_SOCKET_IFNAME "
                    "picks the interface its bootstrap listens on)"
                )
            world = _World(uid, ctx.rank, ctx.world, origin, refs=1)
            with _lock:
                _world = world
            held.append(world)
            pe, npes = int(shmem.shmem_mype()), int(shmem.shmem_npes())
        if (pe, npes) != (ctx.rank, ctx.world):
            world.origin = "application"  # the init was a no-op: this world is someone else's
            raise RuntimeError(
                f"MORI numbers this process PE {pe} of {npes}, but it is rank {ctx.rank} of "
                f"{ctx.world} in the cpindex group (was MORI initialised elsewhere meanwhile?)"
            )

    try:
        guarded(ctx, "MORI initialisation (shmem_init_attr)", init)
    except BaseException:
        if held:  # this rank's init went through, another rank's did not
            if held[0].origin == "unknown":
                held[0].origin = "application"  # not kept for reuse: the others have none
            _release(ctx, held[0])
        raise
    if origin == "unknown":
        log.warning(
            "cpindex: this MORI build exports no ShmemIsInitialized, so cpindex cannot tell "
            "whether it initialised MORI; it will never finalize it (the heap stays reserved "
            "until the process exits)"
        )
    return held[0]


def _release(ctx: Context, world: _World) -> None:
    """Drop one reference. At the last one, MORI is finalized only if cpindex initialised it;
    an application's world is forgotten untouched, and one of unknown origin stays recorded so
    that the next instance shares it instead of initialising again."""
    global _world
    with _lock:
        if world.refs <= 0:
            return
        world.refs -= 1
        if world.refs or world.origin == "unknown":
            return
        if _world is world:
            _world = None
        if world.origin != "cpindex":
            return
        with _device(ctx):
            status = _shmem().shmem_finalize()
        if status not in (0, None):
            log.warning("cpindex: shmem_finalize returned %s", status)


def _peer_bases(ctx: Context, shmem: Any, ptr: int) -> list[int]:
    """Every rank's address of the region at ``ptr``, as this process sees it (PE == rank)."""
    with _device(ctx):
        return [
            ptr if p == ctx.rank else int(shmem.shmem_ptr_p2p(ptr, ctx.rank, p))
            for p in range(ctx.world)
        ]


def _free(ctx: Context, raw: int) -> None:
    with _device(ctx):
        _shmem().shmem_free(raw)


@register
class MoriTransport(PeerPushTransport):
    name = "mori"

    @classmethod
    def probe(cls, ctx: Context) -> tuple[bool, str]:
        """Every reason this rank cannot run ``mori`` (platform, install, MORI's environment),
        joined; then the push kernel's own check."""
        why: list[str] = []
        if ctx.device.type != "cuda":
            why.append(f"needs a ROCm GPU (this rank runs on {ctx.device.type})")
        if torch.version.hip is None:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
            why.append(f"needs a ROCm build of torch (this one is {build})")
        if ctx.comm.same_process:
            why.append("the one-process world has no MORI (MORI runs one PE per process)")
        ok, status = mori_status()
        if not ok:
            why.append(status)
        why += env_refusals(read_env(), heap_bytes(ctx.config, ctx.world))
        if why:
            return False, "; ".join(why)
        ok, kwhy = push_probe(ctx)
        if not ok:
            return False, kwhy
        return True, f"{status}: fused kernel writes scores into peers' symmetric-heap regions"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._raw = 0  # what shmem_malloc_align returned (freed at close)
        self._ptr = 0  # the 256-aligned region base inside it
        self._world: _World | None = None
        self.engine: PushEngine | None = None
        try:
            self._setup(ctx)
        except BaseException:
            self._teardown()  # every rank raises here: agree/guarded made the failure common
            raise

    def _setup(self, ctx: Context) -> None:
        mod = kernels.load(ctx.device)
        ids = ctx.comm.all_gather_object(
            guarded(ctx, "mori device identity", lambda: identity(ctx))
        )
        shared = shared_gpu_reason(ctx, ids)
        agree(ctx, shared is None, shared or "", "mori placement check")
        self._world = _join(ctx)

        shmem = _shmem()
        layout = PeerLayout(ctx.config, ctx.world)
        tag = secrets.randbits(62) + 1  # nonzero: told apart from zeroed memory

        def alloc() -> None:
            with _device(ctx):
                torch.cuda.synchronize(ctx.device)
                self._raw = int(shmem.shmem_malloc_align(_ALIGN, layout.total + _ALIGN))
                if self._raw == 0:
                    raise RuntimeError(
                        f"shmem_malloc_align of {layout.total + _ALIGN} bytes returned 0 (heap "
                        "exhausted? MORI_SHMEM_HEAP_SIZE is read once, at initialisation)"
                    )
                self._ptr = _round(self._raw)
                region = view_bytes(self._ptr, layout.total, ctx.device)
                region.zero_()
                region[:8].view(torch.int64).fill_(tag)
                torch.cuda.synchronize(ctx.device)

        guarded(ctx, "MORI symmetric-heap allocation (shmem_malloc_align)", alloc)
        bases: list[int] = guarded(  # type: ignore[assignment]
            ctx, "MORI peer lookup (shmem_ptr_p2p)", lambda: _peer_bases(ctx, shmem, self._ptr)
        )
        far = [p for p, b in enumerate(bases) if b == 0]
        agree(
            ctx,
            not far,
            "; ".join(
                f"peer {p} is not reachable by P2P; off-node peers need MORI's device-side RDMA "
                "API, not implemented (also check MORI_DISABLE_P2P)"
                for p in far
            ),
            "MORI peer addresses",
        )

        # Before any kernel writes through these addresses, check that the region MORI maps as
        # PE p's is cpindex rank p's: each region starts with its owner's tag.
        tags = ctx.comm.all_gather_object(tag)

        def read_tags() -> list[int]:
            with _device(ctx):
                return [int(view_bytes(b, 8, ctx.device).view(torch.int64).item()) for b in bases]

        seen: list[int] = guarded(ctx, "MORI region tag read", read_tags)  # type: ignore[assignment]
        wrong = [p for p in range(ctx.world) if seen[p] != tags[p]]
        agree(
            ctx,
            not wrong,
            f"the regions MORI maps as PEs {wrong} are not those cpindex ranks' (the heap "
            "offsets differ between processes: something else allocates from it in another order)",
            "MORI region check",
        )  # also a barrier: no rank clears its tag while a peer may still read it
        with _device(ctx):
            view_bytes(self._ptr, 8, ctx.device).zero_()
            torch.cuda.synchronize(ctx.device)
        ctx.comm.barrier()  # every region zeroed before any peer can write into it
        ticks = mod.clock_ticks_per_second(ctx.device.index)
        self.engine = guarded(  # type: ignore[assignment]
            ctx, "mori push engine", lambda: PushEngine(ctx, layout, bases, ticks)
        )

    def close(self, meet: Callable[[], object] | None = None) -> None:
        if self._raw == 0 and self._world is None:
            return
        torch.cuda.synchronize(self.ctx.device)
        (meet or self.ctx.comm.barrier)()  # no peer still writes into memory about to go away
        self._teardown()

    def _teardown(self) -> None:
        self.engine = None
        try:
            if self._raw:
                raw, self._raw, self._ptr = self._raw, 0, 0
                _free(self.ctx, raw)
        finally:
            world, self._world = self._world, None
            if world is not None:
                _release(self.ctx, world)
