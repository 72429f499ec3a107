"""Keeping ranks in step on the host (docs/design.md, "Ranks in step").

Three bounded rounds of :meth:`cpindex.world.Comm.rendezvous`, each with one outcome for every
rank (all ranks complete it, or all raise):

* **construction** (:mod:`cpindex.construction`): every rank's shared configuration fields,
  the transports it would try, its placement, and any error it hit preparing them. Runs before
  anything else is exchanged, so a rank with another configuration makes every rank raise
  instead of hanging in a collective.
* **call** (transports whose calls the host identifies, i.e. ``collective``): a small header
  naming the call, exchanged before any data collective; ranks holding different headers raise
  ``OutOfStepError`` and no data collective is posted, so none is ever posted with sizes that
  differ across ranks. A rank that refuses its call (bad input) sends a refusal instead, so its
  peers raise at once rather than waiting out the timeout.
* **reset** (:class:`ResetRounds`): brings the ranks back to call 0 and realigns the group's
  round counter, whatever happened before (lone resets, missed rounds).

and :func:`meet`, the bounded barrier ``close()`` holds before freeing memory peers write into.

Payloads travel as JSON text (no pickle between processes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .comm import DEATH_GRACE_S, CollectiveFailed, CollectiveTimeout, Comm, PeerAborted
from .errors import OutOfStepError, PeerConnectionError, PeerTimeoutError
from .plan import Call

#: Header fields, in the order a mismatch is reported (the first that differs explains best).
#: ``queries`` is compared only between ranks that own the same head (:func:`agree_call`).
HEADER_FIELDS = (
    "instance", "op", "tag", "call", "config", "rows", "query_len", "requests", "width",
    "init_blocks", "local_blocks", "extra", "seq_lens", "fingerprint",
)  # fmt: skip


#: What torch.distributed raises when its store or a peer's connection is gone.
DIST_ERRORS: tuple[type[BaseException], ...] = (getattr(dist, "DistError", RuntimeError),)


def next_round(comm: Comm, scope: str) -> int:
    """The next round number of ``scope`` on this group (every rank counts alike)."""
    counters = comm.counters
    counters[scope] = counters.get(scope, 0) + 1
    return counters[scope]


def rendezvous(comm: Comm, key: str, payload: Any, timeout_s: float) -> list[Any]:
    """JSON round trip over :meth:`Comm.rendezvous` (raises what it raises)."""
    return [json.loads(p) for p in comm.rendezvous(key, json.dumps(payload), timeout_s)]


def _tensor_digest(t: torch.Tensor) -> str | None:
    # Host tensors only: reading a GPU tensor here would cost a device sync on every call.
    if t.device.type != "cpu":
        return None
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def call_header(
    op: str,
    instance: int,
    call_no: int,
    call: Call,
    config_digest: int,
    extra: dict[str, Any],
    *,
    replica_head: int | None = None,
) -> dict[str, Any]:
    """What identifies one call across ranks. ``extra`` holds an operation's own arguments
    (``select_blocks``: ``topk``). Contents travel as hashes, for host tensors only: the
    ``seq_lens``, the plan's fingerprint (block-table entries read and lengths), and, with
    ``replica_head`` (the head this rank shares with other ranks when there are more ranks
    than heads), this rank's queries. Device tensors are compared on the device instead.
    ``call`` comes last, so :class:`HeaderTexts` can append it to a cached prefix."""
    plan = call.plan
    fp = plan.fingerprint
    on_host = fp is not None and fp.device.type == "cpu"
    queries = None
    if replica_head is not None and call.iq.device.type == "cpu":
        queries = [replica_head, _tensor_digest(call.iq)]
    return {
        "instance": instance,
        "op": op,
        "tag": call.tag,
        "config": f"{config_digest:016x}",
        "rows": plan.rows,
        "requests": plan.requests,
        "query_len": plan.query_len,
        "width": plan.width,
        "init_blocks": plan.init_blocks,
        "local_blocks": plan.local_blocks,
        "extra": extra,
        "seq_lens": _tensor_digest(plan.seq_lens),
        "fingerprint": f"{int(fp[0]) & ((1 << 64) - 1):016x}" if on_host else None,
        "queries": queries,
        "call": call_no,
    }


class HeaderTexts:
    """One instance's call headers as sent: ``json.dumps(call_header(...))``, encoded once per
    distinct op, tag and sizes and reused with the call number appended, where the header
    holds no content hash (every tensor on a GPU, the serving case; the text then depends only
    on the key). Calls with host tensors hash their contents and encode every call."""

    #: Distinct keys kept (about two ops x the sparse layers' tags x a few step sizes).
    LIMIT = 4096

    __slots__ = ("_prefixes", "config_digest", "instance", "replica_head")

    def __init__(self, instance: int, config_digest: int, replica_head: int | None) -> None:
        self.instance, self.config_digest = instance, config_digest
        self.replica_head = replica_head
        self._prefixes: dict[tuple[Any, ...], str] = {}

    def text(self, op: str, call_no: int, call: Call, topk: int | None) -> str:
        """The JSON text of ``call``'s header (``topk``: ``select_blocks``' own argument)."""
        plan = call.plan
        fp = plan.fingerprint
        if (
            plan.seq_lens.device.type == "cpu"
            or (fp is not None and fp.device.type == "cpu")
            or (self.replica_head is not None and call.iq.device.type == "cpu")
        ):
            return json.dumps(self._header(op, call_no, call, topk))
        key = (
            op, call.tag, plan.block_table.shape[0], plan.query_len, plan.width,
            plan.init_blocks, plan.local_blocks, topk,
        )  # fmt: skip
        prefix = self._prefixes.get(key)
        if prefix is None:
            if len(self._prefixes) >= self.LIMIT:
                self._prefixes.clear()
            text = json.dumps(self._header(op, 0, call, topk))  # ends '"call": 0}'
            prefix = self._prefixes[key] = text[:-2]
        return f"{prefix}{call_no}}}"

    def _header(self, op: str, call_no: int, call: Call, topk: int | None) -> dict[str, Any]:
        extra = {} if topk is None else {"topk": topk}
        return call_header(
            op, self.instance, call_no, call, self.config_digest, extra,
            replica_head=self.replica_head,
        )  # fmt: skip


def refusal_header(op: str, instance: int, call_no: int, error: BaseException) -> dict[str, Any]:
    """What a rank sends instead of a header when it refused its own call."""
    return {
        "instance": instance,
        "op": op,
        "call": call_no,
        "refused": f"{type(error).__name__}: {error}",
    }


def _describe(field: str, value: Any) -> str:
    if field == "instance":
        return f"instance #{value}"
    if field == "tag":
        return "no tag" if value is None else f"tag {value}"
    if field == "seq_lens":  # a hash of the contents (None: on a GPU, not hashed)
        return f"seq_lens with hash {value}"
    if field == "fingerprint":
        return f"block-table entries and lengths with fingerprint {value}"
    return f"{field}={value}"


#: Content hashes: a rank whose tensors live on a GPU sends none (its device compares them),
#: so a missing one is not a difference.
_HASHED = frozenset({"seq_lens", "fingerprint"})


def _differ(field: str, mine: Any, theirs: Any) -> bool:
    if field in _HASHED and (mine is None or theirs is None):
        return False
    return mine != theirs


def _replica_mismatch(headers: list[dict[str, Any]]) -> tuple[int, int, int] | None:
    """The first ``(head, rank a, rank b)`` whose ranks own one head but hold different
    queries, or None."""
    first: dict[int, int] = {}
    for r, h in enumerate(headers):
        q = h.get("queries")
        if not q:
            continue
        head, digest = q
        a = first.setdefault(head, r)
        if headers[a]["queries"][1] != digest:
            return head, a, r
    return None


class CallName:
    """Names a call in messages, ``call 5 (score_push)``, from its header's text, decoded only
    when one is raised (an f-string formats it through ``str``)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        header = json.loads(self.text)
        return f"call {header['call']} ({header['op']})"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def agree_call(
    comm: Comm,
    text: str,
    call_no: int,
    timeout_s: float,
    *,
    what: str | CallName | None = None,
) -> None:
    """Collective: exchange this call's header (or refusal), JSON ``text`` of call ``call_no``,
    and raise unless every rank holds the same call. ``what`` names the call in messages
    (default: ``call 5 (score_push)``, from the header).

    Raises on every rank alike: :class:`OutOfStepError` (a peer refused its call, or holds
    another call), :class:`PeerTimeoutError` (a rank did not come within ``timeout_s``),
    :class:`PeerConnectionError` (the store or a peer is gone). A refusing rank itself
    returns and raises its own error."""
    rank = comm.rank
    if what is None:
        what = CallName(text)
    key = f"call/{next_round(comm, 'call')}"
    texts = exchange(comm, key, text, timeout_s, what=what, call_no=call_no, encoded=True)
    comm.forget(f"call/{comm.counters['call'] - 1}")  # every rank is past the previous round
    if all(t == text for t in texts):  # the usual case: nothing decoded
        return
    header = json.loads(text)
    if "refused" in header:
        return
    headers = [json.loads(t) for t in texts]
    refused = [(r, h["refused"]) for r, h in enumerate(headers) if "refused" in h]
    if refused:
        who = "; ".join(f"rank {r}: {err}" for r, err in refused)
        raise OutOfStepError(
            f"rank {rank}: {what}: refused by {who}. Nothing was exchanged; every rank raised. "
            "Call reset() on every rank to go on.",
            rank=rank,
            peer=refused[0][0],
            call=call_no,
        )
    for peer, theirs in enumerate(headers):
        if theirs == header:  # the usual case, in one dict comparison
            continue
        diff = [f for f in HEADER_FIELDS if _differ(f, header.get(f), theirs.get(f))]
        if not diff:
            continue
        f = diff[0]
        also = f" (also differ: {', '.join(diff[1:])})" if len(diff) > 1 else ""
        hint = {
            "instance": " (the ranks called different IndexCP instances; call them in the "
            "same order on every rank)",
            "config": " (the ranks' configurations differ)",
            "tag": " (a rank skipped, repeated or reordered a call)",
            "call": " (a rank skipped or repeated a call)",
            "fingerprint": " (the ranks passed different block tables or lengths of equal shapes)",
        }.get(f, "")
        raise OutOfStepError(
            f"rank {rank}: {what} is out of step with rank {peer}: {_describe(f, header.get(f))} "
            f"here, {_describe(f, theirs.get(f))} on rank {peer}{hint}{also}. Nothing was "
            "exchanged; every rank raised. Call reset() on every rank to go on.",
            rank=rank,
            peer=peer,
            call=call_no,
        )
    replica = _replica_mismatch(headers)
    if replica is not None:
        head, a, b = replica
        peer = b if a == rank else a
        raise OutOfStepError(
            f"rank {rank}: {what}: ranks {a} and {b} both own head {head} but passed different "
            f"iq (hashes {headers[a]['queries'][1]} and {headers[b]['queries'][1]}); ranks "
            "that share a head must pass the same queries. Nothing was exchanged; every rank "
            "raised. Call reset() on every rank to go on.",
            rank=rank,
            peer=peer,
            call=call_no,
        )


