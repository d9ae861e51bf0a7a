"""Everything carpool keeps in Redis/Valkey, and the only package that imports the client library.

- :mod:`.connection`: the client and its pool, error translation, the ``Health`` protocol;
- :mod:`.store`: the shared exact cache (entries, indexes, stats);
- :mod:`.flights`: cross-instance single-flight (locks, leases, frame streams);
- :mod:`.invalidation`: the pub/sub channel that carries invalidations to every instance;
- :mod:`.semantic`: semantic entries shared through a stream;
- :mod:`.idempotency`: idempotency records.

Each module keeps its own protocol (its keys, scripts and failure rules at its top); what they
share (connecting, translating errors, one degraded state per instance) lives in
:mod:`.connection`. The in-process fallback when Redis is down is ``store.shared.SharedStore``.
"""
