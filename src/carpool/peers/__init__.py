"""The workers of one ``carpool serve --workers N`` sharing without Redis: every key has an
owner worker, which makes its upstream calls for all of them.

Without ``redis``, each worker has its own exact cache, flights and idempotency records. So that
identical requests arriving at different workers still make one upstream call per key:
- Each worker claims a slot 0..N-1 in the run's private directory (``slots.py``) and
  serves its own gateway to the others on its slot's unix socket (``server.py``).
- The owner of a fingerprint is BLAKE2b(key) mod N (``Peers.owner_of``). A worker about to call
  the upstream for a key it does not own asks the owner instead (``Exchange.fetch``): the
  owner's own path answers (its cache, its flight, at most one upstream call per key), and the
  asking worker relays that answer into its own flight (frame by frame: its own joiners get it
  live) and stores it in its own exact cache, its age kept, so the next identical request is a
  hit where it lands. Hits never cross workers.
- A request with an Idempotency-Key runs whole on the owner of its record's scope (the
  requester and the key), so a retry finds the record on whichever worker it lands.
- ``POST /admin/invalidate`` on any worker is passed on to every other one.
- ``GET /metrics`` on any worker answers the sum of every worker's (``metrics.py``); each
  request is counted by one worker (``carpool.metrics``' contract).
- A peer's request carries the run's secret; only the peer socket trusts it (``PeerApp``). The
  owner leads it itself and never passes it on: no request crosses more than one hop.
- A peer that does not answer never fails a request: the asking worker does the work itself.
- A worker that finds every slot held (uvicorn's SIGHUP starts each new worker before it stops
  the old one; SIGTTIN adds one beyond N) is a client of the owners, owning nothing, until a
  slot frees (``Peers``): it never runs a keyed request on its own.

``Peers`` (``workers.py``) is the layer (``Layers.peers``), built by the worker app
(``server.create_worker_app``) from ``PEERS_VARIABLE``.
"""

from ..config.loader import PEERS_VARIABLE
from .server import PEER, PEER_HEADER, PeerApp
from .slots import (
    Meeting,
    Slot,
    claim,
    meeting,
    parent_directory,
    prepare,
    remove,
    socket_path,
)
from .workers import Peers

__all__ = [
    "PEER",
    "PEERS_VARIABLE",
    "PEER_HEADER",
    "Meeting",
    "PeerApp",
    "Peers",
    "Slot",
    "claim",
    "meeting",
    "parent_directory",
    "prepare",
    "remove",
    "socket_path",
]
