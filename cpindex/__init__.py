"""cpindex: context-parallel decode block scoring for MiniMax-M3 sparse attention.

``IndexCP(config, group).score_push(...)`` returns this rank's heads' scores over every block,
each rank having scanned only its 1/W share of the index-key cache. See README.md.
"""

from .api import IndexCP, get, init, shutdown
from .config import CPIndexConfig
from .errors import (
    BadBlockTableError,
    BadSlotError,
    BrokenInstanceError,
    ConfigMismatchError,
    CPIndexError,
    OutOfStepError,
    PeerConnectionError,
    PeerTimeoutError,
    TransportUnavailable,
)
from .plan import Plan

__version__ = "0.1.0"

__all__ = [
    "BadBlockTableError",
    "BadSlotError",
    "BrokenInstanceError",
    "CPIndexConfig",
    "CPIndexError",
    "ConfigMismatchError",
    "IndexCP",
    "OutOfStepError",
    "PeerConnectionError",
    "PeerTimeoutError",
    "Plan",
    "TransportUnavailable",
    "get",
    "init",
    "shutdown",
]
