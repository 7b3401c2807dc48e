"""Task wrappers: map, flat_map, filter and per-key aggregation under fault tolerance.

`FTTasks(settings)` wraps user code around DataFrames. Every wrapper runs on Arrow
batches (`DataFrame.mapInArrow`); the FT work for a batch is a handful of numpy
operations, never a Python object per record:

1. Read the inputs' anchors from their FT columns (`read_anchors`).
2. Run the user code. Per-record forms (`map`, `flat_map`, `filter`) call it once per
   record with a dict of the payload columns; batch forms (`map_batches`,
   `filter_batches`) call it once per Arrow batch. Either way the result is the output
   rows plus `parents`, the index of the input each output row came from, and a
   `failed` mask over the inputs.
3. `TaskHandler.process(inputs, parents, failed)` draws a fresh id for every output,
   gives it its anchors, and buffers one combined XOR event per input and root (the
   input's id XOR its outputs' ids, as Storm does). Failed inputs send a fail for
   their roots instead, and none of their outputs is emitted. The wrappers' handler
   hands ids over (`hand_over`): an input with one anchor and exactly one output
   gives that output its own id and sends no event (the id stays outstanding until
   the output is acked, as the pair of events would have left it). A map with one
   output per input and a filter, when nothing failed, skip `process` altogether
   (`TaskHandler.pass_through`): their rows keep their FT columns as they are, and
   only a filter's dropped rows of a tree send an event (their ack). In barrier mode
   no step sends XOR events at all.
4. The outputs leave with FT columns: their root and id.
5. At the end of the partition (the end of the mapInArrow iterator) the events go to
   the process's shared `BatchingChannel` and are flushed, so a partition's events
   are on their way when its task ends. Events are kept in the task until then (up to
   65,536 of them), so a task that fails and is retried by Spark has usually sent
   nothing: the retry completes the trees. When a partition is larger, or a retry
   follows a partial flush, the first attempt's events leave the trees unbalanced:
   they time out and are replayed (a duplicate, never a loss).

Errors in user code, per record:

- `FailException` fails only that record's tree: its roots fail and are replayed, its
  outputs (if any) are dropped, the rest of the batch goes on.
- Any other exception: `on_error="fail-record"` (default) treats it like a
  FailException and logs it; `on_error="fail-task"` lets it propagate, so Spark fails
  the task and retries it (`local[N,F]` and clusters retry F times), and the query
  stops if every attempt fails.
- In a batch form, an exception fails every record of the batch the same way; the
  batch function can instead fail single records by returning a `TaskOutput` with a
  `failed` mask.
- Output rows that do not fit the declared schema (a missing column, a value of
  another type) raise `OutputSchemaError`, naming the step, the column and the value,
  and count as an exception of the user code: under fail-record only the records whose
  output does not fit fail. A per-record function must return a dict (or a Row) with
  every declared column: pyarrow would read a missing key as null. A float with a
  fraction for an integer column does not fit either (pyarrow would truncate it).

One computation, one consumer. Every computation of a wrapper draws fresh ids for
its outputs and sends the events for its inputs, and every wrapper or sink that reads
a row consumes its id. So an FT DataFrame must be computed once (`ft_foreach_batch`
caches the micro-batch for that and `ft_kafka_sink` runs one job; persist a DataFrame
yourself before two actions on it) and each
row must reach exactly one consumer. To branch, persist the parent and route its rows
with plain `where` predicates that send each row to exactly one branch. A row read by
two wrappers, or computed twice, leaves its tree unbalanced: it times out and is
replayed, and since the replay takes the same path, it is replayed again, for ever.
A plain Spark `where` that drops rows does not ack them either: use `filter`.

Multi-anchored rows. An aggregate derived from many inputs carries one anchor per
input (its new id under each input's root; see `TaskHandler.process_grouped`). Such a
row keeps `ft_root`/`ft_id` for its first anchor and holds the others in
`ft_extra_anchors` (EXTRA_ANCHORS_COLUMN), an `array<struct<root: long, id: long>>`
with the same signed-int64 bits as the FT columns. A row's anchors are therefore
`[(ft_root, ft_id)] + ft_extra_anchors`; a null or empty list means the row has one
anchor, so a single-anchored DataFrame unions with a multi-anchored one after adding
`F.lit(None).cast(EXTRA_ANCHORS_TYPE)`. Every wrapper here and every sink reads it;
a wrapper whose input has the column keeps it in its output (a map over aggregates
gives rows anchored to every root of their aggregate). Dropping the column (a plain
`select`) leaves the extra anchors unacked: their trees time out and are replayed.

Aggregation (`aggregate`): rows are hash-partitioned by the group keys and sorted
within partitions (what `groupBy().applyInArrow` does too), then one mapInArrow pass
finds the groups, calls the user function once per group with the group's key and
rows as a `pyarrow.Table`, and anchors each output row to every input of its group
with one `process_grouped` call per Arrow batch. Unlike applyInArrow, which calls the
function per group with no end-of-partition hook, this flushes at the end of each
partition like the other wrappers. A group function that returns several rows (or
none) gets them anchored by a second `process` over the group's combined anchors.

Fused steps. A map or filter wrapper (`map`, `flat_map`, `filter`, `map_batches`,
`filter_batches`) applied directly to the DataFrame another one returned runs in the
same `mapInArrow` as it: one Python worker runs both runners, one after the other, on
each Arrow batch, as Spark fuses chained Python UDFs. Each runner keeps its own
handler, failure counts and end-of-partition flush, so rows, events and errors are
those of two separate steps; what goes is a hop through the JVM per step (the rows
to Arrow, into Spark, back to Arrow: about 1.6 µs per small record on the development
machine, as much as the source's whole read). Anything in between (a plain Spark
operator, an observed step, `cache()` of the first result) ends the chain; the first
result stays usable on its own. The Spark UI and `explain()` then show one
MapInArrow for the chain. `FTTasks(settings, fuse=False)` keeps one per step.

Observed steps (`FTTasks(settings, observe=True)`, or `observe=` per step): each
step's records, outputs and failed records by cause (explicit, error) in every
micro-batch's StreamingQueryProgress, `observedMetrics["ftlayer.step.map(parse)"]`;
see integration.tasks.observed for how, the names and the schema (a non-nullable
nested column becomes nullable). Off by default, and then the plans are unchanged.

FT off (`FTSettings(enabled=False)`): the same user code runs through the same
runners with the null handler (NoFTTaskHandler: no FT columns, no ids, no connection);
an aggregate of a static DataFrame uses Spark's own groupBy().applyInArrow. A record
whose code raises FailException, or any exception under `fail-record`, is dropped and
logged: without the FT layer there is nothing to replay it from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast, get_args

import numpy as np
from numpy.typing import NDArray
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    DataType,
    LongType,
    MapType,
    StructField,
    StructType,
)

from ftlayer.errors import ConfigError
from ftlayer.integration.anchors import (
    ALL_FT_COLUMNS,
    EXTRA_ANCHORS_COLUMN,
    EXTRA_ANCHORS_TYPE,
    anchor_columns,
    ft_columns_of,
    read_anchors,
)
from ftlayer.integration.ftcolumns import (
    ID_COLUMN,
    ROOT_COLUMN,
    FTSettings,
    completes_at_barrier,
    missing_ft_columns,
)
from ftlayer.integration.sinkhold import holding, named_task

from .aggregate import aggregate_partition, plain_group_fn
from .observed import StepTally, observed_step, step_name
from .results import (
    Failures,
    GroupKey,
    OnError,
    OutputSchemaError,
    Row,
    Schema,
    TaskOutput,
    run_batch_fn,
    run_batch_predicate,
    run_predicate,
    run_record_fn,
)
from .runners import Step, filter_partition, map_partition

Observe = bool | str | None
"""A step's `observe`: None follows FTTasks(observe=...); True observes the step under
its default name, a string under that name; False does not observe it."""

__all__ = [
    "ALL_FT_COLUMNS",
    "EXTRA_ANCHORS_COLUMN",
    "EXTRA_ANCHORS_TYPE",
    "FTTasks",
    "OnError",
    "OutputSchemaError",
    "TaskOutput",
    "anchor_columns",
    "ft_columns_of",
    "read_anchors",
]


# ---- the public API (driver side) ----------------------------------------------------------


class FTTasks:
    """Task wrappers for one FT layer; see the module docstring.

    `on_error` is the default for every wrapper ("fail-record" or "fail-task"); each
    method can override it. Schemas are StructType or DDL strings and name the
    payload columns only: the wrappers add the FT columns. `fuse` (default on): a map or
    filter step applied directly to another's result runs in the same mapInArrow (see
    "Fused steps" in the module docstring).
    """

    def __init__(
        self,
        settings: FTSettings,
        *,
        on_error: OnError = "fail-record",
        observe: bool = False,
        fuse: bool = True,
    ) -> None:
        self.settings = settings
        self.on_error = _check_on_error(on_error)
        self.observe = observe
        self.fuse = fuse
        self._observed: dict[str, int] = {}

    @property
    def ft(self) -> bool:
        return self.settings.enabled

    # ---- per record ----

    def map(
        self,
        df: DataFrame,
        fn: Callable[[Row], Row],
        schema: Schema,
        *,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """One output row (a dict of `schema`'s columns) per input row (a dict)."""
        what = _step("map", fn)
        named = self._observed_as(observe, "map", fn)
        return self._records(df, lambda row: (fn(row),), schema, on_error, what, named)

    def flat_map(
        self,
        df: DataFrame,
        fn: Callable[[Row], Iterable[Row]],
        schema: Schema,
        *,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """Zero or more output rows per input row; all of a record's outputs are emitted,
        or (when it fails, even midway) none."""
        named = self._observed_as(observe, "flat_map", fn)
        return self._records(df, fn, schema, on_error, _step("flat_map", fn), named)

    def filter(
        self,
        df: DataFrame,
        predicate: Callable[[Row], bool],
        *,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """Keep the rows the predicate is true for; a dropped row's tree is acked."""
        mode = self._mode(on_error)

        def decide(payload: Any, failures: Failures) -> Any:
            return run_predicate(predicate, payload, mode, failures)

        named = self._observed_as(observe, "filter", predicate)
        return self._filter(df, decide, _step("filter", predicate), named)

    # ---- per batch ----

    def map_batches(
        self,
        df: DataFrame,
        fn: Callable[[Any], Any],
        schema: Schema,
        *,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """fn(pyarrow.RecordBatch of the payload columns) returns a RecordBatch or Table
        with one row per input (a map), or a `TaskOutput` (anything else)."""
        mode = self._mode(on_error)
        payload_schema = self._payload_arrow(df, schema)

        def step(payload: Any, failures: Failures) -> Any:
            return run_batch_fn(fn, payload, payload_schema, mode, failures)

        named = self._observed_as(observe, "map_batches", fn)
        return self._mapped(df, step, schema, _step("map_batches", fn), named)

    def filter_batches(
        self,
        df: DataFrame,
        predicate: Callable[[Any], Any],
        *,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """predicate(pyarrow.RecordBatch) returns a boolean mask (numpy or pyarrow; null
        drops the row)."""
        mode = self._mode(on_error)

        def decide(payload: Any, failures: Failures) -> Any:
            return run_batch_predicate(predicate, payload, mode, failures)

        named = self._observed_as(observe, "filter_batches", predicate)
        return self._filter(df, decide, _step("filter_batches", predicate), named)

    # ---- grouped ----

    def aggregate(
        self,
        df: DataFrame,
        by: str | Sequence[str],
        fn: Callable[[GroupKey, Any], Any],
        schema: Schema,
        *,
        num_partitions: int | None = None,
        on_error: OnError | None = None,
        observe: Observe = None,
    ) -> DataFrame:
        """Per-key aggregation within a micro-batch, multi-anchored.

        fn(key, rows) gets the group key (a tuple of pyarrow scalars, as applyInArrow
        passes it) and the group's rows (a pyarrow.Table of the payload columns) and
        returns a Table or RecordBatch of `schema` (usually one row), or a `TaskOutput`
        whose `failed` mask fails single inputs of the group. Every output row is
        anchored to every (not failed) input of its group, so an input's tree completes
        only when the aggregate's tree does. FailException (or any exception under
        fail-record) fails every root of the group; other groups go on.
        `num_partitions`: how many partitions the rows are hash-partitioned into by key
        (default: spark.sql.shuffle.partitions).
        """
        mode = self._mode(on_error)
        named = self._observed_as(observe, "aggregate", fn)
        keys = [by] if isinstance(by, str) else list(by)
        self._check_keys(df, keys)
        payload_struct = _struct(df, schema)
        payload_schema = self._payload_arrow(df, payload_struct)
        self._check_ft_columns(df)
        # Hash-partitioned by the keys: groupBy adds no second shuffle on top of it.
        shuffled = df if num_partitions is None else df.repartition(num_partitions, *keys)
        # A streaming DataFrame can be neither sorted nor grouped by applyInArrow (Spark
        # refuses both outside stateful operators): each micro-batch partition is then
        # sorted by the keys in the task itself, in memory.
        local_sort = df.isStreaming
        if not self.ft and not local_sort and named is None:
            return shuffled.groupBy(*keys).applyInArrow(
                plain_group_fn(fn, payload_schema, mode), payload_struct
            )
        if num_partitions is None:
            shuffled = df.repartition(*keys)
        if not local_sort:
            shuffled = shuffled.sortWithinPartitions(*keys)
        out_struct = (
            _with_ft_fields(payload_struct, multi=True, like=df.schema)
            if self.ft
            else payload_struct
        )
        out_schema = self._arrow(df, out_struct)
        tally = StepTally() if named else None
        run = aggregate_partition(
            self.settings,
            keys,
            fn,
            payload_schema,
            out_schema,
            mode,
            local_sort=local_sort,
            failures=tally.failures if tally else Failures,
        )
        if named is None or tally is None:
            return shuffled.mapInArrow(named_task(run), out_struct)
        return observed_step(shuffled, run, tally, out_struct, named, self._timezone(df))

    # ---- plumbing ----

    def _mode(self, on_error: OnError | None) -> OnError:
        return self.on_error if on_error is None else _check_on_error(on_error)

    def _records(
        self,
        df: DataFrame,
        fn: Callable[[Row], Iterable[Row]],
        schema: Schema,
        on_error: OnError | None,
        what: str,
        named: str | None,
    ) -> DataFrame:
        mode = self._mode(on_error)
        payload_schema = self._payload_arrow(df, schema)

        def step(payload: Any, failures: Failures) -> Any:
            return run_record_fn(fn, payload, payload_schema, mode, failures, what)

        return self._mapped(df, step, schema, what, named)

    def _mapped(
        self, df: DataFrame, step: Step, schema: Schema, what: str, named: str | None
    ) -> DataFrame:
        payload_struct = _struct(df, schema)
        self._check_ft_columns(df)
        multi = EXTRA_ANCHORS_COLUMN in df.columns
        out_struct = (
            _with_ft_fields(payload_struct, multi, like=df.schema) if self.ft else payload_struct
        )
        out_schema = self._arrow(df, out_struct)
        if named is None:
            return self._chained(
                df, map_partition(self.settings, step, out_schema, multi, what), out_struct
            )
        tally = StepTally()
        run = map_partition(self.settings, tally.counting(step), out_schema, multi, what)
        return observed_step(df, run, tally, out_struct, named, self._timezone(df))

    def _filter(
        self,
        df: DataFrame,
        decide: Callable[[Any, Failures], tuple[NDArray[np.bool_], NDArray[np.bool_] | None]],
        what: str,
        named: str | None,
    ) -> DataFrame:
        self._check_ft_columns(df)
        if named is None:
            return self._chained(df, filter_partition(self.settings, decide, what), df.schema)
        tally = StepTally()
        run = filter_partition(self.settings, tally.counting(decide), what)
        return observed_step(df, run, tally, df.schema, named, self._timezone(df))

    def _chained(self, df: DataFrame, run: Runner, out_struct: StructType) -> DataFrame:
        """`df.mapInArrow(run, out_struct)`, or, when `df` is itself the DataFrame an
        unobserved map or filter step of an FTTasks returned (nothing in between, not
        cached) and `fuse` is on, one mapInArrow over that step's input that runs both
        steps' runners one after the other in the same Python worker. Each runner keeps
        its own handler, failures and end-of-partition flush, so the rows, the events
        and the errors are the same; what goes is a hop through the JVM (the rows
        serialized to Arrow, copied into Spark and back): about 1.6 µs per record of a
        small record on the development machine (docs/benchmarks/profile.md)."""
        chain: _Chain | None = getattr(df, _CHAIN_ATTRIBUTE, None) if self.fuse else None
        if chain is None or getattr(df, "is_cached", False):
            chain = _Chain(df, (run,))
            out = df.mapInArrow(self._step(run), out_struct)
        else:
            chain = _Chain(chain.input, (*chain.runners, run))
            out = chain.input.mapInArrow(self._step(_fused(chain.runners)), out_struct)
        setattr(out, _CHAIN_ATTRIBUTE, chain)
        return out

    def _step(self, run: Runner) -> Runner:
        """A map or filter step's mapInArrow function: with FT on, one that can hold
        its rows' acks for a batch sink (integration.sinkhold)."""
        return holding(run, self.settings) if self.ft else run

    def _observed_as(self, observe: Observe, kind: str, fn: Callable[..., Any]) -> str | None:
        """The name of the step's observation, None if it is not observed."""
        if observe is None:
            observe = self.observe
        if isinstance(observe, str):
            if not observe:
                raise ConfigError("observe='' names no observation; use observe=True")
            return observe
        return step_name(kind, fn, self._observed) if observe else None

    def _check_ft_columns(self, df: DataFrame) -> None:
        present = ft_columns_of(df.columns)
        missing = missing_ft_columns(df.schema) if self.ft else []
        if missing:
            raise ConfigError(
                f"FT is on but the DataFrame has no {' / '.join(missing)} column "
                f"(it has {df.columns}): is it read from an FT source with the same "
                "FTSettings? Rows after a Spark aggregation or state function carry no "
                "root; use plain Spark code there (in barrier mode a failure there fails "
                "the task; user guide section 4.9)"
            )
        if not self.ft and present:
            raise ConfigError(
                f"FT is off but the DataFrame has FT columns {list(present)}: the source, "
                "tasks and sinks of a pipeline must share one FTSettings"
            )

    def _check_keys(self, df: DataFrame, keys: Sequence[str]) -> None:
        if not keys:
            raise ConfigError("aggregate needs at least one group key column")
        fields = {f.name: f.dataType for f in df.schema.fields}
        for key in keys:
            if key in ALL_FT_COLUMNS or key not in fields:
                raise ConfigError(f"aggregate: {key!r} is not a payload column of {df.columns}")
            if isinstance(fields[key], ArrayType | MapType | StructType):
                raise ConfigError(
                    f"aggregate: group key {key!r} is {fields[key].simpleString()}; "
                    "keys must be atomic (number, string, binary, date, ...)"
                )

    def _payload_arrow(self, df: DataFrame, schema: Schema) -> Any:
        return self._arrow(df, _struct(df, schema))

    @staticmethod
    def _timezone(df: DataFrame) -> str:
        return str(df.sparkSession.conf.get("spark.sql.session.timeZone"))

    @classmethod
    def _arrow(cls, df: DataFrame, struct: StructType) -> Any:
        return to_arrow_schema(struct, timezone=cls._timezone(df))


Runner = Callable[[Iterator[Any]], Iterator[Any]]
_CHAIN_ATTRIBUTE = "_ftlayer_chain"


@dataclass(frozen=True)
class _Chain:
    """Fused steps (FTTasks._chained): their first step's input and their runners."""

    input: DataFrame
    runners: tuple[Runner, ...]


def _fused(runners: Sequence[Runner]) -> Runner:
    """One mapInArrow function running `runners` as a pipeline of iterators."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        for runner in runners:
            batches = runner(batches)
        return batches

    return run


def _step(kind: str, fn: Callable[..., Any]) -> str:
    """A step as errors and logs name it: the wrapper and the user's function."""
    return f"{kind}({getattr(fn, '__name__', type(fn).__name__)})"


def _check_on_error(on_error: str) -> OnError:
    if on_error not in get_args(OnError):
        raise ConfigError(f"on_error must be one of {get_args(OnError)}, got {on_error!r}")
    return cast(OnError, on_error)


def _struct(df: DataFrame, schema: Schema) -> StructType:
    struct = DataType.fromDDL(schema) if isinstance(schema, str) else schema
    if not isinstance(struct, StructType):
        raise ConfigError(f"an output schema must be a struct, got {struct!r}")
    clash = [f.name for f in struct.fields if f.name in ALL_FT_COLUMNS]
    if clash:
        raise ConfigError(f"output schema must not declare the FT columns {clash}")
    return struct


def _with_ft_fields(struct: StructType, multi: bool, like: StructType | None = None) -> StructType:
    """`struct` with the FT columns of `like` (the step's input): in barrier mode
    `ft_root` alone, with the metadata that says so, visible downstream."""
    if like is not None and completes_at_barrier(like):
        root = like[ROOT_COLUMN]
        fields = [*struct.fields, StructField(ROOT_COLUMN, LongType(), False, root.metadata)]
    else:
        fields = [
            *struct.fields,
            StructField(ROOT_COLUMN, LongType(), False),
            StructField(ID_COLUMN, LongType(), False),
        ]
    if multi:
        fields.append(StructField(EXTRA_ANCHORS_COLUMN, EXTRA_ANCHORS_TYPE, True))
    return StructType(fields)
