"""The FT-layer server: one FTLayer over LmdbStorage, hosted over TCP.

Sources and tasks reach the core through this process (docs/protocol.md is the wire
format). The contract:

1. One connection, one thread, at most `max_connections` of them (the next one gets
   ERROR 103 with request id 0 and is closed). The core is not thread-safe, so every
   call into it (persist, xor, fail, fetch_replay, current_stats, tick) runs under one
   lock. The LMDB commits of PERSIST and of the deletes run outside it (items 3 and 6),
   and an LMDB read under it never waits for a commit (LmdbStorage), so the requests of
   a stream wait for the core only while another one computes in it; only failed records
   (re-tagged for replay), registrations, dead-letter operations and a savepoint's
   deletes commit under the lock. Socket I/O never runs under it, so a slow or vanished
   client blocks only its own thread, and for a bounded time: the handshake (TLS
   included) must finish within `handshake_timeout_s`, a frame whose first bytes arrived
   must be complete within `frame_timeout_s`, a welcomed connection with no frame
   started is closed after `idle_timeout_s` without a byte, and a send must finish
   within `send_timeout_s`. Reads poll with a short timeout (to notice stop() and those
   deadlines).
2. Handshake: HELLO -> CHALLENGE (fresh server nonce) -> AUTH (checked with
   check_auth when a token is set) -> WELCOME. Until WELCOME, a frame of any other
   kind is refused by its kind before its body is decoded (ERROR 6 for a data
   request, 9 otherwise), and any error is answered and then the connection is closed.
3. PERSIST is answered OK only after the storage committed the records and they are
   pending in the core: OK means "confirmed persisted". It runs in three steps
   (FTLayer.begin_persist, end_persist): (a) under the lock the batch is checked and
   its roots reserved (a persist of the same roots is refused meanwhile); (b) outside
   it the records are written, in one LMDB transaction and one fsync with the other
   connections' persists waiting at that moment (group commit, LmdbStorage.put);
   (c) under the lock again the roots become pending, their timeouts start, the
   journal learns them, takeovers and barrier holds happen. Until (c) no other
   request sees the roots (events and fails for them are dropped as unknown: no
   client has them before the OK); a failed write (b) leaves nothing (the roots are
   free again, the client gets the error); a crash between (b) and (c) leaves stored
   records no journal knows, and the restart replays them (journal bases taken
   meanwhile do not count them as completed: ftlayer.core.journal).
4. Requests are answered one by one, in the order they arrive. A bad frame length
   breaks the stream: every complete frame before it is answered first, then ERROR
   with request id 0, then close. After WELCOME, a frame with a good length but a bad
   kind or body leaves the stream in step (docs/protocol.md, section 1): ERROR with
   that request id (an unknown kind is 3, a reply kind or a second HELLO 9, checked
   before the body is decoded), and serving goes on. A request is dispatched by the
   table in `_request_handlers`. Core errors map to ERROR 101 (StorageError) or 102
   (any other FTLayerError or ValueError: ConfigError, StateConflict, CorruptData,
   PositionError, PartitioningError; nothing applied); anything else is
   100 and is logged with its traceback. Other connections are never affected.
5. A ticker thread calls FTLayer.tick when it has work, and sleeps in between: when a
   rotation of a timeout holding roots is due (any timeout's while sink holds are
   open), when a failed record's backoff ends (FTLayer.tick_delay), every min(0.5 s,
   rotation interval / 10) while a checkpoint aligns, and when a staged write has
   waited 2 s. A request whose change brings its work sooner wakes it to sleep again
   until then (`_wake_workers`), so a root times out within milliseconds of its
   rotation, and an idle server's ticker wakes only to look for idle spooled savepoint
   parts (every min(30 s, spool_idle_s / 4)).
6. Completed records are deleted from LMDB by the deleter thread, never in a PERSIST's
   transaction: it takes their seqs from the core (under the lock) as soon as a request
   left _DELETE_CHUNK of them, and at the latest `delete_interval_s` after the first
   (while none are left it sleeps until a change marks some), and deletes
   them outside the lock in transactions of their own of bounded work (`_delete_slices`:
   _DELETE_CHUNK scattered records, or up to 8 times as many that lie side by side, as
   a barrier's whole micro-batch does), each after the requests under way (the
   deleter's work can wait; theirs is what clients wait for): a persist waits for at
   most one of them, and usually for none. An
   XOR batch never waits for an LMDB commit. A completed record that a crash leaves
   undeleted is deleted at the restart if the journal knows its tree completed, and
   otherwise replayed (a duplicate, never a loss); a delete that fails is tried again;
   stop() deletes what is left before closing the storage.
7. Checkpoints (ftlayer.checkpoint): CHECKPOINT_BEGIN replies at once; when the acker
   journal is due a new base, it marks the state owed a copy, taken under the lock
   before the next change to the core or by the checkpoint-writer thread (woken after
   the reply; it sleeps while nothing waits to be written), which writes the base
   outside the lock. CHECKPOINT_DONE prunes and completes
   (unaligned) or starts aligning (aligned), staging the checkpoint's record in the
   store (it commits with the next write, or the ticker flushes it); the ticker
   completes aligning checkpoints once no root before their barrier is pending.
   `status` shows every query's checkpoints. A BEGIN also opens its sources' batch,
   its completion closes it, and HEARTBEAT (from the source's driver while the batch
   runs) leases it: its trees' timeouts are postponed while it is open and leased
   (ftlayer.core.leases; `status` shows `batches_running`). BATCH_BEGIN is a
   BATCH_RANGES, a CHECKPOINT_BEGIN and the batch's FETCH_REPLAYs in one request.
8. Savepoints (ftlayer.checkpoint.savepoint): SAVEPOINT first deletes the completed
   records not deleted yet, under the lock (FTLayer.flush_deletes), and waits for those
   the deleter took before, so the store holds exactly the records whose trees are not
   complete (and those of persists under way: replayed after a restore); then, outside
   the lock, it copies the store (one LMDB read transaction: the store at one instant)
   into the requested directory on this host, or into its spool (`<data dir>/
   savepoint-spool`, one part at a time) for the client to fetch by chunks with
   SAVEPOINT_READ (ftlayer.checkpoint.fetch), and replies with the savepoint's manifest.
   Every request goes on meanwhile, writes included (LmdbStorage.copy_to; only a write
   that must grow the LMDB map waits for the copy to end). One savepoint at a time: a
   SAVEPOINT that arrives while one is being written is refused (ERROR 102) rather than
   queued.

A non-loopback host without a token is refused (ConfigError): the token is the only
thing between the network and the acker table. With `tls_cert` and `tls_key` every
connection is TLS (the ssl module; TLS 1.2 at least): the handshake runs in the
connection's own thread within `handshake_timeout_s`, and a client whose first byte
does not start a TLS handshake gets ERROR 104 (TLS_REQUIRED) in plain bytes, is logged
and closed, so it can say that it lacks the CA instead of seeing a closed connection.
The token still authenticates the client; TLS keeps the records and ids private on the
wire and proves the server's identity to clients that check its certificate.

With `http_port`, an HTTP port (ftlayer.web) serves Prometheus metrics at /metrics and
a live status page at /, read-only: it reads the core under the lock as STATUS does
(`observe`) and changes nothing. It binds `http_host`, loopback by default. With a
token every HTTP request must carry it (bearer or basic auth; ftlayer.web.http). A
non-loopback `http_host` needs the token and TLS (HTTP sends the token itself, not a
proof of it, so only over TLS; the HTTP port then speaks HTTPS), or `http_public`:
then anyone who reaches the port reads the counters, source registrations and the dead
letters' coordinates and causes (never a payload), and nothing more, since nothing
there changes the server.

The package, by role: `state` (the configuration, checked when a server is made, and
what every role shares: the lock around the core, the deleter's and the requests'
counters, the connections), `transport` (items 1, 2 and 4: accepting, TLS, a
connection's conversation, the handshake, refusing), `handlers` (items 3, 7 and 8: the
table from kind to handler and each handler; the HTTP port's reads), `workers` (items
5, 6 and 7: the ticker, the deleter and the checkpoint writer) and `process` (`FTServer`:
start and stop, the data dir's serve lock).
"""

from ftlayer.server.process import SERVE_LOCK_FILE, FTServer

__all__ = ["SERVE_LOCK_FILE", "FTServer"]
