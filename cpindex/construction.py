"""Building an :class:`cpindex.IndexCP`, bounded like a call (docs/contract.md, "Failure
handling").

* **The agreement**, before anything else is exchanged: every rank's shared configuration
  fields, the transports it would try, its placement, its process, its round counters, whether
  its process group may hold a half-done collective, and any error it hit with its own
  arguments. One outcome for all: every rank builds, or every rank raises. A rank that refuses
  its arguments still takes part, so its peers raise at once instead of waiting out
  ``timeout_s``. The rounds are walked like ``reset()``'s: a round some rank abandoned (it
  constructed alone, or refused before the agreement) is skipped, so a failed construction
  never leaves the group out of step for the next one.
* **The build** after it (transport, CP gate, runner) runs with every round bounded by
  ``config.timeout_s`` (:func:`cpindex.comm.bounded`). A rank that fails there (an allocation,
  a probe) closes the round its peers wait in (:func:`cpindex.comm.abort`), so every rank
  raises one library error naming it; a peer that stalls or dies makes the others raise
  :class:`PeerTimeoutError` or :class:`PeerConnectionError` naming it.
* **reset()'s argument**, checked alike on every rank before any round; a rank with a bad one
  still meets its peers with a refusal, so no outcome splits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import gate, lockstep
from .comm import (
    CollectiveFailed,
    CollectiveTimeout,
    Comm,
    PeerAborted,
    TorchComm,
    abort,
    bounded,
    process_id,
)
from .config import CPIndexConfig
from .errors import (
    ConfigMismatchError,
    CPIndexError,
    PeerConnectionError,
    PeerTimeoutError,
    add_note,
)
from .runner import Runner
from .transports import Context, Transport, candidates, select
from .transports.local import LocalPath

WHAT = "IndexCP construction"
#: What a failed construction leaves to do, in every message about one.
AGAIN = "Nothing was built; fix the cause and construct IndexCP again on every rank."
#: Longest ``reset(timeout_s)`` (``config.timeout_s``' own bound).
MAX_TIMEOUT_S = 3600.0
#: Round counters that are not round numbers (tensor-collective arrivals, counted per rank).
_NOT_ROUNDS = frozenset({"arrivals"})


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """This rank's device: a CPU or an existing CUDA/HIP device (``meta`` and friends have no
    memory to exchange)."""
    try:
        dev = torch.device(device) if device is not None else _default_device()
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {e}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device: expected a cpu or cuda device, got {dev}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {dev} requested, but no CUDA/HIP device is visible")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {dev} does not exist ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Built:
    """What :func:`build` made, for :class:`cpindex.IndexCP` to hold."""

    comm: Comm
    config: CPIndexConfig
    device: torch.device
    heads_per_rank: int
    transport: Transport
    local: LocalPath
    gate: gate.Gate
    runner: Runner


def make_comm(group: dist.ProcessGroup | None, comm: Comm | None) -> Comm:
    """The comm an instance runs on: ``comm``, or one over ``group`` (default: the world)."""
    if comm is None:
        return TorchComm(group)
    if group is not None:
        raise ValueError("group: pass either group or comm, not both")
    return comm


def build(
    config: object,
    group: dist.ProcessGroup | None,
    device: torch.device | str | None,
    comm: Comm | None,
) -> Built:
    """Collective, bounded by ``config.timeout_s`` at every round: agree, then build the
    transport, the CP gate and the runner (module docstring). Raises on every rank alike."""
    comm = make_comm(group, comm)  # no comm, no peers to tell: raised here alone
    error: BaseException | None = None
    if config is None:
        config = CPIndexConfig()
    elif not isinstance(config, CPIndexConfig):
        error = TypeError(f"config: expected CPIndexConfig, got {type(config).__name__}")
        config = CPIndexConfig()  # only its timeout bounds the refusal round
    bound, dev, placements, n = agree(config, comm, device, error)  # type: ignore[arg-type]
    key = [dev.type, dev.index, True]
    sharing = sum(1 for p in placements if p == key) if key[0] == "cuda" else 1
    try:
        with bounded(comm, bound.timeout_s):
            ctx = Context(bound, comm, dev, max(1, sharing))
            transport = select(ctx)
            local = LocalPath(ctx, transport)
            gate_ = gate.resolve(bound, comm, dev, transport, local)
            runner = Runner(bound, comm, transport, n, dev, local, gate_)
            comm.all_gather_object(True)  # built on every rank: a failure above reached all
    except BaseException as e:
        err = _construction_error(comm, e)
        if err is e:
            raise
        raise err from err.__cause__  # this rank's own error stays attached; a peer's has none
    return Built(
        comm, bound, dev, bound.heads_per_rank(comm.world_size), transport, local, gate_, runner
    )


def _construction_error(comm: Comm, e: BaseException) -> BaseException:
    """The one library error of a build that failed on this rank (``e``), after telling the
    peers when the failure is this rank's own."""
    rank = comm.rank
    if isinstance(e, PeerAborted):
        return CPIndexError(f"rank {rank}: {WHAT} failed on rank {e.rank}: {e.reason}. {AGAIN}")
    if isinstance(e, CollectiveTimeout):
        late = ", ".join(map(str, e.late)) or "unknown"
        how = (
            f"the other ranks gave up waiting before this rank came (ranks missing then: {late})"
            if e.abandoned
            else f"timed out waiting for rank(s) {late}, which did not come (stalled, busy "
            "elsewhere, or their process died)"
        )
        return PeerTimeoutError(
            f"rank {rank}: {WHAT}: {how}. {AGAIN}",
            rank=rank,
            peer=e.late[0] if e.late else -1,
            call=0,
            phase=WHAT,
        )
    if isinstance(e, CollectiveFailed):
        return lockstep.lost_connection(comm, WHAT, e.detail, 0, e.dead)
    if isinstance(e, PeerTimeoutError):  # a round of lockstep's (the gate's measurement)
        msg = str(e).replace(" Call reset() on every rank to go on.", "")
        return PeerTimeoutError(
            f"{msg} {AGAIN}", rank=e.rank, peer=e.peer, call=0, phase=f"{WHAT}: {e.phase}"
        )
    if isinstance(e, PeerConnectionError):
        return e
    # This rank's own failure: the peers leave their rounds at once, naming it.
    reason = f"{type(e).__name__}: {_first_line(e)}"
    abort(comm, reason)
    if isinstance(e, CPIndexError) or not isinstance(e, Exception):
        return e  # already a library error (or an interrupt)
    out = CPIndexError(f"rank {rank}: {WHAT} failed on this rank: {reason}. {AGAIN}")
    out.__cause__ = e
    return out


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def agree(
    config: CPIndexConfig,
    comm: Comm,
    device: torch.device | str | None,
    error: BaseException | None = None,
) -> tuple[CPIndexConfig, torch.device, list[Any], int]:
    """Collective, bounded by ``config.timeout_s``, and before anything else is exchanged:
    every rank's shared fields, transport candidates, placement, process, round counters and
    local error (``error``: one found before, e.g. a bad argument). Raises on every rank if any
    rank failed, any shared field differs, or the group cannot be used. Returns the bound
    config, the device, every rank's placement and the construction's number on this group
    (the instance number)."""
    bound, dev = config, None
    if error is None:
        try:
            bound = config.with_world_size(comm.world_size)
            dev = resolve_device(device)
        except ValueError as e:  # pydantic's ValidationError is one
            error = e
    half_done = getattr(comm, "half_done", None)
    mine = {
        "shared": bound.shared_values(),
        "candidates": candidates(bound),
        "placement": None if dev is None else [dev.type, dev.index, comm.same_process],
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "half_done": half_done,
        "counters": {k: v for k, v in comm.counters.items() if k not in _NOT_ROUNDS},
        "process": process_id(),
    }
    reports, n = _meet(comm, mine, config.timeout_s)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if error is not None:
        others = [f"rank {r}: {why}" for r, why in failed if r != comm.rank]
        if others:
            add_note(error, "other ranks failed too: " + "; ".join(others))
        raise error
    if failed:
        raise CPIndexError(
            f"rank {comm.rank}: {WHAT} failed on "
            + "; ".join(f"rank {r}: {why}" for r, why in failed)
            + f". {AGAIN}"
        )
    stuck = [(r, rep["half_done"]) for r, rep in enumerate(reports) if rep["half_done"]]
    if stuck:
        raise CPIndexError(
            f"rank {comm.rank}: {WHAT}: the process group cannot be used again: "
            + "; ".join(f"rank {r}: {why}" for r, why in stuck)
            + ". Its backend may hold that collective half done, and another collective on it "
            "would abort the process. Destroy it and build a new group on every rank "
            "(dist.destroy_process_group() and init_process_group(), or dist.new_group()), "
            "then construct IndexCP on the new group."
        )
    diffs = []
    for field, value in mine["shared"].items():
        values = [rep["shared"].get(field) for rep in reports]
        if any(v != value for v in values):
            diffs.append(f"{field}: " + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))
    if not diffs and any(rep["candidates"] != mine["candidates"] for rep in reports):
        diffs.append(
            "transports tried: "
            + ", ".join(f"rank {r}: {rep['candidates']}" for r, rep in enumerate(reports))
        )
    if diffs:
        local = ", ".join(sorted(CPIndexConfig.LOCAL_FIELDS))
        raise ConfigMismatchError(
            f"rank {comm.rank}: the ranks built IndexCP from different configurations: "
            + "; ".join(diffs)
            + f". Every field but {local} must be equal on every rank."
        )
    # Rounds named from here on are fresh on every rank, whatever each did before.
    counters = comm.counters
    for rep in reports:
        for scope, value in rep["counters"].items():
            if scope != "new" and value > counters.get(scope, 0):
                counters[scope] = value
    if hasattr(comm, "processes"):
        comm.processes = [rep["process"] for rep in reports]  # type: ignore[attr-defined]
    assert dev is not None
    return bound, dev, [rep["placement"] for rep in reports], n


