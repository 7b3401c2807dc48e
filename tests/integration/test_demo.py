"""`ftlayer demo`, as `make demo` runs it, on a small number of events.

A subprocess, as a user runs it: its own Tansu broker, FT-layer process and Spark JVM.
It must exit 0 and report what the issue asks for: nothing lost and every produced
event completed, by two counts measured apart: the trees the FT layer completed (its
STATUS) and the events the output topic accounts for. Its stdout and stderr go to one
file, as with `make demo ... > log 2>&1`: the JSON object must still be alone on the
last line, each worker kill shows as one line, and Spark's stack traces stay in the
Spark log the summary names, which holds Spark's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = (
    "produced",
    "completed",
    "completed_at_sink",
    "lost",
    "replayed",
    "failed_explicit",
    "timeouts",
    "duplicates_at_sink",
    "seconds",
)


@pytest.mark.integration
def test_demo_reports_nothing_lost_and_every_event_completed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "ftlayer.cli", "demo", "--records", "3000"]
    command += ["--fail-rate", "0.02", "--partitions", "3", "--kill-workers", "1"]
    command += ["--poison-rate", "0.003", "--max-retries", "2"]
    command += ["--workdir", str(tmp_path / "work"), "--json"]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600, check=False
        )
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-3000:]
    result = json.loads(text.rstrip("\n").splitlines()[-1])
    assert set(REQUIRED) <= result.keys()
    # The FT layer's count, checked against the sink's: every event not dead-lettered is
    # accounted for by the output topic (its output is there, or the filter drops it),
    # and completed one tree, or two where the source persisted its record again (the
    # worker kill: Spark computed a task's input again).
    assert result["produced"] == 3000
    assert result["persist"] == "reference"  # ft.persist, the default
    at_sink = result["completed_at_sink"]
    assert at_sink == 3000 - result["dead_lettered"]
    assert at_sink <= result["completed"] <= at_sink + result["persisted_again"]
    assert result["trees_completed"] == result["completed"]
    assert result["lost"] == 0 and result["pending_at_end"] == 0
    # 2% of the events fail on first sight: each is replayed once and then written.
    assert result["replayed"] >= result["failed_explicit"] > 0
    assert result["outputs_at_sink"] == result["expected_outputs"] + result["duplicates_at_sink"]
    # Poison events: each dead-lettered after exactly max retries + 1 attempts, with its
    # causes; the consumer group's offsets reached the end while the job ran.
    assert result["dead_lettered"] == result["poison_events"] > 0
    assert result["max_attempts_seen"] == 3 and result["dead_letters_wrong_attempts"] == 0
    assert result["dead_letters_without_cause"] == 0 and result["group_lag_at_end"] == 0
    # One line per kill; Spark's log (stack traces of killed tasks) in the named file.
    assert text.count("ftlayer demo: killed Python worker") == result["workers_killed"]
    assert Path(result["spark_log"]).is_file()
    assert Path(result["spark_log"]).read_text(errors="replace").strip()  # never empty
    assert f"Spark's log is in {result['spark_log']}" in text
    assert "\tat org.apache.spark" not in text and "Traceback" not in text


@pytest.mark.integration
def test_demo_on_a_standalone_cluster_loses_nothing_when_a_worker_dies(tmp_path: Path) -> None:
    """`ftlayer demo --cluster --kill-worker`: a master and two workers as processes of
    their own, the FT layer with a token and TLS, one worker SIGKILLed with its executor
    and Python workers midway; Spark runs the lost tasks on the other worker."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "ftlayer.cli", "demo", "--cluster", "--kill-worker"]
    command += ["--records", "3000", "--partitions", "4", "--fail-rate", "0.01"]
    command += ["--workdir", str(tmp_path / "work"), "--json"]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600, check=False
        )
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-3000:]
    result = json.loads(text.rstrip("\n").splitlines()[-1])
    assert result["cluster"] == "standalone" and result["master"].startswith("spark://")
    assert result["executors"] >= 2 and result["tls"] is True and result["shards"] == 2
    # The worker, its executor JVM, the PySpark daemon and at least one Python worker.
    assert result["workers_killed"] == 1 and result["processes_killed"] >= 4
    assert text.count("ftlayer demo: killed Spark worker") == 1
    assert result["lost"] == 0 and result["pending_at_end"] == 0
    at_sink = result["completed_at_sink"]
    assert at_sink == 3000
    assert at_sink <= result["completed"] <= at_sink + result["persisted_again"]
    assert result["outputs_at_sink"] == result["expected_outputs"] + result["duplicates_at_sink"]
    # Spark logged the lost executor and its task, run again, to its log, not the terminal.
    spark_log = Path(result["spark_log"]).read_text(errors="replace")
    assert "Lost executor" in spark_log
    assert "its executor exited for a reason unrelated to the task" in spark_log
    assert "\tat org.apache.spark" not in text and "Traceback" not in text
    # Every process the demo started is gone: no JVM of its cluster is left.
    assert not [p for p in _processes_under(tmp_path / "work")], "a process outlived the demo"


