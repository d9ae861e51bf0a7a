"""Upstreams over TLS, with a test CA made by the ``openssl`` CLI (no Python dependency).

    certs = make_certs(tmp_path)                 # a CA, and server certificates it signed
    monkeypatch.setenv("SSL_CERT_FILE", certs.ca)  # the gateway trusts it, as a user would
    async with serve_tls(FakeUpstream(), certs) as url:   # "https://127.0.0.1:PORT"
        ...

Details:
- ``make_certs(directory)``: ``ca`` (the CA's PEM), and a certificate and key per name
  (``certs.cert(name)``, ``certs.key(name)``): ``good`` (``DNS:localhost``, ``IP:127.0.0.1``,
  and ``DNS:upstream.test``, a name only a test proxy knows: ``fakes.proxy``),
  ``other`` (``DNS:other.example`` only: a hostname mismatch at 127.0.0.1), ``selfsigned``
  (names right, signed by itself: an unknown issuer). ``openssl`` missing skips the test, as
  the README's test command on a machine without it should pass; with ``REQUIRE_OPENSSL`` set
  (``.ci/run`` installs it and sets it) it fails the test instead.
- The gateway reads the trust the way a user gives it: ``SSL_CERT_FILE`` in the environment
  (set before its first call to the replica, ``upstream.http``'s ``_trust``).
- ``serve_tls(app, certs, name)``: an ASGI app (``fakes.upstream``) served over TLS by
  uvicorn in the current loop (``fakes.serving``); yields its https URL (no /v1).
- ``EndlessStream``: an upstream that answers every request with an SSE stream that never
  ends, and writes without ever reading (an engine that notices a gone caller only when a
  write fails), each connection in a thread of its own. ``gone`` is set once a connection's
  peer is seen gone, ``how`` says how: ``"close_notify"`` (the peer closed TLS cleanly and
  keeps its socket open for the reply) or ``"dropped"`` (the TCP connection ended or was
  reset: the next write fails). ``started`` counts the streams begun (set ``streaming``).
"""

from __future__ import annotations

import contextlib
import json
import select
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fakes.required import missing
from fakes.serving import serve_app_with_server

__all__ = ["Certs", "EndlessStream", "endless_stream", "make_certs", "serve_tls"]


@dataclass(frozen=True)
class Certs:
    directory: Path

    @property
    def ca(self) -> str:
        return str(self.directory / "ca.pem")

    def cert(self, name: str) -> str:
        return str(self.directory / f"{name}.pem")

    def key(self, name: str) -> str:
        return str(self.directory / f"{name}.key")

    def server_context(self, name: str = "good") -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert(name), self.key(name))
        return context


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(directory: Path) -> Certs:
    """A test CA and the server certificates it signed (see the module's doc), in
    ``directory``."""
    if shutil.which("openssl") is None:
        missing(
            "the TLS tests need the openssl command (Debian's openssl package)", "REQUIRE_OPENSSL"
        )
    key = ("-newkey", "rsa:2048", "-nodes")
    _openssl(
        "req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=carpool test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    good = "DNS:localhost,DNS:upstream.test,IP:127.0.0.1"
    for name, names in (("good", good), ("other", "DNS:other.example")):
        _openssl(
            "req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
            cwd=directory,
        )  # fmt: skip
        (directory / f"{name}.ext").write_text(
            f"subjectAltName={names}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        )
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
            cwd=directory,
        )  # fmt: skip
    _openssl(
        "req", "-x509", *key, "-keyout", "selfsigned.key", "-out", "selfsigned.pem",
        "-days", "2", "-subj", "/CN=localhost",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        cwd=directory,
    )  # fmt: skip
    return Certs(directory)


@contextlib.asynccontextmanager
async def serve_tls(app: Any, certs: Certs, name: str = "good") -> AsyncIterator[str]:
    """``app`` served over TLS with certificate ``name``; yields ``https://127.0.0.1:PORT``."""
    async with serve_app_with_server(
        app, ssl_certfile=certs.cert(name), ssl_keyfile=certs.key(name)
    ) as served:
        yield f"https://127.0.0.1:{served.port}"


def _event(i: int) -> bytes:
    chunk = {
        "id": "chatcmpl-endless",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}],
    }
    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return b"%x\r\n" % len(data) + data + b"\r\n"


class EndlessStream:
    """See the module's doc."""

    def __init__(self, certs: Certs) -> None:
        self.context = certs.server_context()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.streaming = threading.Event()
        self.gone = threading.Event()
        self.how = ""
        self.started = 0
        self.stop = threading.Event()

    def accept_forever(self) -> None:
        self.listener.settimeout(0.1)  # (to see ``stop``: a close does not wake an accept)
        while not self.stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self.serve, args=(raw,), daemon=True).start()

    def serve(self, raw: socket.socket) -> None:
        try:
            # A ragged end (TCP closed without close_notify) raises, told apart from a clean one.
            conn = self.context.wrap_socket(raw, server_side=True, suppress_ragged_eofs=False)
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            fields, _, body = head.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in fields.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            self.started += 1
            self.streaming.set()
        except (OSError, StopIteration):
            raw.close()
            return
        i = 0
        try:
            while not self.stop.is_set():
                conn.sendall(_event(i))
                i += 1
                # Nothing is read but to see the peer gone (the gateway sends nothing more):
                # the wait for it paces the events too.
                readable, _, _ = select.select([conn], [], [], 0.05)
                if readable:
                    self._seen_gone("close_notify" if conn.recv(65536) == b"" else "sent more")
                    return
        except (OSError, ssl.SSLError):  # (SSLEOFError, a reset, a write that failed: EPIPE)
            self._seen_gone("dropped")
        finally:
            conn.close()

    def _seen_gone(self, how: str) -> None:
        if not self.gone.is_set():
            self.how = how
            self.gone.set()


@contextlib.contextmanager
def endless_stream(certs: Certs) -> Iterator[EndlessStream]:
    upstream = EndlessStream(certs)
    thread = threading.Thread(target=upstream.accept_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        upstream.stop.set()
        upstream.listener.close()
        thread.join(5)