def _meet(comm: Comm, mine: dict[str, Any], timeout_s: float) -> tuple[list[Any], int]:
    """The agreement's round: rounds ``new/1, 2, ...`` walked like reset()'s
    (:func:`lockstep.walk`), skipping those some rank abandoned, so ranks whose earlier
    constructions failed apart meet in the same round. Returns the reports and the round's
    number."""
    keys = (f"new/{lockstep.next_round(comm, 'new')}" for _ in itertools.count())
    reports, key = lockstep.walk(
        comm, keys, mine, timeout_s, what=WHAT, absent="not constructing", then=AGAIN
    )
    n = int(key.rsplit("/", 1)[1])
    comm.forget(f"new/{n - 1}")
    return reports, n


def refuse(
    error: BaseException,
    group: dist.ProcessGroup | None = None,
    comm: Comm | None = None,
    timeout_s: float | None = None,
) -> NoReturn:
    """Raise ``error`` (a bad constructor argument found before :func:`build`, e.g. by the
    vLLM drop-in) after taking part in the construction's agreement with it, so the peers
    raise at once naming this rank instead of waiting out their timeout, and the group stays
    in step for the next construction. Without a usable group there are no peers to tell."""
    try:
        c = make_comm(group, comm)
    except ValueError:
        raise error from None
    config = CPIndexConfig() if timeout_s is None else CPIndexConfig(timeout_s=timeout_s)
    try:
        agree(config, c, None, error)
    except BaseException as e:
        if e is not error:
            add_note(error, f"telling the other ranks failed too: {type(e).__name__}: {e}")
    raise error


