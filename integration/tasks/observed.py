"""A step's own figures in Spark's progress: `FTTasks(settings, observe=True)`.

A step fails a record inside its mapInArrow and drops its row, so no observation
downstream in the plan can count it (integration.observe). An observed step counts
its partition itself and hands the counts to Spark through the plan:

    df -> mapInArrow(runner + one summary row per partition)
       -> observe(name, sums of the summary rows)
       -> where(summary is null) -> drop(summary)

1. The runner's output batches leave with one more column, `ft_step_summary` (null).
2. After its last output batch the partition yields ONE summary row: the step's
   columns hold placeholders, `ft_step_summary` the partition's counts.
3. `observe(name, ...)` sums the summary rows of the micro-batch; Spark reports the
   sums in that batch's progress, `lastProgress["observedMetrics"][name]` (and to
   every StreamingQueryListener), as `records` (the step's input rows), `outputs`
   (the rows it emitted), `failed` (input rows it failed) and `failed` by cause kind
   (ftlayer.causes.FailKind): `explicit` (a FailException, or a `TaskOutput.failed`
   mask) and `error` (another exception of the user code under on_error="fail-record",
   an OutputSchemaError included).
4. `where` drops the summary rows and `drop` the column: the step's DataFrame has its
   usual columns and rows.

Only successful task attempts count: a partition yields its summary row after its
last output, and Spark merges a task's observed aggregates only when the task succeeds
(tests/integration/test_sink_progress.py), so a retried task counts once. A failed
row here is a failed input row; a single-anchored row is one root, so with FT on the
failures of a batch's steps are the FT layer's fail events from its tasks (the
`explicit` count of `ftlayer status`, which counts every kind), and their replays come
back in later batches. With FT off the counts are the records dropped (and an
observed aggregate of a static DataFrame runs through ftlayer's aggregate runner, not
Spark's applyInArrow, which has no end-of-partition hook for the summary row).

Schema. A summary row has no values of its own in the step's columns: a nullable
column holds null, a non-nullable column of a scalar type (numbers, booleans, strings,
binary, dates and times, decimals; `ft_root` and `ft_id` among them) a placeholder
(0, false, empty), and a non-nullable column of a nested type (struct, array, map)
becomes nullable, since nothing fits it. The placeholder rows never leave the step.

Names: `ftlayer.step.<kind>(<function>)` (e.g. `ftlayer.step.map(parse)`), with `#2`,
`#3`, ... for the same function again in one FTTasks, or the step's `observe="name"`
as given. Spark requires the names of a query's observations to differ: a duplicate
raises ConfigError when the step is built.

Cost: one more null column per output batch, one row per partition, and one
aggregation per batch over rows Spark computes anyway; `ftlayer bench pipeline
--observe` measures it with the tasks observed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa
from pyspark.sql.types import LongType, StructField, StructType

from ftlayer.errors import ConfigError
from ftlayer.integration.sinkhold import named_task

from .results import Failures

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["COUNTS", "SUMMARY_COLUMN", "StepTally", "observed_step", "step_name"]

SUMMARY_COLUMN: Final = "ft_step_summary"
COUNTS: Final = ("records", "outputs", "failed", "explicit", "error")
"""The counts of a summary row, and the metrics observed (in this order)."""
_SUMMARY_ARROW: Final = pa.struct([pa.field(c, pa.int64(), nullable=False) for c in COUNTS])
_SUMMARY_TYPE: Final = StructType([StructField(c, LongType(), False) for c in COUNTS])

Runner = Callable[[Iterator[Any]], Iterator[Any]]


class StepTally:
    """One partition's counts (executor side). The runner gives the partition's
    `Failures` to every call of the step: `counting` keeps it, so the counts by cause
    are the runner's own (`Failures.count` and `.explicit`); `failures` is a factory
    for runners that make it themselves (aggregate)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.kept: Failures | None = None
        self.records = 0
        self.outputs = 0

    def counting(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def counted(payload: Any, failures: Failures) -> Any:
            self.kept = failures
            return step(payload, failures)

        return counted

    def failures(self, what: str) -> Failures:
        self.kept = Failures(what)
        return self.kept

    def summary(self) -> dict[str, int]:
        failed = self.kept.count if self.kept else 0
        explicit = self.kept.explicit if self.kept else 0
        return {
            "records": self.records,
            "outputs": self.outputs,
            "failed": failed,
            "explicit": explicit,
            "error": failed - explicit,
        }


def step_name(kind: str, fn: Callable[..., Any], used: dict[str, int]) -> str:
    """The default name of a step's observation, unique among the names in `used`."""
    base = f"ftlayer.step.{kind}({getattr(fn, '__name__', type(fn).__name__)})"
    used[base] = used.get(base, 0) + 1
    return base if used[base] == 1 else f"{base}#{used[base]}"


def observed_step(
    df: DataFrame, run: Runner, tally: StepTally, out_struct: StructType, name: str, timezone: str
) -> DataFrame:
    """`df.mapInArrow(run, out_struct)` with the partitions' counts observed under
    `name` (module docstring); `run`'s step counts into `tally`."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema

    if SUMMARY_COLUMN in out_struct.fieldNames():
        raise ConfigError(f"an observed step's output must not have a {SUMMARY_COLUMN} column")
    arrow = to_arrow_schema(out_struct, timezone=timezone)
    placeholders = [None if f.nullable else _placeholder(f.type) for f in arrow]
    struct = StructType(
        [
            StructField(f.name, f.dataType, f.nullable or p is None, f.metadata)
            for f, p in zip(out_struct.fields, placeholders, strict=True)
        ]
        + [StructField(SUMMARY_COLUMN, _SUMMARY_TYPE, True)]
    )
    summarised = df.mapInArrow(
        named_task(
            _summarised(run, tally, to_arrow_schema(struct, timezone=timezone), placeholders)
        ),
        struct,
    )
    metrics = [
        F.coalesce(F.sum(F.col(SUMMARY_COLUMN).getField(c)), F.lit(0)).alias(c) for c in COUNTS
    ]
    try:
        observed = summarised.observe(name, *metrics)
    except AnalysisException as exc:
        if exc.getCondition() != "DUPLICATED_METRICS_NAME":
            raise
        raise ConfigError(
            f"observed step {name!r}: the query already observes a metric of that name; "
            "give the step its own name with observe='...'"
        ) from exc
    return observed.where(F.col(SUMMARY_COLUMN).isNull()).drop(SUMMARY_COLUMN)


def _placeholder(arrow_type: Any) -> Any | None:
    """One value of a scalar type (0, false, empty), or None for a nested type."""
    if pa.types.is_nested(arrow_type):
        return None
    if pa.types.is_decimal(arrow_type):
        return pa.array([Decimal(0)], arrow_type)
    for source in (pa.array([""]), pa.array([0], pa.int32()), pa.array([0], pa.int64())):
        if pa.types.is_string(source.type) != _textual(arrow_type):
            continue
        try:
            return source.cast(arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    return None


def _textual(arrow_type: Any) -> bool:
    return any(
        check(arrow_type)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_binary,
            pa.types.is_large_binary,
        )
    )


def _summarised(run: Runner, tally: StepTally, schema: Any, placeholders: list[Any]) -> Runner:
    """The runner's batches with a null summary column, then one summary row."""

    def counted_inputs(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            tally.records += batch.num_rows
            yield batch

    def summarised(batches: Iterator[Any]) -> Iterator[Any]:
        tally.reset()  # a worker may run several tasks, one after another
        for out in run(counted_inputs(batches)):
            tally.outputs += out.num_rows
            nulls = pa.nulls(out.num_rows, _SUMMARY_ARROW)
            yield pa.RecordBatch.from_arrays([*out.columns, nulls], schema=schema)
        columns = [
            pa.nulls(1, field.type) if p is None else p
            for field, p in zip(schema, placeholders, strict=False)
        ]
        summary = pa.array([tally.summary()], _SUMMARY_ARROW)
        yield pa.RecordBatch.from_arrays([*columns, summary], schema=schema)

    return summarised
