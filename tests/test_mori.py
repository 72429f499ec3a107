"""The ``mori`` transport: lazy import, availability reasons, selection (CPU), and the contract
run over MORI on a ROCm node (skipped where MORI or a ROCm GPU is missing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from cpindex import TransportUnavailable
from cpindex.config import CPIndexConfig
from cpindex.transports import mori as mori_transport
from cpindex.transports.base import Context, candidates, select
from cpindex.world import ThreadComm, ThreadWorld

MoriTransport = mori_transport.MoriTransport
mori_status = mori_transport.mori_status


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


def test_status_without_mori_names_the_install(fresh_status, monkeypatch):
    monkeypatch.setitem(sys.modules, "mori", None)  # import mori -> ModuleNotFoundError
    ok, why = mori_status()
    assert not ok
    assert "pip install cpindex[rocm]" in why
    assert "ROCm" in why
    assert mori_status() == (ok, why)  # cached


def test_status_missing_rocm_libraries_is_one_clear_reason(fresh_status, monkeypatch, tmp_path):
    # What the amd-mori wheel does on a machine without ROCm: `import mori` works,
    # `import mori.shmem` fails loading the HIP runtime.
    pkg = tmp_path / "mori"
    (pkg / "shmem").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "shmem" / "__init__.py").write_text(
        "raise OSError('libamdhip64.so.7: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mori", raising=False)
    ok, why = mori_status()
    assert not ok
    assert "libamdhip64" in why and "OSError" in why
    assert "pip install cpindex[rocm]" in why


@pytest.mark.skipif(mori_status()[0], reason="MORI is installed here")
def test_status_here_is_unavailable():
    ok, why = mori_status()
    assert not ok and "pip install cpindex[rocm]" in why


def test_probe_on_cpu_says_why():
    ok, why = MoriTransport.probe(_cpu_context())
    assert not ok
    assert "GPU" in why and "cpu" in why


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


# ---- the contract over MORI (ROCm node with >= 2 GPUs and amd-mori) -----------------------


def _rocm_gpus() -> int:
    return torch.cuda.device_count() if torch.version.hip and torch.cuda.is_available() else 0


def _skip_reason() -> str:
    ok, why = mori_status()
    parts = [] if ok else [f"mori: {why}"]
    if _rocm_gpus() < 2:
        parts.append(f"ROCm GPUs: {_rocm_gpus()} (torch.version.hip={torch.version.hip}), need 2")
    return "MORI + ROCm not present (" + "; ".join(parts) + ")"


def _mori_contract_rank(rank: int, world: int) -> None:
    """One rank of the contract run: every format, two calls per instance, and a second
    instance in the same process (exercises MORI's shared, refcounted initialisation)."""
    from cpindex import IndexCP, partition, reference, testing

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    for step, fmt in enumerate(("nvfp4", "fp8", "bf16")):
        cfg = CPIndexConfig(transport="mori", cache_format=fmt, max_rows=8, max_width=64)
        prob = testing.make_problem(5, 40 * 128, fmt, seed=step, device=dev)
        heads = partition.heads_of_rank(rank, cfg.num_heads, world)
        want = reference.block_scores(
            prob.q,
            prob.index_cache,
            prob.block_table,
            prob.seq_lens,
            init_blocks=0,
            local_blocks=1,
            width=prob.width,
            sm_scale=cfg.sm_scale,
        )[heads]
        with IndexCP(cfg, device=dev) as a, IndexCP(cfg, device=dev) as b:
            assert a.transport_name == b.transport_name == "mori"
            for cp in (a, b, a):
                out = cp.score_push(
                    prob.rank_queries(rank, world), prob.index_cache, prob.block_table,
                    prob.seq_lens, 0, 1,
                )  # fmt: skip
                torch.cuda.synchronize(dev)
                cp.check()
                torch.testing.assert_close(out, want.to(dev), rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not (mori_status()[0] and _rocm_gpus() >= 2), reason=_skip_reason())
def test_contract_over_mori():
    from cpindex.world import spawn_processes

    spawn_processes(2, _mori_contract_rank, backend="nccl")
