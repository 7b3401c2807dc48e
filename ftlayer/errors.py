"""Every error ftlayer raises on purpose, one class per reason.

Each message names the problem and the value that caused it, so a user can act on it
without reading the source.
"""

from __future__ import annotations


class FTLayerError(Exception):
    """Base class of ftlayer's own errors."""


class ConfigError(FTLayerError, ValueError):
    """A setting or argument is invalid (non-positive timeout, too few buckets, ...)."""


class StorageError(FTLayerError):
    """The persistence storage cannot do what was asked; nothing was written."""


class NotAnLmdbEnvironment(StorageError):
    """A directory given as an LMDB environment is not one (and was left untouched)."""


class PartitioningError(FTLayerError, ValueError):
    """A record cannot be replayed by the chosen partitioner (unknown name, no key, ...)."""


class FailException(Exception):
    """Raised by user code to fail the record being processed: its whole tree is replayed.

    Only that record's tree fails; the rest of the micro-batch goes on.
    """


class SourceError(FTLayerError):
    """The ftkafka source cannot reach Kafka or the FT layer (after its retries), cannot
    read an offset range in time, or found Kafka or the FT layer behind its offsets."""