# ---- reset() ------------------------------------------------------------------------------


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float | None:
    """``timeout_s`` checked alike on every rank: None, or a real number of seconds in
    ``(0, MAX_TIMEOUT_S]``."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name}: expected a number of seconds or None, got {timeout_s!r}")
    value = float(timeout_s)
    if not math.isfinite(value) or not 0.0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{name}: expected seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return value


def reset(runner: Runner, timeout_s: object) -> None:
    """:meth:`cpindex.IndexCP.reset`: ``timeout_s`` checked before any round; a bad one is
    still a round, a refusal that makes every peer's reset raise :class:`OutOfStepError` at
    once (bounded by ``config.timeout_s``), then raised here. The reset's own rounds and the
    transport's collectives are bounded by the timeout."""
    try:
        timeout = check_timeout(timeout_s)
    except (TypeError, ValueError) as e:
        _refuse_reset(runner, e)
        raise
    with bounded(runner.comm, runner.config.timeout_s if timeout is None else timeout):
        runner.reset(timeout)


def _refuse_reset(runner: Runner, error: BaseException) -> None:
    if runner.world == 1 or runner.closed:
        return
    refusal = {"refused": f"{type(error).__name__}: {error}"}
    try:
        runner.resets.meet(refusal, runner.config.timeout_s, what="reset")
    except CPIndexError as e:
        add_note(error, f"telling the other ranks failed too: {type(e).__name__}: {e}")