def exchange(
    comm: Comm,
    key: str,
    payload: Any,
    timeout_s: float,
    *,
    what: str | CallName,
    call_no: int = 0,
    encoded: bool = False,
) -> list[Any]:
    """:func:`rendezvous`, with failures raised as cpindex errors naming ``what``. With
    ``encoded``, ``payload`` is JSON text already and the ranks' texts come back undecoded."""
    rank = comm.rank
    try:
        if encoded:
            return comm.rendezvous(key, payload, timeout_s)
        return rendezvous(comm, key, payload, timeout_s)
    except CollectiveTimeout as e:
        what = str(what)  # the errors' ``phase`` is a str
        late = ", ".join(map(str, e.late)) or "unknown"
        if e.abandoned:
            msg = (
                f"rank {rank}: {what}: the other ranks gave up waiting before this rank came "
                f"(their timeout_s ran out; ranks still missing then: {late})."
            )
        else:
            msg = (
                f"rank {rank}: {what} timed out after {timeout_s} s waiting for rank(s) "
                f"{late}, which did not come (late, busy elsewhere, or their process died)."
            )
        raise PeerTimeoutError(
            msg + " Nothing was exchanged. Call reset() on every rank to go on.",
            rank=rank,
            peer=e.late[0] if e.late else -1,
            call=call_no,
            phase=what,
        ) from None
    except PeerAborted:
        raise  # construction's own: it names the failed rank (cpindex.construction)
    except CollectiveFailed as e:
        raise lost_connection(comm, str(what), e.detail, call_no, e.dead) from None
    except DIST_ERRORS as e:  # a store request the comm did not wrap
        raise lost_connection(comm, str(what), f"{type(e).__name__}: {e}", call_no) from None


