"""The transport contract, the registry, and the one place a transport is chosen.

Every transport implements ``score_push`` with the same result (docs/contract.md §5), and
``select_blocks`` (§6) through a default that any transport can use or override. Choosing is a
collective: each rank probes every candidate locally, the reports are all-gathered, and every
rank picks the same first candidate that all ranks can run (and whose self-test passes on all
ranks). A rank never decides alone: ranks on different transports would deadlock.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import selection
from ..comm import Comm
from ..config import CPIndexConfig
from ..errors import TransportUnavailable
from ..plan import Call

log = logging.getLogger("cpindex")


@dataclass(frozen=True)
class Context:
    """What a transport is built from; the same on every rank except rank/device."""

    config: CPIndexConfig  # bound to the group's world size
    comm: Comm
    device: torch.device
    ranks_per_device: int  # ranks of this group sharing this rank's GPU (one-process world)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world_size

    @property
    def heads_per_rank(self) -> int:
        return self.config.heads_per_rank(self.world)


class Transport(ABC):
    """One way to run ``score_push``. Subclasses register themselves by ``name``."""

    name: ClassVar[str]
    ctx: Context
    #: Whether every call's identity is compared on the host before anything is exchanged
    #: (``IndexCP`` runs a header round through ``cpindex.lockstep``). Transports whose kernel
    #: carries the identity with the queries (``ipc``, ``mori``) leave it False: a host round
    #: per call would cost their latency and cannot sit inside a graph capture.
    host_lockstep: ClassVar[bool] = False
    #: Whether calls compare the plan's agreement fingerprint (``call.plan.fingerprint``) across
    #: ranks; ``IndexCP`` computes it only then (and when ``config.fingerprint`` is on). ``ipc``
    #: and ``mori`` leave it False: their kernel hashes what each call reads itself.
    compares_fingerprint: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def probe(cls, ctx: Context) -> tuple[bool, str]:
        """Can this rank run the transport? Local and cheap: no collectives."""

    @abstractmethod
    def __init__(self, ctx: Context) -> None:
        """Allocate and exchange buffers (collective). Raise TransportUnavailable on failure."""

    @abstractmethod
    def score_push(self, call: Call) -> torch.Tensor:
        """This rank's ``[heads_per_rank, rows, width]`` scores, a view valid until the next
        call. ``call`` is validated: ``call.iq``, ``call.index_cache``, ``call.tag`` and the
        step's ``call.plan`` (block table, lengths, counts, width, fingerprint)."""

    def select_blocks(self, call: Call, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' top ``topk`` blocks (docs/contract.md §6): int32 ids ascending,
        ``-1``-padded, and their float32 scores, both ``[heads_per_rank, rows, topk]`` views
        valid until the next call.

        This default is right for every transport: ``score_push``, then the selection on this
        rank's full score rows. A transport that can exchange candidates instead overrides it.
        """
        scores = self.score_push(call)
        ctx = self.ctx
        # One-process world, eager: the selection may allocate or sort, which can implicitly
        # synchronize the device; meeting once every rank's push is launched, and again once
        # the selection is enqueued, keeps that from sitting between two ranks' pushes
        # (docs/design.md, the one-process world, rule 2). Graph replays hold no such work.
        fence = (
            ctx.comm.same_process
            and ctx.device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing()
        )
        if fence:
            ctx.comm.barrier()
        ids, vals = self.selected_out(call.plan.rows, topk)
        selection.select(scores, topk, ids, vals)
        if fence:
            ctx.comm.barrier()
        return ids, vals

    def scores_out(self, rows: int, width: int) -> torch.Tensor:
        """The float32 ``[heads_per_rank, rows, width]`` view ``score_push`` returns for a call
        of this size (the calls below the CP gate write the same view: ``transports/local.py``)."""
        raise NotImplementedError(f"transport '{self.name}' does not expose its score buffer")

    def selected_out(self, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The int32 ids and float32 scores views ``[heads_per_rank, rows, topk]`` that
        ``select_blocks`` returns for a call of this size. This default's buffers are made on
        first use; a transport with its own result buffers overrides it."""
        outputs = self.__dict__.get("_select_outputs")
        if outputs is None:
            ctx = self.ctx
            outputs = self._select_outputs = selection.Outputs(
                ctx.config, ctx.heads_per_rank, ctx.device
            )
        return outputs.views(rows, topk)

    def exchange_bytes(self, rows: int, width: int, topk: int | None = None) -> int:
        """Bytes this rank sends its peers in one call's score or candidate exchange:
        ``score_push`` (``topk=None``) or ``select_blocks``. The query exchange, the same for
        both calls, is not counted. The default ``select_blocks`` moves whole score rows."""
        return selection.score_bytes(self.ctx.config, self.ctx.world, rows, width)

    @property
    def capturable(self) -> bool:
        """Whether ``score_push`` can be captured in a CUDA/HIP graph."""
        return True

    def self_test(self) -> tuple[bool, str]:
        """A one-time end-to-end check run at construction (collective)."""
        return True, "no self-test"

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise any error a previous call recorded on the device (no sync)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Clear errors and counters after a failure (collective; ``IndexCP.reset`` has
        already met every rank in a bounded round, so collectives here find everyone)."""

    @property
    def unrecoverable(self) -> str | None:
        """Why ``reset()`` cannot bring this rank back (a collective left half done), or
        None."""
        return None

    def close(self, meet: Callable[[], object] | None = None) -> None:  # noqa: B027 - optional hook
        """Release resources. Idempotent. A transport whose memory peers write into waits for
        its device, then calls ``meet`` (default: a barrier of the group) so that no peer is
        still writing when it frees; if ``meet`` raises, the memory is kept."""


REGISTRY: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    REGISTRY[cls.name] = cls
    return cls


def candidates(config: CPIndexConfig) -> list[str]:
    """Transports to try, in order. ``auto``: ``ipc`` (fastest on one node with peer access),
    then ``collective`` (always works); with ``prefer_mori`` set, ``mori`` is tried first."""
    if config.transport != "auto":
        return [config.transport]
    return [*(["mori"] if config.prefer_mori else []), "ipc", "collective"]


def select(ctx: Context) -> Transport:
    """Build the transport every rank agrees on (collective; same order on all ranks)."""
    names = candidates(ctx.config)
    explicit = ctx.config.transport != "auto"
    mine = {}
    for name in names:
        try:
            mine[name] = REGISTRY[name].probe(ctx)
        except Exception as e:  # a probe must never leave the others waiting
            mine[name] = (False, f"probe failed: {e}")
    reports = ctx.comm.all_gather_object(mine)
    why_not: list[str] = []
    for name in names:
        # .get: construction compared the candidate lists already; never a bare KeyError
        absent = (False, f"'{name}' is not among this rank's candidates")
        got = [rep.get(name, absent) for rep in reports]
        bad = [(r, why) for r, (ok, why) in enumerate(got) if not ok]
        if bad:
            why = "; ".join(f"rank {r}: {reason}" for r, reason in bad)
            if explicit:
                raise TransportUnavailable(f"transport '{name}' cannot run: {why}")
            why_not.append(f"{name} ({why})")
            continue
        try:  # constructors agree collectively before raising, so all ranks land here
            transport = REGISTRY[name](ctx)
        except TransportUnavailable as e:
            if explicit:
                raise
            why_not.append(f"{name} ({e})")
            continue
        ok, detail = transport.self_test()
        results = ctx.comm.all_gather_object((ok, detail))
        failed = [(r, d) for r, (o, d) in enumerate(results) if not o]
        if failed:
            transport.close()
            why = "; ".join(f"rank {r}: {d}" for r, d in failed)
            if explicit:
                raise TransportUnavailable(f"transport '{name}' failed its self-test: {why}")
            why_not.append(f"{name} (self-test: {why})")
            continue
        if ctx.rank == 0:
            chosen = "requested" if explicit else "auto"
            skipped = f"; skipped {', '.join(why_not)}" if why_not else ""
            log.info(
                "cpindex: transport '%s' (%s) on %d ranks: %s%s",
                name,
                chosen,
                ctx.world,
                reports[0][name][1],
                skipped,
            )
        transport.selection_note = "; ".join(why_not)  # type: ignore[attr-defined]
        return transport
    raise TransportUnavailable("no transport can run: " + "; ".join(why_not))
