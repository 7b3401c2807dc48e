"""Barrier checkpoints and savepoints: the `CheckpointCoordinator` (a checkpoint at every
micro-batch boundary, with a journal base when one is due; completion by mode; the group
offsets a checkpoint allows) and savepoints (`ftlayer.checkpoint.savepoint`)."""

from ftlayer.core.statecodec import decode_snapshot, encode_snapshot

from .coordinator import (
    CHECKPOINT_PREFIX,
    CHECKPOINT_STORE_DIR,
    MAX_QUERY_CHARS,
    SNAPSHOT_PREFIX,
    Checkpoint,
    CheckpointCoordinator,
    CheckpointMode,
    CheckpointState,
    check_position,
    check_query,
)

__all__ = [
    "CHECKPOINT_PREFIX",
    "CHECKPOINT_STORE_DIR",
    "MAX_QUERY_CHARS",
    "SNAPSHOT_PREFIX",
    "Checkpoint",
    "CheckpointCoordinator",
    "CheckpointMode",
    "CheckpointState",
    "check_position",
    "check_query",
    "decode_snapshot",
    "encode_snapshot",
]
