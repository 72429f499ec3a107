"""The ``mori`` transport.

On CPU: the lazy import and its reasons, the environment MORI will read (heap modes, heap size,
JIT toolchain) as the probe sees it, selection, and the rule that cpindex finalizes only a MORI
it initialised, exercised through the module's bookkeeping against a stand-in for the external
``mori.shmem``. On a ROCm node with amd-mori: the contract, a group without global rank 0, and a
MORI the application initialised (skipped elsewhere).
"""

from __future__ import annotations

import contextlib
import importlib.util
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from _gpu import assert_scores, expected, for_rank

from cpindex import TransportUnavailable
from cpindex.config import CPIndexConfig
from cpindex.transports import mori as mori_transport
from cpindex.transports.base import Context, candidates, select
from cpindex.world import ThreadComm, ThreadWorld

MoriTransport = mori_transport.MoriTransport
mori_status = mori_transport.mori_status
INSTALL = "pip install cpindex[rocm]"


def _cpu_context(**cfg) -> Context:
    return Context(
        config=CPIndexConfig(world_size=1, **cfg),
        comm=ThreadComm(ThreadWorld(1), 0),
        device=torch.device("cpu"),
        ranks_per_device=1,
    )


@pytest.fixture
def fresh_status():
    """Clear mori_status's cache around a test that fakes what ``import mori.shmem`` finds."""
    mori_status.cache_clear()
    yield
    for name in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
        del sys.modules[name]
    mori_status.cache_clear()


def _fake_package(tmp_path: Path, shmem_body: str) -> None:
    """An installed ``mori`` whose ``mori.shmem`` runs ``shmem_body`` on import."""
    pkg = tmp_path / "mori"
    (pkg / "shmem").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "shmem" / "__init__.py").write_text(shmem_body)


# ---- import and install reasons ---------------------------------------------------------------


