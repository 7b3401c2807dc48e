"""Status and CheckpointReport: the typed replies, one parser each."""

from __future__ import annotations

from typing import Any

import pytest

from ftlayer.position import Position
from ftlayer.status import BriefStatus, CheckpointReport, Status, StatusError


def _checkpoint(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "query": "job",
        "id": 3,
        "mode": "unaligned",
        "state": "complete",
        "position": {"kafka": {"t": {"0": 10, "1": 4}}, "replay": 2},
        "sources": [7],
        "begun_at": 1.0,
        "done_at": 2.0,
        "completed_at": 2.5,
        "duration_s": 1.5,
        "alignment_wait_s": 0.5,
        "pending_roots": 0,
        "replay_queue": 0,
        "copy_s": 0.001,
        "write_s": None,
        "size_bytes": 10,
        "pruned": 1,
        "superseded": False,
        "commit_offsets": {"t": {"0": 9, "1": 4}},
    }
    data.update(changes)
    return data


_LATENCY: dict[str, Any] = {"count": 2, "sum_s": 0.012, "p50_s": 0.005, "p99_s": 0.0071}


def _status(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "persisted": 5,
        "completed": 3,
        "pending": 2,
        "failed": {"explicit": 1, "timeout": 0, "recovery": 0, "source-expired": 0},
        "replay_queue": 1,
        "replayed": 1,
        "replay_cursor": 9,
        "replay_cursors": {"7": 4},
        "replay_cursor_at_start": 2,
        "replay_pruned": {"*": 1, "7": 3},
        "retry_waiting": 1,
        "unfilled": 1,
        "filled": 3,
        "ingested": 0,
        "ingest_duplicates": 0,
        "open_ranges": 2,
        "dead_lettered": 2,
        "dead_letters": 1,
        "dead_letters_delivered": 1,
        "dead_letters_purged": 0,
        "dead_letters_requeued": 0,
        "barrier_holds": 4,
        "barrier_released": 9,
        "recovered_pending": 6,
        "recovered_completed": 2,
        "timeouts_postponed": 6,
        "batches_running": {"7": {"running_s": 4.5, "lease_s": 1.5}},
        "taken_over": 3,
        "late_events": 0,
        "unknown_events": 0,
        "xor_events": 8,
        "complete_latency": _LATENCY,
        "by_source": {
            "7": {
                "persisted": 5,
                "completed": 3,
                "failed": {"explicit": 1, "timeout": 0, "recovery": 0, "source-expired": 0},
                "replayed": 1,
                "dead_lettered": 2,
                "replay_queue": 1,
                "unfilled": 1,
                "complete_latency": _LATENCY,
            }
        },
        "pending_by_source": {"7": 2},
        "stored_records": 2,
        "deletes_pending": 0,
        "lmdb_size_bytes": 4096,
        "store_commits": 9,
        "connections": 1,
        "max_connections": 1024,
        "uptime_s": 1.5,
        "checkpoints": {
            "job": {"completed": 1, "open": [], "recent": [_checkpoint()], "last_complete_id": 3}
        },
        "sources": {"7": {"partitioner": "forward", "num_partitions": 2, "options": {}}},
        "timeout_s": 30.0,
        "buckets": 3,
        "version": "0.1.0",
        "shard": 1,
        "shards": 2,
        "store_id": "7dbf5e27e271f4e8",
        "requests": {
            "PERSIST": {"count": 12, "cpu_s": 0.0031},
            "STATUS": {"count": 2, "cpu_s": 0.0004},
        },
        "parked": {"0": {"entries": 1, "roots": 3}},
    }
    data.update(changes)
    return data


def test_a_status_survives_its_json_and_reads_as_its_json() -> None:
    status = Status.from_json(_status())
    assert Status.from_json(status.to_json()) == status
    assert status.to_json() == _status()
    assert status["failed"]["explicit"] == 1 and dict(status)["pending"] == 2
    assert status.by_source["7"].complete_latency.p99_s == 0.0071
    assert status.requests["PERSIST"].count == 12 and status.requests["STATUS"].cpu_s == 0.0004
    assert status.parked_for(0) == 3 and status.parked_for(1) == 0
    assert status["by_source"]["7"]["failed"]["explicit"] == 1
    report = status.checkpoints["job"].recent[0]
    assert report.position == Position({"t": {0: 10, 1: 4}}, 2)
    assert report.commit_offsets == {"t": {0: 9, 1: 4}}


