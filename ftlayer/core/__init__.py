"""The FT-layer core: `FTLayer` (ftlayer.core.layer, which opens with the contract), a
facade over one `CoreState` (ftlayer.core.state, which lists the rooms its verbs live
in) over the acker table, the persistence layer, the timeouts, the replay queue, the
retry book, the retired roots, the holds and the source registry."""

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