@pytest.mark.integration
def test_demo_on_two_shards_loses_nothing_when_one_is_killed_and_the_other_goes_on(
    tmp_path: Path,
) -> None:
    """`ftlayer demo --shards 2 --kill-shard`: shard 1 SIGKILLed a third of the way in,
    right after a batch was planned, down `outage_s`, started again on its data dir;
    meanwhile shard 0's partitions go on completing (its STATUS at the kill and at the
    restart).

    The first records shard 0 completes after the kill are those of the batch the kill
    followed: that batch waits 2 s for the dead shard before it parks its failures
    elsewhere, and its records complete when the batch after it is planned. On a
    machine three times slower running the whole suite, that took over 5 s once, so
    the outage is 10 s."""
    outage_s = 10
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "ftlayer.cli", "demo", "--shards", "2", "--kill-shard"]
    command += ["--records", "3000", "--partitions", "4", "--fail-rate", "0.01"]
    command += ["--max-offsets-per-trigger", "250", "--outage-s", str(outage_s)]
    command += ["--workdir", str(tmp_path / "work"), "--json"]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        done = subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600, check=False
        )
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-3000:]
    result = json.loads(text.rstrip("\n").splitlines()[-1])
    assert result["shards"] == 2 and result["shard_kills"] == 1
    assert result["shard_down_s"] >= outage_s
    assert result["completed_during_outage"] > 0, "shard 0 stalled while shard 1 was down"
    assert text.count("ftlayer demo: killed FT-layer shard 1") == 1
    assert text.count("ftlayer demo: started FT-layer shard 1 again") == 1
    # Nothing lost: every event is accounted for at the sink, no tree is left pending
    # on either shard, and the group offsets reached the end of every partition.
    assert result["lost"] == 0 and result["pending_at_end"] == 0
    assert result["completed_at_sink"] == 3000 and result["group_lag_at_end"] == 0
    assert result["outputs_at_sink"] == result["expected_outputs"] + result["duplicates_at_sink"]
    assert (tmp_path / "work" / "ft0").is_dir() and (tmp_path / "work" / "ft1").is_dir()


@pytest.mark.integration
def test_demo_on_jetstream_loses_nothing_when_its_receiver_dies(tmp_path: Path) -> None:
    """`ftlayer demo --source jetstream --kill-receiver`: the events come from a
    JetStream stream through an `ftlayer ingest jetstream` receiver, SIGKILLed once a
    third were acknowledged and started again; the query reads them with ftingest.
    (`--source http` runs the same demo with the webhook upstream that
    test_ingest_kills.py drives.)"""
    command = [sys.executable, "-m", "ftlayer.cli", "demo", "--source", "jetstream"]
    command += ["--kill-receiver", "--records", "3000", "--partitions", "3"]
    command += ["--workdir", str(tmp_path / "work"), "--json"]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text[-3000:]
    result = json.loads(text.rstrip("\n").splitlines()[-1])
    assert set(REQUIRED) <= result.keys()
    assert result["source"] == "jetstream" and result["receivers_killed"] == 1
    assert text.count("ftlayer demo: receiver (pid") == 1
    # Counted against what was acknowledged upstream: all of it, nothing lost.
    assert result["acked_upstream"] == result["produced"] == 3000
    assert result["lost"] == 0 and result["pending_at_end"] == 0
    assert result["completed"] == result["completed_at_sink"] == 3000
    assert result["outputs_at_sink"] == result["expected_outputs"] + result["duplicates_at_sink"]


def _processes_under(workdir: Path) -> list[int]:
    """Processes whose command line names `workdir` (the demo's cluster and FT layer)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(workdir).encode() in cmdline:
                found.append(int(entry))
    return found
