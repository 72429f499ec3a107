"""cpindex.errors.add_note: notes reach the traceback on every supported Python."""

from __future__ import annotations

import sys

import pytest

from cpindex.errors import PeerTimeoutError, add_note


@pytest.mark.skipif(sys.version_info < (3, 11), reason="BaseException.add_note is 3.11+")
def test_add_note_uses_the_native_notes():
    e = RuntimeError("first")
    add_note(e, "second")
    assert e.__notes__ == ["second"] and str(e) == "first"


class _NoNotes(RuntimeError):
    add_note = None  # as on Python 3.10, where BaseException has no add_note


def test_add_note_falls_back_to_the_message():
    e = _NoNotes("first")
    add_note(e, "second")
    assert str(e) == "first\nsecond"
    bare = _NoNotes()
    add_note(bare, "only")
    assert str(bare) == "only"


def test_add_note_keeps_the_fields_of_a_peer_timeout():
    e = PeerTimeoutError("late", rank=0, peer=1, call=7, phase="scores")
    add_note(e, "rank 1 failed too")
    assert (e.rank, e.peer, e.call, e.phase) == (0, 1, 7, "scores")
    assert "rank 1 failed too" in str(e) + "".join(getattr(e, "__notes__", []))