def test_the_replay_cursor_of_a_query_is_its_sources_own() -> None:
    status = Status.from_json(_status())
    assert status.replay_cursor_of([7]) == 4  # not the global 9: others' failures
    assert status.replay_cursor_of([8]) == 2  # no replay since the start
    assert status.replay_cursor_of([7, 8]) == 4
    assert status.replay_start_of([7]) == 3 and status.replay_start_of([8]) == 1


def test_a_sources_pending_roots_are_its_own_and_none_when_absent() -> None:
    status = Status.from_json(_status())
    assert status.pending_of(7) == 2 and status.pending_of(8) == 0


def test_a_sources_lease_is_its_running_batchs_and_none_without_one() -> None:
    status = Status.from_json(_status())
    assert status.lease_of(7) == 1.5 and status.lease_of(8) is None
    assert status.timeouts_postponed == 6


def test_the_brief_reply_answers_a_sources_questions_as_the_whole_one() -> None:
    status = Status.from_json(_status())
    brief = status.brief()
    assert BriefStatus.from_json(brief.to_json()) == brief
    assert set(brief.to_json()) == {
        "replay_cursors",
        "replay_cursor_at_start",
        "replay_pruned",
        "pending_by_source",
        "unfilled_by_source",
        "timeout_s",
        "uptime_s",
        "version",
        "shard",
        "shards",
        "store_id",
        "parked",
    }
    for ids in ([7], [8], [7, 8], []):
        assert brief.replay_cursor_of(ids) == status.replay_cursor_of(ids)
        assert brief.replay_start_of(ids) == status.replay_start_of(ids)
    for source in (7, 8):
        assert brief.pending_of(source) == status.pending_of(source)
        assert brief.unfilled_of(source) == status.unfilled_of(source)
    assert brief.unfilled_of(7) == 1 and brief.parked_for(0) == status.parked_for(0) == 3
    assert (brief.store_id, brief.shard, brief.shards) == (status.store_id, 1, 2)


def test_a_malformed_brief_reply_names_its_field() -> None:
    good = Status.from_json(_status()).brief().to_json()
    with pytest.raises(StatusError, match="surprise"):
        BriefStatus.from_json({**good, "surprise": 1})
    with pytest.raises(StatusError, match="'checkpoints'"):
        BriefStatus.from_json({**good, "checkpoints": {}})  # the whole reply's, not here
    with pytest.raises(StatusError, match="'unfilled_by_source'"):
        BriefStatus.from_json({**good, "unfilled_by_source": {"7": "1"}})
    missing = dict(good)
    del missing["store_id"]
    with pytest.raises(StatusError, match="'store_id'"):
        BriefStatus.from_json(missing)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"pending": "2"}, "'pending'"),
        ({"pending": True}, "'pending'"),
        ({"failed": {"explicit": 1.5}}, "'failed'"),
        ({"pending_by_source": {"7": "2"}}, "'pending_by_source'"),
        ({"batches_running": {"7": {"running_s": 1.0}}}, "'batches_running' of source 7"),
        ({"batches_running": {"7": {"running_s": 1, "lease_s": "1"}}}, "'batches_running'"),
        ({"batches_running": []}, "'batches_running'"),
        ({"surprise": 1}, "surprise"),
        ({"checkpoints": {"job": {"completed": 1}}}, "'open'"),
        ({"complete_latency": {**_LATENCY, "p50_s": "5 ms"}}, "'p50_s'"),
        ({"by_source": {"7": {"persisted": 1}}}, "source 7 has no 'completed'"),
    ],
)
def test_a_malformed_status_names_its_field(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(StatusError, match=words):
        Status.from_json(_status(**changes))
    missing = _status()
    del missing["version"]
    with pytest.raises(StatusError, match="'version'"):
        Status.from_json(missing)


def test_a_checkpoint_reply_carries_the_one_it_completed() -> None:
    begun = _checkpoint(id=4, state="begun", completed_at=None, commit_offsets=None)
    report = CheckpointReport.from_json({**begun, "completed": _checkpoint()})
    assert report.commit_offsets is None and report.completed is not None
    assert report.completed.commit_offsets == {"t": {0: 9, 1: 4}}
    assert CheckpointReport.from_json(report.to_json()) == report
    with pytest.raises(StatusError, match="replay"):
        CheckpointReport.from_json(_checkpoint(position={"kafka": {}}))
