"""Pluggable transports: every module here registers one implementation of the ``score_push``
contract (see :mod:`.base`)."""

from . import collective, ipc, mori  # noqa: F401  (registration)
from .base import REGISTRY, Context, Transport, candidates, select

__all__ = ["REGISTRY", "Context", "Transport", "candidates", "select"]
