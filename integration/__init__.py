"""ftlayer for PySpark: the whole user API in one import.

    from ftlayer.integration import FTTasks, ft_kafka_stream, parse_options, register

    register(spark)  # spark.readStream.format("ftkafka")
    orders = spark.readStream.format("ftkafka").options(**source_options).load()
    settings = parse_options(source_options).ft  # or FTSettings(address, token=...)
    tasks = FTTasks(settings)
    parsed = tasks.map(orders, parse, schema)  # a FailException fails one record
    writer = ft_kafka_stream(parsed, "broker:9092", "out", settings)
    query = writer.option("checkpointLocation", "/cp").start()
    # each batch's acked and failed rows: query.lastProgress["observedMetrics"]
    # ["ftlayer.sink"]; ft_observe(df, name): the rows read and replayed there too
    # (ft_kafka_sink / ft_foreach_batch: the same writes as foreachBatch functions)

Three rooms, each with its contract in its own docstring: the `ftkafka` source
(`ftlayer.integration.source`: persists every record before Spark sees it and feeds
failed records back in), the task wrappers (`ftlayer.integration.tasks`: anchor every
output and send the XOR events) and the sinks (`ftlayer.integration.sinks`: ack a
record once its write is confirmed). What tests, the demo and the benches run against
(embedded broker, Kafka helpers, the server as a child process) is
`ftlayer.integration.harness`, which none of these import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ftlayer.errors import ConfigError, FailException, SourceError

if TYPE_CHECKING:
    from .ftcolumns import FTSettings
    from .kafkastream import ft_kafka_stream
    from .observe import ft_observe
    from .sinks import SinkError, ft_foreach_batch, ft_kafka_sink
    from .source import parse_options, register
    from .spark import local_spark
    from .tasks import FTTasks, OutputSchemaError, TaskOutput

# Imported on first use (PEP 562): a receiver process (.receivers) imports this package
# without loading PySpark, which the names below need.
_LAZY: dict[str, str] = {
    "FTSettings": ".ftcolumns",
    "ft_kafka_stream": ".kafkastream",
    "ft_observe": ".observe",
    "SinkError": ".sinks",
    "ft_foreach_batch": ".sinks",
    "ft_kafka_sink": ".sinks",
    "parse_options": ".source",
    "register": ".source",
    "local_spark": ".spark",
    "FTTasks": ".tasks",
    "OutputSchemaError": ".tasks",
    "TaskOutput": ".tasks",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ConfigError",
    "FTSettings",
    "FTTasks",
    "FailException",
    "OutputSchemaError",
    "SinkError",
    "SourceError",
    "TaskOutput",
    "ft_foreach_batch",
    "ft_kafka_sink",
    "ft_kafka_stream",
    "ft_observe",
    "local_spark",
    "parse_options",
    "register",
]
