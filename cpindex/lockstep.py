"""Keeping ranks in step on the host (docs/design.md, "Ranks in step").

Three bounded rounds of :meth:`cpindex.world.Comm.rendezvous`, each with one outcome for every
rank (all ranks complete it, or all raise):

* **construction**: every rank's shared configuration fields, the transports it would try, its
  placement, and any error it hit preparing them. Runs before anything else is exchanged, so a
  rank with another configuration makes every rank raise instead of hanging in a collective.
* **call** (transports whose calls the host identifies, i.e. ``collective``): a small header
  naming the call, exchanged before any data collective; ranks holding different headers raise
  ``OutOfStepError`` and no data collective is posted, so none is ever posted with sizes that
  differ across ranks. A rank that refuses its call (bad input) sends a refusal instead, so its
  peers raise at once rather than waiting out the timeout.
* **reset**: brings the ranks back to call 0 and realigns the group's round counter.

and :func:`meet`, the bounded barrier ``close()`` holds before freeing memory peers write into.

Payloads travel as JSON text (no pickle between processes).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .comm import CollectiveFailed, CollectiveTimeout, Comm
from .errors import OutOfStepError, PeerConnectionError, PeerTimeoutError
from .validation import Call

#: Header fields, in the order a mismatch is reported (the first that differs explains best).
HEADER_FIELDS = (
    "instance", "op", "call", "config", "rows", "query_len", "requests", "width",
    "init_blocks", "local_blocks", "extra", "seq_lens",
)  # fmt: skip


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
    data = t.contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def call_header(
    op: str, instance: int, call_no: int, call: Call, config_digest: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """What identifies one call across ranks. ``extra`` holds an operation's own arguments
    (``select_blocks``: ``topk``)."""
    return {
        "instance": instance,
        "op": op,
        "call": call_no,
        "config": f"{config_digest:016x}",
        "rows": call.rows,
        "requests": call.requests,
        "query_len": call.query_len,
        "width": call.width,
        "init_blocks": call.init_blocks,
        "local_blocks": call.local_blocks,
        "extra": extra,
        "seq_lens": _tensor_digest(call.seq_lens),
    }


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
    if field == "seq_lens":  # a hash of the contents (None: on a GPU, not hashed)
        return f"seq_lens with hash {value}"
    return f"{field}={value}"


def agree_call(
    comm: Comm, header: dict[str, Any], timeout_s: float, *, what: str
) -> list[dict[str, Any]]:
    """Collective: exchange this call's header (or refusal) and raise unless every rank holds
    the same call. ``what`` names the call in messages (``"call 5 (score_push)"``).

    Raises on every rank alike: :class:`OutOfStepError` (a peer refused its call, or holds
    another call), :class:`PeerTimeoutError` (a rank did not come within ``timeout_s``),
    :class:`PeerConnectionError` (the store or a peer is gone). A refusing rank itself gets
    the list back and raises its own error."""
    rank, call_no = comm.rank, header["call"]
    key = f"call/{next_round(comm, 'call')}"
    headers = exchange(comm, key, header, timeout_s, what=what, call_no=call_no)
    comm.forget(f"call/{comm.counters['call'] - 1}")  # every rank is past the previous round
    if "refused" in header:
        return headers
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
        diff = [f for f in HEADER_FIELDS if theirs.get(f) != header.get(f)]
        if not diff:
            continue
        f = diff[0]
        also = f" (also differ: {', '.join(diff[1:])})" if len(diff) > 1 else ""
        hint = {
            "instance": " (the ranks called different IndexCP instances; call them in the "
            "same order on every rank)",
            "config": " (the ranks' configurations differ)",
            "call": " (a rank skipped or repeated a call)",
        }.get(f, "")
        raise OutOfStepError(
            f"rank {rank}: {what} is out of step with rank {peer}: {_describe(f, header.get(f))} "
            f"here, {_describe(f, theirs.get(f))} on rank {peer}{hint}{also}. Nothing was "
            "exchanged; every rank raised. Call reset() on every rank to go on.",
            rank=rank,
            peer=peer,
            call=call_no,
        )
    return headers


def exchange(
    comm: Comm, key: str, payload: Any, timeout_s: float, *, what: str, call_no: int = 0
) -> list[Any]:
    """:func:`rendezvous`, with failures raised as cpindex errors naming ``what``."""
    rank = comm.rank
    try:
        return rendezvous(comm, key, payload, timeout_s)
    except CollectiveTimeout as e:
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
    except CollectiveFailed as e:
        raise PeerConnectionError(
            f"rank {rank}: {what}: lost the connection to the group's store or a peer: {e.detail}",
            rank=rank,
            call=call_no,
            phase=what,
        ) from None


def meet(comm: Comm, key: str, timeout_s: float, *, what: str) -> None:
    """A barrier bounded by ``timeout_s``, in the round named ``key`` (unique per use, the same
    on every rank). Raises :class:`PeerTimeoutError` naming the ranks that did not come, or
    :class:`PeerConnectionError`, like :func:`exchange`."""
    exchange(comm, key, comm.rank, timeout_s, what=what)
