"""Fuzzing one real `ftlayer serve` process with hostile bytes, and stalling clients.

The fuzz test sends over 10,000 generated frames (seeded, so a failure reproduces):
random kinds and bodies, bit-flipped valid PERSIST/XOR/FAIL frames, truncated frames,
length prefixes above max_frame and below 5, and garbage, over many raw connections,
some of which first complete a valid handshake. Every reply must be a well-formed frame
that `protocol.decode` accepts (ERROR frames included), in the order the server's own
state machine dictates, or a close.

To keep the counters checkable, option (a) of the design: a fuzz stream is first run
through a local model of the server (the same framing, `protocol.decode` and the
handshake state machine); a stream in which any frame would decode to a valid PERSIST,
XOR, FAIL or REGISTER_SOURCE on a welcomed connection (one that could
change the acker table) is regenerated instead of sent. So afterwards the status
counters must be exactly what the good client's own persist/xor/fail calls explain,
and a good client still gets correct answers.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from serverproc import read_address, serve_command, terminated

from ftlayer.acking.ids import new_ids
from ftlayer.client import FTClient
from ftlayer.integration.harness.kafka import wait_until
from ftlayer.records import RecordBatch
from ftlayer.wire import (
    DEFAULT_MAX_FRAME,
    MAX_CLIENT_NONCE,
    MIN_CLIENT_NONCE,
    ErrorCode,
    ErrorReply,
    Fail,
    FetchReplay,
    Frame,
    FrameReader,
    Kind,
    Persist,
    ProtocolError,
    RegisterSource,
    StatusReply,
    StatusRequest,
    Xor,
    decode,
    encode_auth,
    encode_fail,
    encode_fetch_replay,
    encode_frame,
    encode_hello,
    encode_persist,
    encode_status_request,
    encode_xor,
)

SEED = 20261121
MIN_FRAMES = 10_000
_PREFIX = struct.Struct(">I")
_HEAD = struct.Struct(">IBI")
_MUTATING = (Persist, Xor, Fail, RegisterSource)
_DATA = (Persist, Xor, Fail, FetchReplay, StatusRequest)
_REPLY_KINDS = {int(k) for k in Kind if k >= 0x80}
_KINDS = {int(k) for k in Kind}


# ---- the server process ------------------------------------------------------------


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.address.rsplit(":", 1)
        return host, int(port)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path) as found:
        yield found


@contextlib.contextmanager
def serving(tmp_path: Path, *serve_args: str) -> Iterator[Served]:
    log = tmp_path / "server.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            serve_command(tmp_path / "data", "--tree-timeout-s", "3600", *serve_args),
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        yield Served(proc, read_address(proc, log), log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _counters(status: dict[str, Any]) -> dict[str, Any]:
    volatile = ("connections", "uptime_s", "lmdb_size_bytes", "requests")  # requests: ours too
    return {k: v for k, v in status.items() if k not in volatile}


def _batch(n: int, tag: str) -> RecordBatch:
    payloads = [f"{tag}-{i}".encode() * (i + 1) for i in range(n)]
    return RecordBatch.build(new_ids(n), payloads, topics="fuzz", partitions=0, offsets=None)


# ---- the local model of the server -----------------------------------------------------


@dataclass
class Expected:
    """What the server must answer to one stream: (request id, allowed reply kinds) per
    reply, in order, and how the stream ends."""

    replies: list[tuple[int, frozenset[int]]] = field(default_factory=list)
    broken: bool = False  # a bad length prefix: every reply, then ERROR with id 0, close
    closed: bool = False  # the server closes after the last reply (an error before WELCOME)


_ERROR = frozenset({int(Kind.ERROR)})


def model(stream: bytes) -> Expected | None:
    """The server's replies to `stream` (then EOF), or None if some frame could mutate
    the acker table (a valid PERSIST, XOR or FAIL after the handshake)."""
    expected = Expected()
    hello_seen = welcomed = False
    pos = 0
    while len(stream) - pos >= _PREFIX.size:
        (length,) = _PREFIX.unpack_from(stream, pos)
        if not 5 <= length <= DEFAULT_MAX_FRAME:
            expected.broken = True
            return expected
        if len(stream) - pos - _PREFIX.size < length:
            break  # truncated: the server waits for the rest, then sees EOF
        _, kind, rid = _HEAD.unpack_from(stream, pos)
        frame = Frame(kind, rid, stream[pos + _HEAD.size : pos + _PREFIX.size + length])
        pos += _PREFIX.size + length
        # The server checks the kind before it decodes the body (docs/protocol.md, 2).
        if kind not in _KINDS or kind in _REPLY_KINDS:
            expected.replies.append((rid, _ERROR))
            if not welcomed:
                return _closed(expected)
            continue
        if not welcomed:
            handshake = (kind == Kind.HELLO and not hello_seen) or (
                kind == Kind.AUTH and hello_seen
            )
            try:
                if not handshake:
                    raise ProtocolError("refused by its kind")
                decode(frame)
            except ProtocolError:
                expected.replies.append((rid, _ERROR))
                return _closed(expected)
            welcomed, hello_seen = kind == Kind.AUTH, True
            reply = Kind.WELCOME if welcomed else Kind.CHALLENGE
            expected.replies.append((rid, frozenset({int(reply)})))
            continue
        if kind in (Kind.HELLO, Kind.AUTH):
            expected.replies.append((rid, _ERROR))
            continue
        try:
            message = decode(frame)
        except ProtocolError:
            expected.replies.append((rid, _ERROR))
            continue
        if isinstance(message, _MUTATING):
            return None
        if isinstance(message, StatusRequest):
            expected.replies.append((rid, frozenset({int(Kind.STATUS_REPLY)})))
        elif isinstance(message, FetchReplay):
            expected.replies.append((rid, frozenset({int(Kind.REPLAY), int(Kind.ERROR)})))
        else:
            expected.replies.append((rid, _ERROR))
    return expected


def _closed(expected: Expected) -> Expected:
    """The server closes after the last reply: nothing after it is read."""
    expected.closed = True
    return expected


def _parse_frame(data: bytes) -> Frame:
    """The frame `data` starts with (its prefix is intact: flips start after it)."""
    frames = FrameReader().feed(data)
    assert frames, "not one whole frame"
    return frames[0]


# ---- generators --------------------------------------------------------------------


class Fuzzer:
    def __init__(self, seed: int, roots: list[int]) -> None:
        self.rng = random.Random(seed)
        self.roots = roots  # real pending roots: flipped frames aim near live state
        self.rid = 0

    def next_rid(self) -> int:
        self.rid = (self.rid + 1) & 0xFFFFFFFF
        return self.rid

    def body(self, limit: int = 64) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, limit))

    def handshake(self) -> list[bytes]:
        nonce = self.rng.randbytes(self.rng.randint(MIN_CLIENT_NONCE, MAX_CLIENT_NONCE))
        return [
            encode_hello(self.next_rid(), nonce, "fuzzer"),
            encode_auth(self.next_rid(), bytes(32)),
        ]

    def valid_mutating(self) -> bytes:
        rng, rid = self.rng, self.next_rid()
        n = rng.randint(0, 4)
        roots = [rng.choice(self.roots) for _ in range(n)]
        choice = rng.randrange(3)
        if choice == 0:
            return encode_xor(rid, roots, [rng.getrandbits(64) for _ in range(n)])
        if choice == 1:
            return encode_fail(rid, roots)
        return encode_persist(rid, _batch(n, "flip"), [rng.getrandbits(64) for _ in range(n)])

    def in_step(self) -> bytes:
        """One frame with a good length prefix (its kind and body may be anything)."""
        rng = self.rng
        choice = rng.randrange(7)
        if choice == 0:
            return encode_frame(rng.randrange(256), self.next_rid(), self.body())
        if choice == 1:
            return encode_frame(rng.choice(list(Kind)), self.next_rid(), self.body(200))
        if choice == 2:
            return encode_status_request(self.next_rid())
        if choice == 3:
            lo, hi = rng.getrandbits(64), rng.getrandbits(64)
            return encode_fetch_replay(self.next_rid(), min(lo, hi), max(lo, hi))
        if choice == 4:
            return self.handshake()[rng.randrange(2)]
        # A valid data frame with bits flipped past the length prefix, checked locally:
        # flips that still decode to a PERSIST, XOR or FAIL are tried again (option a).
        valid = self.valid_mutating()
        for _ in range(20):
            frame = bytearray(valid)
            for _ in range(rng.randint(1, 3)):
                # Half the flips hit the kind, request id and counts, where they bite.
                end = min(len(frame), 16) if rng.random() < 0.5 else len(frame)
                bit = rng.randrange(8 * _PREFIX.size, 8 * end)
                frame[bit // 8] ^= 1 << (bit % 8)
            try:
                if not isinstance(decode(_parse_frame(bytes(frame))), _MUTATING):
                    return bytes(frame)
            except ProtocolError:
                return bytes(frame)
        return encode_status_request(self.next_rid())

    def breaker(self) -> bytes:
        """Bytes that may put the stream out of step (or end it mid-frame)."""
        rng = self.rng
        choice = rng.randrange(5)
        if choice == 0:  # oversized length prefix, a few body bytes behind it
            length = rng.randint(DEFAULT_MAX_FRAME + 1, 0xFFFFFFFF)
            return _PREFIX.pack(length) + self.body(16)
        if choice == 1:  # length below kind + request id
            return _PREFIX.pack(rng.randrange(5)) + self.body(16)
        if choice == 2:  # truncated valid frame
            frame = self.valid_mutating()
            return frame[: rng.randrange(1, len(frame))]
        if choice == 3:  # a flip anywhere, the length prefix included
            frame = bytearray(self.valid_mutating())
            bit = rng.randrange(8 * len(frame))
            frame[bit // 8] ^= 1 << (bit % 8)
            return bytes(frame)
        return self.body(128)  # garbage

    def stream(self) -> tuple[list[bytes], bool]:
        """(frames of one connection, whether it starts with a valid handshake)."""
        rng = self.rng
        welcomed = rng.random() < 0.3
        parts = self.handshake() if welcomed else []
        count = rng.randint(20, 150) if welcomed else rng.randint(1, 4)
        parts += [self.in_step() for _ in range(count)]
        if rng.random() < 0.5:
            parts.append(self.breaker())
        return parts, welcomed


# ---- one raw connection ------------------------------------------------------------------


def exchange(address: tuple[str, int], stream: bytes) -> tuple[list[Frame], bool, bool]:
    """Send `stream` then EOF, concurrently read until the server closes.

    Returns (reply frames, reset: the connection was reset, leftover: bytes that do not
    form a whole frame were received)."""
    with socket.create_connection(address, timeout=10) as sock:

        def send() -> None:
            try:
                sock.sendall(stream)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server closed first: its replies say why

        sender = threading.Thread(target=send)
        sender.start()
        reader = FrameReader()
        frames: list[Frame] = []
        reset = False
        try:
            while data := sock.recv(1 << 16):
                frames += reader.feed(data)
        except (ConnectionResetError, BrokenPipeError):
            reset = True
        sender.join(10)
    return frames, reset, reader.pending_bytes > 0


def check_replies(frames: list[Frame], reset: bool, expected: Expected) -> None:
    for frame in frames:
        assert frame.kind in _REPLY_KINDS, frame
        decode(frame)  # well-formed: raises otherwise
    replies = [(f.request_id, f.kind) for f in frames]
    # Every complete frame before a bad length prefix is answered, then the stream
    # error (ERROR 0). A reset (the server closed with unread bytes) may cut the end.
    want = expected.replies + ([(0, _ERROR)] if expected.broken else [])
    assert len(replies) <= len(want)
    if not reset:
        assert len(replies) == len(want), (replies[-3:], want[-3:])
    for (rid, kind), (want_rid, kinds) in zip(replies, want, strict=False):
        assert rid == want_rid and kind in kinds, (rid, kind, want_rid, kinds)


# ---- tests -------------------------------------------------------------------------------


def test_fuzzed_frames_get_well_formed_replies_and_change_nothing(served: Served) -> None:
    with FTClient(served.address) as client:
        batch = _batch(8, "good")
        acks = new_ids(8)
        client.persist(batch, acks)
        assert client.xor(batch.roots[:3], acks[:3]) == 3  # three complete
        assert client.fail(batch.roots[3:4]) == 1  # one fails, is queued for replay
        # The completed records leave LMDB in the background; wait, so that a change
        # in the stored count later can only come from the fuzzed frames.
        wait_until(lambda: client.status()["deletes_pending"] == 0, 5.0, "deletes")
        before = _counters(client.status())
        assert (before["persisted"], before["completed"], before["pending"]) == (8, 3, 5)
        assert before["stored_records"] == 5
        assert before["failed"]["explicit"] == 1

        fuzzer = Fuzzer(SEED, batch.roots.tolist())
        sent = connections = welcomed_connections = skipped = 0
        while sent < MIN_FRAMES:
            parts, welcomed = fuzzer.stream()
            stream = b"".join(parts)
            expected = model(stream)
            if expected is None:
                skipped += 1
                continue
            frames, reset, leftover = exchange(served.host_port, stream)
            assert not leftover, "the server sent part of a frame"
            check_replies(frames, reset, expected)
            sent += len(parts)
            connections += 1
            welcomed_connections += welcomed
        assert connections > 100 and welcomed_connections > 20 and skipped < connections

        # Nothing the fuzzer sent touched the table, and the good client still works.
        assert _counters(client.status()) == before
        replay = client.fetch_replay(0, 2**63)
        assert replay.records.payloads == [batch.payloads[3]]
        assert client.xor(batch.roots[4:], acks[4:]) == 4
        more, more_acks = _batch(5, "after"), new_ids(5)
        client.persist(more, more_acks)
        client.xor(more.roots, more_acks)
        after = client.status()
    assert (after["persisted"], after["completed"], after["pending"]) == (13, 12, 1)
    assert after["failed"] == before["failed"]
    assert after["unknown_events"] == before["unknown_events"]
    assert served.proc.poll() is None


STALLS_TIMED_OUT_AFTER = ("--handshake-timeout-s", "600", "--frame-timeout-s", "600")
BUSY_DEADLINE_S = 60.0
"""Far below the stalls' timeouts, far above what a loaded machine takes (about 0.1 s
on a quiet one)."""


def test_stalled_clients_do_not_block_others_and_stop_is_clean(tmp_path: Path) -> None:
    # The stalled connections' timeouts are far past the deadline: a server that waited
    # on any of them would answer the busy client only after it.
    with serving(tmp_path, *STALLS_TIMED_OUT_AFTER) as served:
        hello = encode_hello(1, bytes(16), "stalled")
        half_hello = socket.create_connection(served.host_port, timeout=5)
        half_hello.sendall(hello[: len(hello) // 2])
        silent = socket.create_connection(served.host_port, timeout=5)
        # A welcomed connection that stalls mid-frame is not subject to the handshake timeout.
        half_xor = socket.create_connection(served.host_port, timeout=5)
        half_xor.sendall(hello + encode_auth(2, bytes(32)))
        xor = encode_xor(3, [1, 2], [3, 4])
        half_xor.sendall(xor[: len(xor) // 2])
        stalled = [half_hello, silent, half_xor]
        try:
            time.sleep(0.3)  # let the server's threads block on them
            deadline = time.monotonic() + BUSY_DEADLINE_S
            with FTClient(served.address, request_timeout=BUSY_DEADLINE_S) as client:
                batch, acks = _batch(20, "busy"), new_ids(20)
                client.persist(batch, acks)
                assert client.xor(batch.roots, acks) == 20
                status = client.status()
            assert time.monotonic() < deadline
            assert (status["persisted"], status["completed"], status["pending"]) == (20, 20, 0)
            assert status["connections"] >= 4

            assert terminated(served.proc, served.log) == 0
        finally:
            for sock in stalled:
                sock.close()


def test_model_rejects_streams_that_could_mutate() -> None:
    """The guard of option (a) itself: a welcomed valid XOR is refused, the same bytes
    before the handshake are an ERROR and a close."""
    fuzzer = Fuzzer(1, [5])
    handshake = b"".join(fuzzer.handshake())
    xor = encode_xor(9, [5], [1])
    assert model(handshake + xor) is None
    expected = model(xor)
    assert expected is not None and expected.closed and expected.replies == [(9, _ERROR)]
    broken = model(handshake + _PREFIX.pack(DEFAULT_MAX_FRAME + 1))
    assert broken is not None and broken.broken and len(broken.replies) == 2


def test_frames_the_spec_refuses_get_bad_request_and_change_nothing(served: Served) -> None:
    """The independent fuzzer's findings (docs/protocol.md 5.6, 5.8, 5.11): a query name
    with DEL or a C1 control, a bool as a root, a limit on a purge. Each gets ERROR 7
    on its own request id, the connection goes on, and no checkpoint exists after."""
    position = {"kafka": {}, "replay": 0}
    refused = [
        {"query": name, "position": position, "sources": [1], "mode": "aligned"}
        for name in ("orders\x7f", "orders\x85")
    ]
    frames = [
        encode_frame(Kind.CHECKPOINT_BEGIN, 3 + i, json.dumps(body).encode())
        for i, body in enumerate(refused)
    ]
    frames += [
        encode_frame(Kind.INSPECT, 5, b'{"root": true}'),
        encode_frame(Kind.INSPECT, 6, b'{"root": false}'),
        encode_frame(Kind.DEAD_LETTERS, 7, b'{"op": "purge", "where": {}, "limit": 1}'),
        encode_status_request(8),
    ]
    fuzzer = Fuzzer(2, [5])
    replies, reset, leftover = exchange(served.host_port, b"".join([*fuzzer.handshake(), *frames]))
    assert not reset and not leftover
    assert [r.request_id for r in replies] == [1, 2, 3, 4, 5, 6, 7, 8]
    for reply in replies[2:7]:
        error = decode(reply)
        assert isinstance(error, ErrorReply) and error.code == ErrorCode.BAD_REQUEST, error
    status = decode(replies[7])
    assert isinstance(status, StatusReply) and status.status["checkpoints"] == {}
