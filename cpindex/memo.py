"""Small caches for the per-call host path (docs/design.md, "The host path").

An eager call repeats the same Python work every time: the same checks of tensors whose
metadata has not changed, the same views of the same buffers. Two caches take that off the hot
path without ever answering for a tensor they have not seen:

* :class:`Memo`, values keyed by plain metadata tuples (:func:`check_key`). It holds no tensor,
  so it keeps no memory alive, and a key describes everything its value depends on: a tensor
  freed and its address reused by another with other metadata has another key.
* :class:`PerTensor`, values derived from one tensor object (views of its storage), dropped when
  that object is collected and recomputed whenever its metadata (:func:`view_key`) differs from
  what it was when they were made (``set_``, ``resize_`` and friends change a tensor in place).

A call reads a tensor's metadata once: a check keyed by :func:`view_key` (the cache's, whose
address is the same call after call) hands that key on to the launch, whose views of the same
tensor look it up without reading the metadata again (:meth:`PerTensor.get`'s ``key``).

Both are bounded: once full they start over, so a caller whose shapes never repeat pays a
dictionary insert per call, never unbounded memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")

#: Entries a cache holds before it starts over (a decode loop needs a few per shape).
DEFAULT_CAPACITY = 256


def check_key(t: Any) -> tuple:
    """What a host-side check of tensor ``t`` may depend on: its type, dtype, shape, strides,
    device and where its data starts relative to a 16-byte boundary (the kernel's alignment).
    Raises for what has none of these (a non-tensor, a strided nested tensor, a sparse one):
    callers then run the full check, which reports it."""
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() & 15)


def view_key(t: Any) -> tuple:
    """:func:`check_key` with the whole address: everything a check of ``t`` reads and
    everything a view of its storage depends on (the address stands for storage and offset: a
    live storage owns its addresses). Raises as :func:`check_key` does."""
    return (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr())


class Memo(dict[Hashable, V]):
    """A bounded mapping from hashable keys to values (verdicts, parameter images, views of
    buffers the owner holds): a dict, so that lookups cost what a dict's cost, whose
    :meth:`put` starts over when full."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Hashable, value: V) -> V:
        """Store and return ``value``."""
        if len(self) >= self.capacity:
            self.clear()
        self[key] = value
        return value


class PerTensor(Generic[V]):
    """Values derived from tensor objects, keyed by the object itself (weakly).

    :meth:`get` returns a value only for the very object it was stored for (not one that took
    its ``id`` after it was collected) and only while :func:`view_key` of that object still
    equals what it was at :meth:`put`. An entry goes away with its tensor object, so a stored
    view keeps memory alive no longer than the caller's own tensor does."""

    __slots__ = ("_data", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        # id -> (weak reference, view_key at put, value)
        self._data: dict[int, tuple[weakref.ref, tuple, V]] = {}
        self.capacity = capacity

    def get(self, t: torch.Tensor, key: tuple | None = None) -> V | None:
        """The value stored for ``t``, or None. ``key``: ``view_key(t)`` as the caller just
        read it (saves reading it again)."""
        entry = self._data.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        if entry[1] != (view_key(t) if key is None else key):
            return None
        return entry[2]

    def put(self, t: torch.Tensor, value: V, key: tuple | None = None) -> V:
        data = self._data
        if len(data) >= self.capacity:
            data.clear()
        slot = id(t)
        meta = view_key(t) if key is None else key
        data[slot] = (weakref.ref(t, _dropper(data, slot)), meta, value)
        return value

    def __len__(self) -> int:
        return len(self._data)


def _dropper(data: dict, key: int) -> Callable[[weakref.ref], None]:
    """The callback that removes ``data[key]`` once its tensor is collected (unless the slot
    was taken over since by another object with that id). Made once per stored entry."""

    def drop(ref: weakref.ref) -> None:
        entry = data.get(key)
        if entry is not None and entry[0] is ref:
            data.pop(key, None)  # pop: another thread may have cleared it meanwhile

    return drop
