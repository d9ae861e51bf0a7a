"""Gateway-side client keys (``auth.client_keys_file``): who may use the gateway at all.

Contract:
- ``ClientKeys.load(path)``: UTF-8 text (a byte order mark at its start skipped), one key per
  line, the key itself or its SHA-256 in hex (of its
  UTF-8 bytes; ``sha256:`` before it is allowed): a line of 64 hex digits is a digest, so a key
  that is itself 64 hex digits is listed by its digest. Blank lines and lines starting with
  ``#`` are skipped (a ``#`` inside a key is part of it). Only digests are kept in memory (hashed at rest: a key is never held,
  logged or compared as text).
- ``accepts(headers)`` (ASGI header pairs): True when the request presents a listed key in
  ``Authorization: Bearer <key>`` (the scheme in any case: RFC 9110 §11.1), ``api-key`` or
  ``x-api-key`` (the first one present is the one judged). The server answers 401 to any other request to ``/v1/...`` before reading its
  body, so nothing of it is cached, shared or sent upstream.
- Each key stays its own tenant: the tenant is made of the credentials the request presents
  (``identity.py``), the client key among them.
- ``presented_anywhere(token, headers)``: whether any credential header presents ``token``
  (the admin token: the server refuses a ``/v1`` request that does, never sends it upstream).
- ``credentials(authorization, scheme)``: what an ``Authorization`` value carries in ``scheme``,
  the scheme compared in any case; how the client keys and the admin token are read. (The
  tenant is made of the header's value as sent, ``bearer x`` another tenant than ``Bearer x``:
  the upstream may tell them apart.)
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from pathlib import Path

_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_CREDENTIALS = (b"authorization", b"api-key", b"x-api-key")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ClientKeys:
    def __init__(self, digests: Iterable[str]) -> None:
        self._digests = frozenset(d.lower() for d in digests)

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, path: str | Path) -> ClientKeys:
        digests = []
        # (``utf-8-sig``: a byte order mark, as Windows' editors write one, is no part of the
        # first key, which no request would then present.)
        for raw in Path(path).read_text(encoding="utf-8-sig").splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            hexdigest = line.removeprefix("sha256:")
            if _HEX_DIGEST.fullmatch(hexdigest):
                digests.append(hexdigest)
            elif hexdigest != line:
                raise ValueError(f"{path}: a sha256: line needs 64 hex digits")
            else:
                digests.append(digest(line))
        return cls(digests)

    def save(self, path: Path) -> None:
        """Write the keys' digests to a new file at ``path`` (0600), one ``sha256:`` line each,
        which ``load`` reads back as these keys."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.writelines(f"sha256:{hexdigest}\n" for hexdigest in sorted(self._digests))

    def accepts(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        lines = list(headers)
        presented = dict(lines)
        if len(presented) != len(lines) and any(
            sum(1 for name, _ in lines if name == credential) > 1 for credential in _CREDENTIALS
        ):
            return False  # a credential sent twice: which one the upstream reads is a guess
        for name in _CREDENTIALS:
            value = presented.get(name)
            if value is None:
                continue
            key = credentials(value, b"bearer") if name == b"authorization" else value.strip()
            if key is None:
                return False
            # (the raw bytes: a key written in UTF-8 in the file matches as sent)
            return hashlib.sha256(key.strip()).hexdigest() in self._digests
        return False


def credentials(authorization: bytes, scheme: bytes) -> bytes | None:
    """The credentials of an ``Authorization`` value (as sent) in ``scheme`` (lower-case: it
    is compared in any case, RFC 9110 §11.1); None when it is in another scheme."""
    given, _, rest = authorization.strip().partition(b" ")
    if given.lower() != scheme:
        return None
    return rest.lstrip(b" ")


def presents(token: str, authorization: str, basic: bool = False) -> bool:
    """Whether an ``Authorization`` value (as ASGI gives it: the bytes sent, read as latin-1)
    presents ``token`` (compared with its UTF-8, in constant time): as Bearer credentials, or
    with ``basic`` also as a Basic password (a browser's, user name ignored)."""
    sent = authorization.encode("latin-1")
    given = credentials(sent, b"bearer")
    if basic and (encoded := credentials(sent, b"basic")) is not None:
        with contextlib.suppress(binascii.Error, ValueError):
            given = base64.b64decode(encoded, validate=True).partition(b":")[2]
    return bool(given) and hmac.compare_digest(given or b"", token.encode("utf-8"))


def presented_anywhere(token: str, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether any credential header of a request (ASGI header pairs: ``Authorization``,
    ``api-key``, ``x-api-key``) holds ``token``, however it is spelt: the whole value, any word
    of it (a scheme before it, any white space between), or the user name or password of
    Basic credentials. (Where it is refused, never sent upstream, a false alarm costs less.)"""
    wanted = token.encode("utf-8")
    found = False
    for name, value in headers:
        if name.lower() not in _CREDENTIALS:
            continue
        words = value.split()
        if len(words) == 2 and words[0].lower() == b"basic":
            with contextlib.suppress(binascii.Error, ValueError):
                user, _, password = base64.b64decode(words[1], validate=True).partition(b":")
                words += [user, password]
        for word in (value.strip(), *words):
            found |= hmac.compare_digest(word, wanted)  # (every one compared: constant time)
    return found
