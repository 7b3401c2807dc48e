"""The FT columns of a task's rows and the anchors they carry: `ft_root` and `ft_id`
(one pair per row; a barrier-mode row has `ft_root` only, its record id being 0), and
for a multi-anchored row (an aggregate's output) the extra pairs in `ft_extra_anchors`.
`read_anchors` reads them as an Anchors batch without a Python object per row;
`anchor_columns` writes them back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray
from pyspark.sql.types import (
    ArrayType,
    LongType,
    StructField,
    StructType,
)

from ftlayer.acking.handlers import Anchors
from ftlayer.errors import ConfigError
from ftlayer.integration.ftcolumns import (
    FT_COLUMNS,
    ID_COLUMN,
    REPLAY_COLUMN,
    ROOT_COLUMN,
    to_signed,
    to_unsigned,
)

EXTRA_ANCHORS_COLUMN: Final = "ft_extra_anchors"
EXTRA_ANCHORS_TYPE: Final = ArrayType(
    StructType([StructField("root", LongType(), False), StructField("id", LongType(), False)]),
    containsNull=False,
)
ALL_FT_COLUMNS: Final = (*FT_COLUMNS, EXTRA_ANCHORS_COLUMN, REPLAY_COLUMN)

_PAIR_ARROW: Final = pa.struct(
    [pa.field("root", pa.int64(), nullable=False), pa.field("id", pa.int64(), nullable=False)]
)
_EXTRA_ARROW: Final = pa.list_(pa.field("element", _PAIR_ARROW, nullable=False))


# ---- FT columns ---------------------------------------------------------------------


def ft_columns_of(names: Iterable[str]) -> tuple[str, ...]:
    """The FT columns among `names`, in ALL_FT_COLUMNS order."""
    present = set(names)
    return tuple(c for c in ALL_FT_COLUMNS if c in present)


def _ids(batch: Any, name: str) -> NDArray[np.uint64]:
    column = batch.column(name)
    if column.null_count:
        raise ConfigError(f"{column.null_count} rows have a null {name}: every FT row needs one")
    return to_unsigned(column.to_numpy(zero_copy_only=False))


def read_anchors(batch: Any) -> Anchors:
    """The anchors of an Arrow batch's rows: (ft_root, ft_id), then ft_extra_anchors;
    record id 0 where there is no ft_id (barrier mode)."""
    roots = _ids(batch, ROOT_COLUMN)
    if ID_COLUMN in batch.schema.names:
        ids = _ids(batch, ID_COLUMN)
    else:
        ids = np.zeros(len(roots), dtype=np.uint64)
    if EXTRA_ANCHORS_COLUMN not in batch.schema.names:
        return Anchors.single(roots, ids)
    extra = batch.column(EXTRA_ANCHORS_COLUMN)
    lengths = pc.fill_null(pc.list_value_length(extra), 0).to_numpy(zero_copy_only=False)
    if not lengths.any():
        return Anchors.single(roots, ids)
    extra_roots, extra_ids = (
        to_unsigned(child.to_numpy(zero_copy_only=False)) for child in extra.flatten().flatten()
    )
    offsets = np.zeros(len(roots) + 1, dtype=np.int64)
    np.cumsum(lengths + 1, out=offsets[1:])
    first = offsets[:-1]
    is_extra = np.ones(int(offsets[-1]), dtype=np.bool_)
    is_extra[first] = False
    all_roots = np.empty(len(is_extra), dtype=np.uint64)
    all_ids = np.empty(len(is_extra), dtype=np.uint64)
    all_roots[first], all_ids[first] = roots, ids
    all_roots[is_extra], all_ids[is_extra] = extra_roots, extra_ids
    return Anchors(offsets, all_roots, all_ids)


def anchor_columns(anchors: Anchors, multi: bool, ids: bool = True) -> list[Any]:
    """The FT columns (Arrow arrays) for rows with these anchors: ft_root, ft_id (not
    with `ids` False: rows of barrier mode, whose ids are 0), and with `multi`
    ft_extra_anchors. Every row needs at least one anchor."""
    n = len(anchors)
    counts = np.diff(anchors.offsets)
    # Paranoid check: an output without anchors would never be acked or failed.
    if n and int(counts.min()) < 1:
        raise AssertionError("an output row has no anchor")
    first = anchors.offsets[:-1]
    columns = [pa.array(to_signed(anchors.roots[first]), type=pa.int64())]
    if ids:
        columns.append(pa.array(to_signed(anchors.ids[first]), type=pa.int64()))
    if multi:
        is_extra = np.ones(len(anchors.roots), dtype=np.bool_)
        is_extra[first] = False
        pairs = pa.StructArray.from_arrays(
            [
                pa.array(to_signed(anchors.roots[is_extra]), type=pa.int64()),
                pa.array(to_signed(anchors.ids[is_extra]), type=pa.int64()),
            ],
            fields=list(_PAIR_ARROW),
        )
        list_offsets = pa.array(anchors.offsets - np.arange(n + 1), type=pa.int32())
        columns.append(pa.ListArray.from_arrays(list_offsets, pairs, type=_EXTRA_ARROW))
    elif len(anchors.roots) != n:
        raise AssertionError("a single-anchored output got several anchors")
    return columns