def store_host(comm: Comm) -> int | None:
    """The rank of ``comm``'s group whose process serves the group's key-value store (global
    rank 0 with torch.distributed's default rendezvous), or None (no store, or not in it)."""
    group = getattr(comm, "group", None)
    if group is None:
        return None
    try:
        host = dist.get_group_rank(group, 0)
    except Exception:  # global rank 0 is not in this group
        return None
    return host


def lost_connection(
    comm: Comm, what: str, detail: str, call_no: int = 0, dead: list[int] | None = None
) -> PeerConnectionError:
    """The :class:`PeerConnectionError` for a lost store or peer during ``what``. Names the
    ranks whose processes are gone (``dead``, else looked up: on one machine a dead peer's
    process is seen), or else the rank whose process serves the store, the first suspect when
    the store is unreachable."""
    if dead is None:  # not looked for yet (a comm's CollectiveFailed has looked)
        find = getattr(comm, "dead_ranks", None)
        dead = find(grace_s=DEATH_GRACE_S) if find is not None else []
    if dead:
        who = ", ".join(map(str, dead))
        return PeerConnectionError(
            f"rank {comm.rank}: {what}: lost the connection to rank {who}: its process is gone "
            f"({detail}). The group cannot be used again: rebuild it.",
            rank=comm.rank,
            call=call_no,
            phase=what,
            peer=dead[0],
        )
    host = store_host(comm)
    where = (
        f"the group's store (served by rank {host}'s process: if that rank died, every rank "
        "loses the store) or a peer"
        if host is not None
        else "a peer"
    )
    return PeerConnectionError(
        f"rank {comm.rank}: {what}: lost the connection to {where}: {detail}",
        rank=comm.rank,
        call=call_no,
        phase=what,
        peer=-1 if host is None else host,
    )