def test_importing_cpindex_never_imports_mori():
    code = textwrap.dedent(
        """
        import sys
        import cpindex
        import cpindex.transports.mori as m
        from cpindex.transports import REGISTRY
        assert REGISTRY["mori"] is m.MoriTransport
        loaded = sorted(n for n in sys.modules if n == "mori" or n.startswith("mori."))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("mori") is not None, reason="mori is installed")
def test_status_without_mori_names_the_install(fresh_status):
    ok, why = mori_status()
    assert not ok
    assert why == mori_transport._not_installed(sys.version_info[:2])
    assert INSTALL in why
    assert mori_status() == (ok, why)  # cached


def test_not_installed_says_whether_pypi_has_a_wheel_for_this_python():
    on_wheel = mori_transport._not_installed((3, 12))
    assert INSTALL in on_wheel and "ROCm" in on_wheel and "no module 'mori'" in on_wheel
    off_wheel = mori_transport._not_installed((3, 11))
    assert "3.10 and 3.12" in off_wheel and "this is 3.11" in off_wheel


def test_status_missing_rocm_libraries_is_one_clear_reason(fresh_status, monkeypatch, tmp_path):
    # What the amd-mori wheel does on a machine without ROCm: `import mori` works,
    # `import mori.shmem` fails loading the HIP runtime.
    _fake_package(tmp_path, "raise OSError('libamdhip64.so.7: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mori", raising=False)
    ok, why = mori_status()
    assert not ok
    assert "ROCm libraries are missing" in why
    assert "libamdhip64.so.7" in why and "OSError" in why
    assert INSTALL in why


def test_status_names_libraries_the_wheel_does_not_ship(fresh_status, monkeypatch, tmp_path):
    _fake_package(
        tmp_path,
        "raise ImportError('libgrpc++.so.1.60: cannot open shared object file: No such file')\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mori", raising=False)
    ok, why = mori_status()
    assert not ok
    assert "libgrpc++.so.1.60" in why and "does not ship" in why


@pytest.mark.skipif(mori_status()[0], reason="MORI is installed here")
def test_status_here_is_unavailable():
    ok, why = mori_status()
    assert not ok and INSTALL in why


def test_rocm_extra_is_limited_to_the_pythons_with_wheels():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    (line,) = meta["project"]["optional-dependencies"]["rocm"]
    req = requirements.Requirement(line)
    assert req.name == "amd-mori"
    for version, wanted in (("3.10", True), ("3.11", False), ("3.12", True), ("3.13", False)):
        assert req.marker.evaluate({"python_version": version}) is wanted, version


# ---- the environment MORI will read ---------------------------------------------------------


def _toolchain(root: Path, *tools: str) -> dict[str, str]:
    """A ROCM_PATH holding ``tools`` (``bin/hipcc``, ``lib/llvm/bin/llvm-link``, ...)."""
    for rel in tools:
        exe = root / rel
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return {"ROCM_PATH": str(root)}


FULL_TOOLCHAIN = ("bin/hipcc", "lib/llvm/bin/llvm-link", "lib/llvm/bin/opt")
NEED = mori_transport.heap_bytes(CPIndexConfig(), 4)


def test_a_plain_environment_is_accepted(tmp_path):
    env = mori_transport.read_env(_toolchain(tmp_path, *FULL_TOOLCHAIN))
    assert env.missing_tools == ()
    assert mori_transport.env_refusals(env, NEED) == []


@pytest.mark.parametrize("mode", ["vmm_heap", "VMM_HEAP", "isolation", "ISOLATION"])
def test_heap_modes_without_peer_pointers_are_refused(tmp_path, mode):
    env = mori_transport.read_env(
        {**_toolchain(tmp_path, *FULL_TOOLCHAIN), "MORI_SHMEM_MODE": mode}
    )
    (why,) = mori_transport.env_refusals(env, NEED)
    assert f"MORI_SHMEM_MODE={mode}" in why and "shmem_ptr_p2p returns 0" in why


@pytest.mark.parametrize("mode", ["static_heap", "STATIC_HEAP", "Isolation"])
def test_static_heap_and_spellings_mori_ignores_are_accepted(tmp_path, mode):
    # MORI matches only the exact lower/upper spellings; anything else is its static heap.
    env = mori_transport.read_env(
        {**_toolchain(tmp_path, *FULL_TOOLCHAIN), "MORI_SHMEM_MODE": mode}
    )
    assert mori_transport.env_refusals(env, NEED) == []


def test_cached_heap_and_disabled_p2p_are_refused(tmp_path):
    base = _toolchain(tmp_path, *FULL_TOOLCHAIN)
    env = mori_transport.read_env({**base, "MORI_SHMEM_HEAP_TYPE": "normal"})
    (why,) = mori_transport.env_refusals(env, NEED)
    assert "MORI_SHMEM_HEAP_TYPE=normal" in why and "uncached" in why
    env = mori_transport.read_env({**base, "MORI_DISABLE_P2P": "ON"})
    (why,) = mori_transport.env_refusals(env, NEED)
    assert "MORI_DISABLE_P2P=ON" in why and "RDMA-only" in why
    env = mori_transport.read_env({**base, "MORI_DISABLE_P2P": "0"})
    assert mori_transport.env_refusals(env, NEED) == []


def test_heap_size_is_parsed_as_mori_parses_it():
    parse = mori_transport.parse_heap_size
    assert parse("4G") == parse("4GiB") == parse("4gb") == parse("4096M") == 4 << 30
    assert parse("512k") == 512 << 10
    assert parse("123") == 123
    for bad in ("", "4 GB", "4T", "lots", "-1G", "1.5G"):
        assert parse(bad) is None, bad


def test_a_heap_too_small_for_one_instance_is_refused(tmp_path):
    # The default config over 4 ranks takes 4,460,800 bytes (docs/transports.md shows the sum).
    assert NEED == 4_460_800
    base = _toolchain(tmp_path, *FULL_TOOLCHAIN)
    (why,) = mori_transport.env_refusals(
        mori_transport.read_env({**base, "MORI_SHMEM_HEAP_SIZE": "4M"}), NEED
    )
    assert "MORI_SHMEM_HEAP_SIZE=4M (4194304 bytes)" in why and str(NEED + 1280) in why
    env = mori_transport.read_env({**base, "MORI_SHMEM_HEAP_SIZE": "5M"})
    assert mori_transport.env_refusals(env, NEED) == []
    (why,) = mori_transport.env_refusals(
        mori_transport.read_env({**base, "MORI_SHMEM_HEAP_SIZE": "4 GB"}), NEED
    )
    assert "not a size MORI reads" in why


def test_missing_jit_tools_are_named(tmp_path):
    env = mori_transport.read_env({"ROCM_PATH": str(tmp_path)})
    assert env.missing_tools == ("hipcc", "llvm-link", "opt")
    (why,) = mori_transport.env_refusals(env, NEED)
    assert "hipcc, llvm-link, opt" in why and str(tmp_path) in why
    # MORI looks under ROCM_PATH (lib/llvm/bin, then bin), not on PATH
    env = mori_transport.read_env(_toolchain(tmp_path, "bin/hipcc", "bin/llvm-link"))
    assert env.missing_tools == ("opt",)
    (why,) = mori_transport.env_refusals(env, NEED)
    assert "cannot find opt " in why


def test_without_rocm_path_mori_looks_in_opt_rocm():
    assert mori_transport.read_env({}).rocm_path == "/opt/rocm"


# ---- selection ---------------------------------------------------------------------------------


def test_probe_on_cpu_says_why():
    ok, why = MoriTransport.probe(_cpu_context())
    assert not ok
    assert "needs a ROCm GPU (this rank runs on cpu)" in why


def test_auto_offers_mori_only_when_preferred():
    assert "mori" not in candidates(CPIndexConfig())
    assert candidates(CPIndexConfig(prefer_mori=True)) == ["mori", "ipc", "collective"]
    assert candidates(CPIndexConfig(transport="mori")) == ["mori"]


def test_auto_without_mori_still_selects_something():
    for prefer in (False, True):
        transport = select(_cpu_context(prefer_mori=prefer))
        assert transport.name == "collective"
        if prefer:
            assert "mori" in transport.selection_note
        transport.close()


def test_requesting_mori_where_it_cannot_run_raises():
    with pytest.raises(TransportUnavailable) as info:
        select(_cpu_context(transport="mori"))
    msg = str(info.value)
    assert "'mori'" in msg
    assert "rank 0" in msg and "GPU" in msg


def test_auto_skips_mori_naming_the_heap_mode(monkeypatch):
    monkeypatch.setenv("MORI_SHMEM_MODE", "vmm_heap")  # the mapping read_env reads
    transport = select(_cpu_context(prefer_mori=True))
    try:
        assert transport.name == "collective"
        assert "MORI_SHMEM_MODE=vmm_heap" in transport.selection_note
    finally:
        transport.close()


def test_requesting_mori_names_the_cached_heap_and_missing_toolchain(monkeypatch, tmp_path):
    monkeypatch.setenv("MORI_SHMEM_HEAP_TYPE", "normal")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))  # an empty ROCm: no JIT tools
    with pytest.raises(TransportUnavailable) as info:
        select(_cpu_context(transport="mori"))
    msg = str(info.value)
    assert "transport 'mori' cannot run: rank 0:" in msg
    assert "MORI_SHMEM_HEAP_TYPE=normal" in msg
    assert "cannot find hipcc, llvm-link, opt" in msg


# ---- who initialised MORI, and who finalizes it ---------------------------------------------


class FakeShmem(types.ModuleType):
    """Stands in for the external ``mori.shmem``: one shmem world per process, an init that is
    a no-op when one exists (as MORI's is), and every call logged with the device that was
    current (``torch.cuda.device``, faked below) when it was made."""

    MORI_SHMEM_INIT_WITH_UNIQUEID = 1

    def __init__(self) -> None:
        super().__init__("mori.shmem")
        self.initialized = False
        self.pe = self.npes = -1
        self.init_status = 0
        self.calls: list[tuple[str, torch.device | None]] = []
        self.current: list[torch.device] = []

    def _log(self, name: str) -> None:
        self.calls.append((name, self.current[-1] if self.current else None))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def app_init(self, pe: int, npes: int) -> None:
        """What an application (MORI-EP, ...) does before cpindex exists."""
        self.initialized, self.pe, self.npes = True, pe, npes

    def shmem_get_unique_id(self) -> bytes:
        self._log("shmem_get_unique_id")
        return b"\x01" * 128

    def shmem_init_attr(self, flags: int, rank: int, nranks: int, uid: bytes) -> int:
        self._log("shmem_init_attr")
        assert flags == self.MORI_SHMEM_INIT_WITH_UNIQUEID and uid == b"\x01" * 128
        if self.init_status == 0 and not self.initialized:
            self.initialized, self.pe, self.npes = True, rank, nranks
        return self.init_status

    def shmem_mype(self) -> int:
        assert self.initialized, "MORI dereferences a null pointer here"
        return self.pe

    def shmem_npes(self) -> int:
        assert self.initialized, "MORI dereferences a null pointer here"
        return self.npes

    def shmem_ptr_p2p(self, ptr: int, my_pe: int, dest_pe: int) -> int:
        self._log("shmem_ptr_p2p")
        return ptr + (dest_pe << 40)

    def shmem_free(self, ptr: int) -> None:
        self._log("shmem_free")

    def shmem_finalize(self) -> int:
        self._log("shmem_finalize")
        assert self.initialized, "MORI asserts on finalizing an uninitialised shmem"
        self.initialized = False
        return 0


DEV = torch.device("cuda", 1)  # any device but the default: the calls must run on this one


@pytest.fixture
def fake(monkeypatch):
    """A process with the fake MORI installed and no cpindex MORI world yet. The query MORI
    exports only from C++ (ShmemIsInitialized) is answered by the fake."""
    shmem = FakeShmem()
    parent = types.ModuleType("mori")
    parent.shmem = shmem  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mori", parent)
    monkeypatch.setitem(sys.modules, "mori.shmem", shmem)
    monkeypatch.setattr(mori_transport, "_world", None)
    monkeypatch.setattr(mori_transport, "_native_is_initialized", lambda: lambda: shmem.initialized)

    @contextlib.contextmanager
    def device(d: torch.device):
        shmem.current.append(d)
        try:
            yield
        finally:
            shmem.current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    return shmem


def _ctx(world: int = 1) -> Context:
    return Context(
        config=CPIndexConfig(world_size=world),
        comm=ThreadComm(ThreadWorld(world), 0),
        device=DEV,
        ranks_per_device=1,
    )


def test_cpindex_finalizes_only_at_the_last_release_of_the_mori_it_initialised(fake):
    ctx = _ctx()
    a = mori_transport._join(ctx)
    assert fake.names() == ["shmem_get_unique_id", "shmem_init_attr"]
    assert fake.calls[-1] == ("shmem_init_attr", DEV)
    assert (a.origin, a.pe, a.npes, a.refs) == ("cpindex", 0, 1, 1)
    b = mori_transport._join(ctx)  # a second instance shares it: no second init
    assert b is a and a.refs == 2 and fake.names().count("shmem_init_attr") == 1
    mori_transport._release(ctx, a)
    assert fake.initialized and "shmem_finalize" not in fake.names()
    mori_transport._release(ctx, b)
    mori_transport._release(ctx, b)  # idempotent per reference
    assert not fake.initialized
    assert [c for c in fake.calls if c[0] == "shmem_finalize"] == [("shmem_finalize", DEV)]
    assert mori_transport._world is None
    mori_transport._release(ctx, mori_transport._join(ctx))  # and again, from scratch
    assert fake.names().count("shmem_init_attr") == 2 and not fake.initialized


def test_an_applications_mori_is_used_and_never_finalized(fake):
    fake.app_init(pe=0, npes=1)
    ctx = _ctx()
    world = mori_transport._join(ctx)
    assert world.origin == "application" and world.uid is None
    assert "shmem_init_attr" not in fake.names()
    again = mori_transport._join(ctx)
    mori_transport._release(ctx, world)
    mori_transport._release(ctx, again)
    assert fake.initialized and "shmem_finalize" not in fake.names()
    assert mori_transport._world is None  # forgotten, not finalized


def test_an_applications_mori_over_other_ranks_is_refused_untouched(fake):
    fake.app_init(pe=3, npes=8)
    with pytest.raises(TransportUnavailable) as info:
        mori_transport._join(_ctx())
    msg = str(info.value)
    assert "one shmem world per process" in msg and "PE 3 of 8" in msg
    assert fake.initialized and fake.names() == []
    assert mori_transport._world is None


def test_without_the_query_cpindex_initialises_but_never_finalizes(fake, monkeypatch):
    monkeypatch.setattr(mori_transport, "_native_is_initialized", lambda: None)
    ctx = _ctx()
    world = mori_transport._join(ctx)
    assert world.origin == "unknown" and fake.names().count("shmem_init_attr") == 1
    mori_transport._release(ctx, world)
    assert fake.initialized and "shmem_finalize" not in fake.names()
    # kept for the next instance, which shares it instead of initialising again
    assert mori_transport._world is world
    again = mori_transport._join(ctx)
    assert again is world and fake.names().count("shmem_init_attr") == 1
    mori_transport._release(ctx, again)


def test_a_failed_init_holds_nothing(fake):
    fake.init_status = -1
    with pytest.raises(TransportUnavailable, match="shmem_init_attr returned -1"):
        mori_transport._join(_ctx())
    assert mori_transport._world is None and "shmem_finalize" not in fake.names()


def test_an_init_that_was_a_no_op_is_not_finalized(fake, monkeypatch):
    # The application initialised MORI between the query and cpindex's init: MORI skipped it.
    monkeypatch.setattr(mori_transport, "_native_is_initialized", lambda: lambda: False)
    fake.app_init(pe=5, npes=8)
    with pytest.raises(TransportUnavailable, match="PE 5 of 8"):
        mori_transport._join(_ctx())
    assert fake.initialized and "shmem_finalize" not in fake.names()
    assert mori_transport._world is None


def test_close_frees_then_finalizes_on_the_ranks_device(fake):
    ctx = _ctx()
    t = MoriTransport.__new__(MoriTransport)  # the bookkeeping of close(), without a GPU
    t.ctx, t.engine, t._raw, t._ptr = ctx, None, 0x7000, 0x7000
    t._world = mori_transport._join(ctx)
    t._teardown()
    assert fake.calls[-2:] == [("shmem_free", DEV), ("shmem_finalize", DEV)]
    t._teardown()  # idempotent
    assert fake.names().count("shmem_finalize") == 1


def test_peer_lookup_runs_on_the_ranks_device(fake):
    bases = mori_transport._peer_bases(_ctx(world=2), fake, 0x7000)
    assert bases == [0x7000, 0x7000 + (1 << 40)]
    assert fake.calls == [("shmem_ptr_p2p", DEV)]


# ---- on a ROCm node with amd-mori -----------------------------------------------------------


def _rocm_gpus() -> int:
    return torch.cuda.device_count() if torch.version.hip and torch.cuda.is_available() else 0


def _needs_mori_gpus(n: int):
    ok, why = mori_status()
    parts = [] if ok else [f"mori: {why}"]
    if _rocm_gpus() < n:
        parts.append(f"ROCm GPUs: {_rocm_gpus()} (torch.version.hip={torch.version.hip}), need {n}")
    return pytest.mark.skipif(
        bool(parts), reason="MORI + ROCm not present (" + "; ".join(parts) + ")"
    )


def _score_once(cp, rank: int, world: int, fmt: str, seed: int) -> None:
    from cpindex import testing

    dev = cp.device
    prob = testing.make_problem(5, 40 * 128, fmt, seed=seed, device=dev)
    want = for_rank(expected(prob, 0, 1, cp.config.sm_scale), rank, world)
    plan = cp.plan(prob.block_table, prob.seq_lens)
    out = cp.score_push(prob.rank_queries(rank, world), prob.index_cache, plan)
    torch.cuda.synchronize(dev)
    cp.check()
    assert_scores(out, want)


def _mori_contract_rank(rank: int, world: int) -> None:
    """One rank of the contract run: every format, calls alternating between two instances in
    the same process (MORI's shared, reference-counted initialisation)."""
    from cpindex import IndexCP

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    for step, fmt in enumerate(("nvfp4", "fp8", "bf16")):
        cfg = CPIndexConfig(transport="mori", cache_format=fmt, max_rows=8, max_width=64)
        with IndexCP(cfg, device=dev) as a, IndexCP(cfg, device=dev) as b:
            assert a.transport_name == b.transport_name == "mori"
            for cp in (a, b, a):
                _score_once(cp, rank, world, fmt, step)
        # initialised by cpindex: finalized at the last close (kept only if MORI cannot say)
        left = mori_transport._world
        assert left is None or (left.origin == "unknown" and left.refs == 0)


def _mori_subgroup_rank(rank: int, world: int) -> None:
    """Ranks 1..world-1 run mori over a group without global rank 0 (rank 0 takes no part)."""
    import torch.distributed as dist

    from cpindex import IndexCP

    group = dist.new_group(list(range(1, world)))
    if rank == 0:
        return
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    cfg = CPIndexConfig(transport="mori", max_rows=8, max_width=64)
    with IndexCP(cfg, group=group, device=dev) as cp:
        _score_once(cp, rank - 1, world - 1, "nvfp4", 0)


def _mori_application_rank(rank: int, world: int) -> None:
    """The application initialised MORI first: cpindex uses it and leaves it initialised."""
    import mori.shmem as shmem
    import torch.distributed as dist

    from cpindex import IndexCP

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    box = [shmem.shmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, box[0]) == 0
    cfg = CPIndexConfig(transport="mori", max_rows=8, max_width=64)
    with IndexCP(cfg, device=dev) as cp:
        _score_once(cp, rank, world, "nvfp4", 0)
    query = mori_transport._native_is_initialized()
    assert query is not None and query(), "cpindex finalized the application's MORI"
    assert (shmem.shmem_mype(), shmem.shmem_npes()) == (rank, world)
    assert shmem.shmem_finalize() == 0


@pytest.mark.gpu
@pytest.mark.multigpu
@_needs_mori_gpus(2)
def test_contract_over_mori():
    from cpindex.spawn import spawn_processes

    spawn_processes(2, _mori_contract_rank, backend="nccl")


@pytest.mark.gpu
@pytest.mark.multigpu
@_needs_mori_gpus(3)
def test_mori_over_a_group_without_global_rank_0():
    from cpindex.spawn import spawn_processes

    spawn_processes(3, _mori_subgroup_rank, backend="nccl")


@pytest.mark.gpu
@pytest.mark.multigpu
@_needs_mori_gpus(2)
def test_mori_leaves_the_applications_mori_initialised():
    from cpindex.spawn import spawn_processes

    spawn_processes(2, _mori_application_rank, backend="nccl")
