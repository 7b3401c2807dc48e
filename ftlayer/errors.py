"""Every error ftlayer raises on purpose, one class per reason.

Each message names the problem and the value that caused it, so a user can act on it
without reading the source. Every class but FailException is an FTLayerError. The
server answers the wire's own errors (`ftlayer.wire.ProtocolError`) with their code, a
StorageError with ERROR 101 (STORAGE) and any other FTLayerError with ERROR 102 (REJECTED:
nothing was applied).
"""

from __future__ import annotations


class FTLayerError(Exception):
    """Base class of ftlayer's own errors."""


class ConfigError(FTLayerError, ValueError):
    """A setting or argument is invalid (non-positive timeout, too few buckets, ...)."""


class StateConflict(FTLayerError, ValueError):
    """A request conflicts with the current state (a root already pending or recently
    failed, a savepoint already being written, a name already taken, ...); nothing changed."""


class CorruptData(FTLayerError, ValueError):
    """Data read back (a snapshot, a manifest, a stored or peer's JSON document) is malformed."""


class PositionError(FTLayerError, ValueError):
    """A position (or a map of Kafka offsets) is not of the documented form."""


class StorageError(FTLayerError):
    """The persistence storage cannot do what was asked; nothing was written."""


class NotAnLmdbEnvironment(StorageError):
    """A directory given as an LMDB environment is not one (and was left untouched)."""


class PartitioningError(FTLayerError, ValueError):
    """A record cannot be replayed by the chosen partitioner (unknown name, no key, ...)."""


class TaskOutputError(FTLayerError, ValueError):
    """User code returned output that breaks its task's contract (row count, parents, flags)."""


class OutputSchemaError(TaskOutputError):
    """User code returned rows that do not fit its declared output schema: a column is
    missing, or holds a value of another type. The message names the column."""


class FailException(Exception):
    """Raised by user code to fail the record being processed: its whole tree is replayed.

    Only that record's tree fails; the rest of the micro-batch goes on.
    """


class SourceError(FTLayerError):
    """The ftkafka source cannot reach Kafka or the FT layer (after its retries), cannot
    read an offset range in time, or found Kafka or the FT layer behind its offsets."""
