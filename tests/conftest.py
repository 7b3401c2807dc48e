"""Fixtures on real parts: the embedded Tansu broker, fresh topics, a local SparkSession.

- `tansu_broker` / `kafka_bootstrap` (session): one broker for the whole run, on a free
  loopback port, stopped at the end even when tests fail. Its log is kept under
  pytest's base temp directory (`.../tansu0/broker.log`) for diagnosis.
- `make_topic` (function): a factory, ``make_topic(partitions=4) -> name``, creating a
  fresh uniquely named topic that is ready (every partition has a leader).
  `kafka_topic` is ``make_topic(4)``.
- `spark` (session): `ftlayer.integration.spark.local_spark` on ``local[2,4]``, with the
  quick-starting JVM (C1 JIT only), and the `ftkafka` source registered in it. Without
  Java the fixture fails the test with the reason; it never skips.

`MakeTopic`, the type of `make_topic`, is in `fixture_types`.

A test that uses any of these is marked `integration` automatically, so
``pytest -m "not integration"`` runs only the tests that need neither.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
from fixture_types import MakeTopic
from pyspark.sql import SparkSession

from ftlayer.integration.harness.broker import TansuBroker
from ftlayer.integration.harness.kafka import create_topic
from ftlayer.integration.source import register
from ftlayer.integration.spark import SparkSetupError, local_spark

pytest_plugins = ("cpu_by_test",)  # FTLAYER_TEST_CPU=FILE: each test's CPU (tests/cpu_by_test.py)

_INTEGRATION_FIXTURES = frozenset(
    {"tansu_broker", "kafka_bootstrap", "make_topic", "kafka_topic", "spark"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    log_path = tmp_path_factory.mktemp("tansu") / "broker.log"
    with TansuBroker(log_path=log_path) as broker:
        yield broker


@pytest.fixture(scope="session")
def kafka_bootstrap(tansu_broker: TansuBroker) -> str:
    bootstrap: str = tansu_broker.bootstrap
    return bootstrap


@pytest.fixture
def make_topic(
    tansu_broker: TansuBroker, kafka_bootstrap: str, request: pytest.FixtureRequest
) -> MakeTopic:
    # Kafka topic names allow [a-zA-Z0-9._-]; the test name makes the broker log readable.
    stem = re.sub(r"[^a-zA-Z0-9._-]+", "-", request.node.name)[:150]

    def make(partitions: int = 4) -> str:
        # A broker that died earlier in the session explains itself here, log tail included.
        tansu_broker.ensure_running()
        name = f"{stem}-{uuid.uuid4().hex[:10]}"
        create_topic(kafka_bootstrap, name, partitions)
        return name

    return make


@pytest.fixture
def kafka_topic(make_topic: MakeTopic) -> str:
    return make_topic(4)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    problem: str | None = None
    try:
        session = local_spark(app_name="ftlayer-tests", fast_start=True)
    except SparkSetupError as exc:
        problem = str(exc)
    if problem is not None:  # outside `except`, so the report is the reason alone
        pytest.fail(f"the integration tests need local Spark: {problem}", pytrace=False)
    register(session)
    yield session
    session.stop()
