"""Everything carpool keeps in Redis/Valkey, and the only package that imports the client library.

- :mod:`.connection`: the client and its pool, error translation, the ``Health`` protocol;
- :mod:`.keys`: what the layers share about key names (prefix, IDs, digests, SCAN patterns);
- :mod:`.store`: the shared exact cache (entries, indexes, stats); its key layout, encoding and
  scripts: :mod:`.store_layout`;
- :mod:`.flights`: cross-instance single-flight (locks, leases, frame streams); its keys,
  scripts and records: :mod:`.flight_protocol`; the follower's relay: :mod:`.flight_relay`;
- :mod:`.invalidation`: the pub/sub channel that carries invalidations to every instance;
- :mod:`.semantic`: semantic entries shared through a stream;
- :mod:`.idempotency`: idempotency records;
- :mod:`.permissions`: what an ACL user must be allowed, checked at ``carpool serve``'s start.

Each module keeps its own protocol (its keys, scripts and failure rules at its top); what they
share (connecting, translating errors, one degraded state per instance) lives in
:mod:`.connection`. The one health every layer asks and tells is ``store.shared.SharedStore``'s,
which is also the exact cache's way down to this process's memory; the idempotency records'
way down (``idempotency.fallback``) follows that health.
"""
