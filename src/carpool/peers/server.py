"""A worker's door for its peers: its own gateway app, on its slot's unix socket.

Contract:
- ``PeerApp`` wraps the worker's ``GatewayApp``: a request that carries the run's secret in
  ``x-carpool-peer`` (compared in constant time) is marked as a peer's (``scope[PEER]``), which
  the app reads as "another worker chose this one: lead it here, never forward it again"
  (``ClientRequest.peer``, ``Gateway``), on ``/admin/invalidate`` as "do not pass it on", and
  as "not held to ``limits.max_header_bytes`` again" (``server.GatewayApp``: its worker measured
  the client's own headers, and the hop adds its own). The header is dropped from the scope
  either way, so nothing below ever sees it. Any other request through this door is served as
  a client's: the socket sits in a 0700 directory, and the secret is the second lock.
- Header values that are not ASCII come percent-encoded, their names listed in
  ``x-carpool-peer-raw`` (the asking worker's HTTP client would send them as UTF-8, not as the
  bytes the client sent): a peer's request gets them back byte for byte. That header too is
  dropped either way, and read only from a peer.
- The client's ``Connection`` header comes as ``x-carpool-peer-connection`` (the headers it
  lists come too: the worker that asked read them, a control, a credential, an
  Idempotency-Key, and so must the owner), and becomes the request's ``Connection`` again: the
  owner forwards none of what it lists. Dropped either way, read only from a peer.
- The public port never marks a request as a peer's (``GatewayApp`` reads only the scope key,
  which only this wrapper sets): a client's ``x-carpool-peer`` is never trusted.
- ``PeerServer``: uvicorn's HTTP protocol (the stack of the public port) on the unix socket,
  started once the worker's layers are (its lifespan), closed gracefully with them.
"""

from __future__ import annotations

import hmac
import math
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

# The scope key that marks a request as a peer's: set here only.
PEER = "carpool.peer"
PEER_HEADER = b"x-carpool-peer"
# The headers whose values a peer sent percent-encoded (``workers.Peers``), by name.
RAW_HEADER = b"x-carpool-peer-raw"
# The client's own ``Connection`` header, which the hop's HTTP client would not send as it came.
CONNECTION_HEADER = b"x-carpool-peer-connection"


class PeerApp:
    """``app`` for the worker's peers (see the module's contract)."""

    def __init__(self, app: Any, secret: bytes, on_request: Any = None) -> None:
        self.app = app
        self.secret = secret
        self.on_request = on_request  # (told of each peer's request to a cached endpoint)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = raw = connection = b""
            kept = []
            for name, value in scope["headers"]:
                if name == PEER_HEADER:
                    given = value
                elif name == RAW_HEADER:
                    raw = value
                elif name == CONNECTION_HEADER:
                    connection = value
                else:
                    kept.append((name, value))
            trusted = bool(given) and hmac.compare_digest(given, self.secret)
            if trusted and raw:
                encoded = set(raw.split(b","))
                kept = [(n, unquote_to_bytes(v) if n in encoded else v) for n, v in kept]
            if trusted and connection:
                kept = [(n, v) for n, v in kept if n != b"connection"]  # (the hop's own)
                kept.append((b"connection", connection))
            scope = {**scope, "headers": kept, PEER: trusted}
            if trusted and self.on_request is not None:
                self.on_request(scope)
        await self.app(scope, receive, send)


class PeerServer:
    """The worker's gateway on its unix socket, for its peers."""

    def __init__(self) -> None:
        self._server: Any = None

    async def start(self, app: Any, path: Path, grace_s: float, keepalive_s: float) -> None:
        """``keepalive_s``: how long an idle connection from a peer is kept (its client keeps
        one for less: ``PeerWorkers``), as the public listener keeps a client's."""
        import uvicorn

        config = uvicorn.Config(
            app,
            uds=str(path),
            lifespan="off",  # (the public server's lifespan starts and closes the gateway)
            access_log=False,
            log_config=None,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=math.ceil(grace_s),
            # (uvicorn's 5 s was under aiohttp's 15 s: a race. A float works: call_later.)
            timeout_keep_alive=keepalive_s,  # type: ignore[arg-type]
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # as uvicorn's own ``serve`` sets it
        await server.startup()
        self._server = server

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown()
