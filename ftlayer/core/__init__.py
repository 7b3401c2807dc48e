"""The FT-layer core: the FTLayer verbs (persist, xor, fail, tick, fetch_replay) over
the acker table, the timeout persistence layer, the replay queue, the retired roots and
the source registry. `ftlayer.core.layer` opens with the contract."""

from .layer import CompletionListener, FTLayer, PersistTicket
from .replay import REPLAY_SEQ_META_KEY, ReplayQueue
from .retired import RetiredRoots
from .sources import SOURCES_META_KEY, SourceConfig, SourceRegistry
from .stats import FailCause, FTStats

__all__ = [
    "REPLAY_SEQ_META_KEY",
    "SOURCES_META_KEY",
    "CompletionListener",
    "FTLayer",
    "FTStats",
    "FailCause",
    "PersistTicket",
    "ReplayQueue",
    "RetiredRoots",
    "SourceConfig",
    "SourceRegistry",
]
