"""The one path every call of an :class:`~cpindex.IndexCP` takes (docs/design.md, "Ranks in
step"): one caller at a time, refused while broken, a previous call's recorded failure raised
first, the input validated, then either the call below the CP gate (this rank alone:
``transports/local.py``) or the call's header agreed with every rank on host-lockstep
transports and the context-parallel launch; and :meth:`Runner.reset`, which brings the ranks
back.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import lockstep, partition
from .comm import Comm
from .config import CPIndexConfig
from .errors import (
    BadBlockTableError,
    BrokenInstanceError,
    CPIndexError,
    OutOfStepError,
    PeerConnectionError,
    PeerTimeoutError,
    add_note,
)
from .gate import Gate, disagreement_note
from .plan import Plan
from .transports.base import Transport
from .transports.local import LocalPath
from .validation import Checker, check_topk

#: The operations a call runs (``Runner.call``'s ``op``).
SCORE, SELECT = "score_push", "select_blocks"

# What a transport raises about its peers: the call ended for every rank alike.
_PEER_ERRORS = (OutOfStepError, PeerTimeoutError, PeerConnectionError, BadBlockTableError)

#: Calls that must never overlap share a lock. Over torch.distributed, every instance of a
#: process takes its rounds through one connection to the store, whose blocking waits hold it
#: for the others: overlapping calls of two instances, even on two process groups, wait on one
#: another across ranks until their timeouts. One lock per process then; in the one-process
#: world (ranks are threads, each with its own comm) one per rank.
_LOCKS: dict[object, tuple[object, threading.Lock]] = {}
_LOCKS_GUARD = threading.Lock()


def _process_lock(comm: Comm) -> threading.Lock:
    owner: object = comm.counters if comm.same_process else "torch.distributed"
    with _LOCKS_GUARD:
        entry = _LOCKS.get(id(owner))
        if entry is None or entry[0] is not owner:
            entry = _LOCKS[id(owner)] = (owner, threading.Lock())
        return entry[1]


CONCURRENT = (
    "call every IndexCP of a process from one thread, in the same order on every rank (a "
    "second stream or micro-batch gets its own instance, called from that same thread)"
)


def static_blocks(block_table: object, width: object) -> int | None:
    """A plan's blocks (``requests * width``) from :meth:`IndexCP.plan`'s raw arguments, before
    validation, or None where they do not tell (the call is then taken as context-parallel)."""
    try:  # an exotic argument whose attributes raise is validation's to report, not this
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            return None
        if width is None:
            width = block_table.shape[1]
        if isinstance(width, bool) or not isinstance(width, int):
            return None
        requests = int(block_table.shape[0])
        # Sizes no call may have (width < 1, no request): a refusal the peers must hear of.
        return requests * width if requests >= 1 and width >= 1 else None
    except Exception:
        return None


def checked_blocks(plan: object) -> int | None:
    """A call's blocks as its plan was checked (:attr:`Plan.checked`, so a plan resized or
    forged since counts as it was made), or None where it does not tell."""
    if not isinstance(plan, Plan) or plan.checked is None:
        return None
    try:
        return int(plan.checked[1][0]) * int(plan.checked[9])  # requests * width
    except Exception:
        return None


class Runner:
    """Per-call state of one instance: call count, broken state, reset rounds, the CP gate."""

    def __init__(
        self,
        config: CPIndexConfig,
        comm: Comm,
        transport: Transport,
        instance: int,
        device: torch.device,
        local: LocalPath,
        gate: Gate,
    ) -> None:
        self.config, self.comm, self.transport = config, comm, transport
        self.local, self.gate = local, gate
        self.instance, self.device = instance, device
        self.rank, self.world = comm.rank, comm.world_size
        self.heads_per_rank = config.heads_per_rank(self.world)
        self.digest = config.digest()
        self.busy = threading.Lock()
        self.others = _process_lock(comm)
        self.closed = False
        self.calls = 0  # calls on this instance since construction or the last reset
        self.broken: BaseException | None = None  # why calls are refused until reset()
        self.left_mid_call: str | None = None  # a host-lockstep call abandoned after its header
        self.resets = lockstep.ResetRounds(comm, instance)
        # With more ranks than heads, ranks r, r + H, ... own one head: their queries must agree.
        heads = config.num_heads
        self.replica_head = (
            partition.heads_of_rank(self.rank, heads, self.world)[0] if self.world > heads else None
        )
        # Calls carry the plan's agreement fingerprint where config and transport allow, in
        # one slot per instance: allocated here, never during a graph capture, and shared by
        # every plan (each call recomputes it before use, calls run one at a time).
        fingerprinting = config.fingerprint and transport.compares_fingerprint
        fp = torch.zeros(1, dtype=torch.int64, device=device) if fingerprinting else None
        self.checker = Checker(config, self.heads_per_rank, device, fp)
        # Fixed for the instance's life, read on every call.
        self._cp_from = gate.threshold
        self._cp_from_select = gate.threshold_for(SELECT)
        self._lockstep = transport.host_lockstep
        self._headers = lockstep.HeaderTexts(instance, self.digest, self.replica_head)
        self._sync = config.error_check == "sync" and device.type == "cuda"

    # ---- the gate ---------------------------------------------------------------------------
    def uses_cp(self, blocks: int | None, op: str = SCORE) -> bool:
        """Whether an ``op`` call of ``blocks`` (``requests * width``) goes context-parallel;
        None (sizes unknown: arguments that will be refused) counts as context-parallel."""
        return blocks is None or self.gate.uses_cp(blocks, op)

    # ---- validation -----------------------------------------------------------------------
    def plan(
        self,
        block_table: object,
        seq_lens: object,
        query_len: object,
        init_blocks: object,
        local_blocks: object,
        width: object,
    ) -> Plan:
        """:meth:`Checker.plan` for :meth:`IndexCP.plan`. A refused plan with peers counts as
        this rank's refusal of its next call (they raise at once, this instance refuses calls
        until reset), so that peers never wait out ``timeout_s`` for a call that won't come.
        Below the CP gate no peer waits for that call: the refusal is this rank's alone."""
        if self.closed:
            raise CPIndexError("plan on a closed IndexCP")
        try:
            return self.checker.plan(
                block_table, seq_lens, query_len=query_len, init_blocks=init_blocks,
                local_blocks=local_blocks, width=width,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            self.refuse_input("plan", e, block_table, width)
            raise

    def refuse_input(self, what: str, error: BaseException, block_table: object, width: object):
        """This rank refuses its next call for a bad argument found before the call (by
        :meth:`plan`, or by the drop-in's own checks): with peers, above the CP gate, that call
        still counts and the peers are told, so every rank raises instead of some waiting out
        ``timeout_s``. Below the gate no peer waits for that call: the refusal is this rank's
        alone and the instance stays usable."""
        peers_wait = self.uses_cp(static_blocks(block_table, width))
        if self.world > 1 and self.broken is None and peers_wait:
            with self._locked(what):
                self.calls += 1
                self.refuse(what, error)

    # ---- the call ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """Holds this instance's lock and the process's call lock (refusing, not waiting)."""
        self._acquire(what)
        try:
            yield
        finally:
            self.others.release()
            self.busy.release()

    def _acquire(self, what: str) -> None:
        if self.closed:
            raise CPIndexError(f"{what} on a closed IndexCP")
        if not self.busy.acquire(blocking=False):
            raise CPIndexError(
                f"rank {self.rank}: {what} called concurrently on one IndexCP: {CONCURRENT}"
            )
        if not self.others.acquire(blocking=False):
            self.busy.release()
            raise CPIndexError(
                f"rank {self.rank}: {what} called while another IndexCP of this process is "
                f"inside a call on another thread: {CONCURRENT}"
            )

    def call(
        self,
        op: str,
        iq: object,
        index_cache: object,
        plan: object,
        tag: object,
        topk: object = None,
        return_scores: object = False,
    ) -> Any:
        """One call of ``op`` (:data:`SCORE`, or :data:`SELECT`, which takes ``topk`` and
        ``return_scores``). Any failure once peers may be waiting marks the instance broken
        until :meth:`reset`.

        Below the gate nothing is exchanged, so no peer waits on this rank: a call this rank
        refuses (bad input, or a device error an earlier call below the gate recorded) is not
        made, is not counted and leaves the instance usable; the peers never hear of it. Every
        rank decides alike from static sizes, so the call counts stay aligned.

        The hot path of every call (docs/design.md, "The host path"): no closures, no
        messages formatted unless raised, every check before anything is launched."""
        self._acquire(op)
        try:
            if self.broken is not None:
                e = self.broken
                raise BrokenInstanceError(
                    f"rank {self.rank}: {op} refused: this IndexCP failed earlier "
                    f"({type(e).__name__}: {e}). Ranks may be out of step; call reset() on "
                    "every rank to go on."
                ) from e
            usable = False  # a failure no peer waits on: the instance stays usable
            try:
                self.calls += 1
                pending = call = None
                try:
                    self.transport.check()  # a previous call's recorded failure, no sync
                    pending = self.local.take_error()  # one a call below the gate recorded
                    if pending is not None:
                        raise pending
                    call = self.checker.planned(iq, index_cache, plan, tag)
                    if op == SELECT:
                        topk = check_topk(self.config, topk, return_scores)
                except Exception as e:
                    # Exact after validation; before it, as the plan was checked.
                    blocks = call.plan.blocks if call is not None else checked_blocks(plan)
                    own = e is pending or isinstance(e, (TypeError, ValueError))
                    if not self.uses_cp(blocks, op):  # below the gate no peer waits
                        if own:
                            self.calls -= 1
                            usable = True
                        raise
                    usable = self.world == 1 and own
                    if not usable:
                        self.refuse(op, e)
                    raise
                if call.plan.blocks < (self._cp_from_select if op == SELECT else self._cp_from):
                    local = self.local
                    out = (
                        local.select_blocks(call, topk) if op == SELECT else local.score_push(call)
                    )
                    if self._sync:
                        torch.cuda.current_stream(self.device).synchronize()
                        pending = local.take_error()
                        if pending is not None:
                            usable = True  # this rank's own input: the call counts, as the peers'
                            raise pending
                    return out
                if self._lockstep:
                    header = self._headers.text(
                        op, self.calls, call, topk if op == SELECT else None
                    )
                    lockstep.agree_call(self.comm, header, self.calls, self.config.timeout_s)
                transport = self.transport
                try:
                    out = (
                        transport.select_blocks(call, topk)
                        if op == SELECT
                        else transport.score_push(call)
                    )
                except BaseException as e:
                    if self._lockstep and not isinstance(e, _PEER_ERRORS):
                        # The header passed, so peers may wait in this call's collectives.
                        self.left_mid_call = (
                            f"rank {self.rank} left call {self.calls} after its header round "
                            f"({type(e).__name__}: {e})"
                        )
                    if isinstance(e, lockstep.DIST_ERRORS):  # never a raw backend error
                        raise lockstep.lost_connection(
                            self.comm, f"call {self.calls} ({op})", f"{type(e).__name__}: {e}",
                            self.calls,
                        ) from e  # fmt: skip
                    raise
                if self._sync:
                    torch.cuda.current_stream(self.device).synchronize()
                    transport.check()
                return out
            except BaseException as e:
                if self.broken is None and not usable:
                    self.broken = e
                if isinstance(e, PeerTimeoutError) and (note := disagreement_note(self.gate)):
                    add_note(e, note)  # a peer may have made this call below the gate
                raise
        finally:
            self.others.release()
            self.busy.release()

    def refuse(self, what: str, error: BaseException) -> None:
        """Tell the peers that this rank refused its call (host-lockstep transports), so they
        raise at once instead of waiting out ``timeout_s``. Other transports' peers time out
        in the kernel and report this rank as late."""
        self.broken = error
        if not self.transport.host_lockstep:
            return
        header = json.dumps(lockstep.refusal_header(what, self.instance, self.calls, error))
        try:
            lockstep.agree_call(
                self.comm, header, self.calls, self.config.timeout_s,
                what=f"call {self.calls} ({what})",
            )  # fmt: skip
        except CPIndexError as e:
            add_note(error, f"telling the other ranks failed too: {type(e).__name__}: {e}")

    def check(self) -> None:
        try:
            self.transport.check()
        except BaseException as e:
            if self.broken is None:
                self.broken = e
            raise
        pending = self.local.take_error()
        if pending is not None:  # a call below the gate: this rank's own, the instance stays usable
            raise pending

    def reset(self, timeout_s: float | None) -> None:
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        with self._locked("reset"):
            mine = {
                "round": self.comm.counters.get("call", 0),
                "unrecoverable": self.transport.unrecoverable or self.left_mid_call,
            }
            try:
                reports = self.resets.meet(mine, timeout, what="reset")
                stuck = [(r, rep["unrecoverable"]) for r, rep in enumerate(reports)]
                stuck = [(r, why) for r, why in stuck if why]
                if stuck:
                    raise CPIndexError(
                        f"rank {self.rank}: reset: the group cannot be reused: "
                        + "; ".join(f"rank {r}: {why}" for r, why in stuck)
                        + ". Its process group may hold a half-done collective: close this "
                        "instance and rebuild the group."
                    )
                self.transport.reset()
                self.local.clear()
            except BaseException as e:
                self.broken = self.broken or e
                raise
            # Every rank made the same number of header rounds except around the failure:
            # continue from the furthest, so no rank reuses a round another has entered.
            self.comm.counters["call"] = max(rep["round"] for rep in reports)
            self.calls = 0
            self.broken = None
