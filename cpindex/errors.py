"""Exceptions raised by cpindex."""

from __future__ import annotations


class CPIndexError(RuntimeError):
    """Base class of cpindex runtime failures (bad input raises ValueError/TypeError instead)."""


class TransportUnavailable(CPIndexError):
    """A transport cannot run here; the message says why and what would fix it."""


class PeerTimeoutError(CPIndexError):
    """A rank waited longer than ``config.timeout_s`` for a peer (``peer``; -1 when the
    backend cannot tell), in call ``call`` at ``phase``.

    From then on the instance refuses calls on this rank (:class:`BrokenInstanceError`, caused
    by this error) until every rank calls :meth:`cpindex.IndexCP.reset`.
    """

    def __init__(self, message: str, *, rank: int, peer: int, call: int, phase: str) -> None:
        super().__init__(message)
        self.rank, self.peer, self.call, self.phase = rank, peer, call, phase


class OutOfStepError(CPIndexError):
    """Ranks paired calls that are not the same call (another tag, shape, forcing counts or
    configuration, other block-table entries or lengths, or ranks sharing a head with other
    queries), or a peer refused its call: every rank raises instead of exchanging or returning
    the wrong data. The instance refuses further calls until :meth:`cpindex.IndexCP.reset`."""

    def __init__(self, message: str, *, rank: int, peer: int, call: int) -> None:
        super().__init__(message)
        self.rank, self.peer, self.call = rank, peer, call


class PeerConnectionError(CPIndexError):
    """The backend lost its connection to a peer (its process died, or the network dropped)
    or to the group's key-value store: the message carries the backend's own error and names
    the rank whose process is gone where that shows on this machine (``peer``), else the rank
    whose process serves the store (``peer``; -1 when there is none). Not a timeout: it is
    raised as soon as the backend reports it (a dead peer on this machine is also named when a
    wait for it runs out). The instance refuses calls until :meth:`cpindex.IndexCP.reset`,
    which fails too while the peer is gone."""

    def __init__(self, message: str, *, rank: int, call: int, phase: str, peer: int = -1) -> None:
        super().__init__(message)
        self.rank, self.call, self.phase, self.peer = rank, call, phase, peer


class BrokenInstanceError(CPIndexError):
    """A call on an instance whose earlier call failed on this rank. Ranks may be out of step,
    so no call runs until every rank calls :meth:`cpindex.IndexCP.reset`; ``__cause__`` is the
    original error."""


class ConfigMismatchError(CPIndexError):
    """Ranks built one instance from configurations that differ in a field every rank must
    share (``CPIndexConfig.LOCAL_FIELDS`` are exempt), or would pick different transports. The
    message names each field and every rank's value; every rank raises."""


class BadBlockTableError(CPIndexError):
    """``block_table`` named a page outside the index cache (the score was written as NaN)."""


class BadSlotError(CPIndexError, ValueError):
    """A GPU :func:`cpindex.formats.write_keys` met a slot at or past the cache's ``pages *
    128`` slots: that key was skipped, the others were written. Raised by
    :func:`cpindex.formats.check_writes` (the CPU writer raises ``ValueError`` before writing)."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` so that its traceback shows it.

    ``BaseException.add_note`` exists from Python 3.11; on 3.10 the note is appended to the
    message (the first argument) instead, or becomes one when there is none.
    """
    native = getattr(exc, "add_note", None)
    if callable(native):
        native(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
    else:
        exc.args = (*exc.args, note)
