"""The peer-push placement verdict, from crafted rank identities (CPU only): ranks of different
processes on one GPU are refused with their reason unless the test switch
``allow_shared_gpu_processes`` is on; the switch is off by default and restores the refusal
when turned off. The verdict itself runs on the gathered identities, so no GPU is needed."""

from __future__ import annotations

import pytest
import torch

from cpindex import CPIndexConfig
from cpindex.transports.base import Context
from cpindex.transports.ipc import peer_access_verdict
from cpindex.transports.peer import allow_shared_gpu_processes, shared_gpu_reason
from cpindex.world import ThreadComm, ThreadWorld

SHARED = (
    "share this GPU from other processes: kernels of two processes do not run concurrently on "
    "one GPU, so the spin handshake would deadlock (use the one-process world, "
    "cpindex.world.run_threads)"
)


def _ctx(rank: int, world: int) -> Context:
    comm = ThreadComm(ThreadWorld(world), rank)
    return Context(CPIndexConfig(), comm, torch.device("cpu"), 1)


def _ids(*placements: tuple[str, int, str], visible: list[str] | None = None) -> list[dict]:
    """One identity per rank from ``(host, pid, gpu uuid)``; every rank sees ``visible``
    (default: every GPU named on its host)."""
    out = []
    for host, pid, uuid in placements:
        seen = visible or sorted({u for h, _, u in placements if h == host})
        out.append(
            {"host": host, "pid": pid, "uuid": uuid, "visible": seen, "index": seen.index(uuid)}
        )
    return out


@pytest.fixture
def switch_restored():
    """Leave the process-wide switch as it was, whatever the test did."""
    before = allow_shared_gpu_processes(False)
    allow_shared_gpu_processes(before)
    yield
    allow_shared_gpu_processes(before)


def test_switch_is_off_by_default(switch_restored):
    assert allow_shared_gpu_processes(False) is False  # returns the previous setting


def test_two_processes_on_one_gpu_are_refused_naming_the_other_rank():
    ids = _ids(("node", 100, "GPU-a"), ("node", 101, "GPU-a"))
    for rank, other in ((0, 1), (1, 0)):
        why = shared_gpu_reason(_ctx(rank, 2), ids)
        assert why == f"ranks [{other}] {SHARED}"
        assert peer_access_verdict(_ctx(rank, 2), ids) == (False, why)


def test_a_one_process_world_beside_another_process_is_refused_by_both():
    """Ranks 0 and 1 share a process and a GPU (allowed among themselves); rank 2 is another
    process on that GPU: every rank sees the clash, each naming the other process's ranks."""
    ids = _ids(("node", 100, "GPU-a"), ("node", 100, "GPU-a"), ("node", 101, "GPU-a"))
    assert shared_gpu_reason(_ctx(0, 3), ids) == f"ranks [2] {SHARED}"
    assert shared_gpu_reason(_ctx(1, 3), ids) == f"ranks [2] {SHARED}"
    assert shared_gpu_reason(_ctx(2, 3), ids) == f"ranks [0, 1] {SHARED}"


def test_one_process_world_is_allowed():
    ids = _ids(*[("node", 100, "GPU-a")] * 4)
    for rank in range(4):
        assert shared_gpu_reason(_ctx(rank, 4), ids) is None
        assert peer_access_verdict(_ctx(rank, 4), ids) == (True, "peer access between every pair")


def test_same_gpu_uuid_on_other_hosts_is_not_a_clash():
    """GPU UUIDs are compared on one host only; another host is refused for its own reason."""
    ids = _ids(("node-1", 100, "GPU-a"), ("node-2", 100, "GPU-a"))
    assert shared_gpu_reason(_ctx(0, 2), ids) is None
    ok, why = peer_access_verdict(_ctx(0, 2), ids)
    assert not ok and why == "rank 1 is on another host (node-2); ipc is intra-node"


def test_processes_on_gpus_they_cannot_see_of_each_other_are_not_refused_here():
    """One GPU per process (CUDA_VISIBLE_DEVICES): no clash, and no peer-access query for a GPU
    this rank cannot see."""
    ids = [
        {"host": "node", "pid": 100 + r, "uuid": u, "visible": [u], "index": 0}
        for r, u in enumerate(["GPU-a", "GPU-b"])
    ]
    for rank in range(2):
        assert shared_gpu_reason(_ctx(rank, 2), ids) is None
        assert peer_access_verdict(_ctx(rank, 2), ids)[0]


def test_switch_allows_shared_gpu_processes_and_off_refuses_again(switch_restored):
    ids = _ids(("node", 100, "GPU-a"), ("node", 101, "GPU-a"))
    assert allow_shared_gpu_processes() is False  # returns the previous setting
    for rank in range(2):
        assert shared_gpu_reason(_ctx(rank, 2), ids) is None
        assert peer_access_verdict(_ctx(rank, 2), ids) == (True, "peer access between every pair")
    # Other hosts are still refused with the switch on: it only lifts the shared-GPU refusal.
    ok, why = peer_access_verdict(_ctx(0, 2), _ids(("a", 1, "GPU-a"), ("b", 2, "GPU-a")))
    assert not ok and "another host" in why
    assert allow_shared_gpu_processes(False) is True
    assert shared_gpu_reason(_ctx(0, 2), ids) == f"ranks [1] {SHARED}"
    assert peer_access_verdict(_ctx(1, 2), ids) == (False, f"ranks [0] {SHARED}")


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_switch_takes_a_bool_only(bad, switch_restored):
    with pytest.raises(TypeError, match=r"enabled: expected a bool"):
        allow_shared_gpu_processes(bad)
    assert allow_shared_gpu_processes(False) is False  # unchanged by the refused call


def test_switch_is_no_configuration_field():
    """A serving stack's configuration cannot turn it on by accident."""
    fields = " ".join(CPIndexConfig.model_fields)
    assert "shared" not in fields and "process" not in fields