def walk(
    comm: Comm,
    keys: Iterator[str],
    payload: Any,
    timeout_s: float,
    *,
    what: str,
    absent: str,
    then: str,
) -> tuple[list[Any], str]:
    """Every rank's ``payload`` from the first round of ``keys`` that no rank abandoned, and
    that round's key: the rounds of construction and of :class:`ResetRounds`. A rank that does
    not come makes the round time out here, named (``absent``: what it may be doing instead,
    ``then``: what is left to do); a lost store or peer raises :class:`PeerConnectionError`."""
    for key in keys:
        try:
            return rendezvous(comm, key, payload, timeout_s), key
        except CollectiveTimeout as e:
            if e.abandoned:
                continue  # a lone or earlier attempt gave up on this round: walk on
            late = ", ".join(map(str, e.late)) or "unknown"
            raise PeerTimeoutError(
                f"rank {comm.rank}: {what} timed out after {timeout_s} s waiting for rank(s) "
                f"{late}, which did not come ({absent}, busy elsewhere, or their process "
                f"died). {then}",
                rank=comm.rank,
                peer=e.late[0] if e.late else -1,
                call=0,
                phase=what,
            ) from None
        except CollectiveFailed as e:
            raise lost_connection(comm, what, e.detail, dead=e.dead) from None
        except DIST_ERRORS as e:
            raise lost_connection(comm, what, f"{type(e).__name__}: {e}") from None
    raise AssertionError("keys ran out")  # the key sequences are endless


class ResetRounds:
    """The rounds of :meth:`cpindex.IndexCP.reset` on one instance: a sequence of keys
    ``reset/{instance}/0, 1, 2, ...`` that every rank walks in order.

    A rank that resets alone waits in its next round until ``timeout_s`` and then abandons it
    (the round is gone for every rank: :meth:`Comm.rendezvous`). A rank that later reaches a
    round found gone learns so at once and walks on to the next. So when every rank calls
    :meth:`meet` together, whatever each did before (lone resets, rounds missed, resets
    repeated), every rank walks past the rounds abandoned so far and they all stop at the
    first round nobody has abandoned: the same round for all, met in one call. A rank that
    does not come makes the round time out on the others, naming it.

    The walk assumes each rank enters every round it leaves, which a rank does unless its
    process dies; a rank interrupted inside a round (an exception from the store) is behind
    the others by one round, and the next reset on every rank meets again: within two resets.
    """

    def __init__(self, comm: Comm, instance: int) -> None:
        self.comm, self.instance = comm, instance
        self.next = 0  # the first round this rank has not entered
        self._met: list[str] = []  # rounds entered, to release once every rank is past them

    def meet(self, payload: Any, timeout_s: float, *, what: str) -> list[Any]:
        """Every rank's ``payload`` from the first round not abandoned; raises like
        :func:`exchange` when a rank does not come (it names them). A rank that refused its
        reset (a bad argument) sends ``{"refused": why}``: the others raise
        :class:`OutOfStepError` naming it, at once (:func:`cpindex.construction.reset`)."""
        comm = self.comm
        reports, _ = walk(
            comm, self._keys(), payload, timeout_s, what=what, absent="not calling reset()",
            then="The instance stays broken: call reset() again on every rank.",
        )  # fmt: skip
        # Every rank has entered every round up to this one: the earlier ones can go.
        for old in self._met[:-1]:
            comm.forget(old)
        self._met = self._met[-1:]
        refused = [(r, rep["refused"]) for r, rep in enumerate(reports) if "refused" in rep]
        if refused and not (isinstance(payload, dict) and "refused" in payload):
            who = "; ".join(f"rank {r}: {why}" for r, why in refused)
            raise OutOfStepError(
                f"rank {comm.rank}: {what}: refused by {who}. Every rank raised; the "
                "instance stays broken: call reset() again on every rank.",
                rank=comm.rank,
                peer=refused[0][0],
                call=0,
            )
        return reports

    def _keys(self) -> Iterator[str]:
        """This instance's reset rounds from the first this rank has not entered."""
        while True:
            key = f"reset/{self.instance}/{self.next}"
            self.next += 1
            self._met.append(key)
            yield key


def meet(comm: Comm, key: str, timeout_s: float, *, what: str) -> None:
    """A barrier bounded by ``timeout_s``, in the round named ``key`` (unique per use, the same
    on every rank). Raises :class:`PeerTimeoutError` naming the ranks that did not come, or
    :class:`PeerConnectionError`, like :func:`exchange`."""
    exchange(comm, key, comm.rank, timeout_s, what=what)
