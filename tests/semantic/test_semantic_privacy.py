"""No reply carries another request's text (issue 13, CONTRACT.md "Semantic cache replies").

A semantic entry is named to clients by an opaque id only: ``x-carpool-entry`` on a semantic hit,
``x-carpool-semantic-nearest`` in ``semantic.mode: mark``. The id is keyed with a secret of the
process, so it can neither be reversed to the prompt nor confirmed by hashing a guess.
"""

from __future__ import annotations

import hashlib
import logging
import re
from urllib.parse import quote

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")

from fakes.waiting import eventually  # noqa: E402

SECRET = "How do I reset my router with the serial number ZX-778?"
PARAPHRASE = "how can i reset my router with the serial number ZX-778"
OPAQUE = re.compile(r"[0-9a-f]{24}")


def headers_of(tenant: int) -> dict[str, str]:
    return {"Authorization": f"Bearer tenant-{tenant}", "x-carpool-namespace": "kb"}


async def ask(gw, content: str, tenant: int):
    response = await gw.client.post(
        "/v1/chat/completions",
        headers=headers_of(tenant),
        json={"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]},
    )
    assert response.status_code == 200, response.text
    return response


def leaks(response, text: str) -> bool:
    """Whether any header or the body carries ``text`` (or its wording, which the paraphrase
    does not share: "How do I"), plain or quoted."""
    pieces = {text, quote(text), quote(text, safe=""), "How do I", quote("How do I")}
    everything = " ".join(f"{k}: {v}" for k, v in response.headers.items()) + response.text
    return any(piece in everything for piece in pieces)


def guessable_digests(text: str) -> set[str]:
    data = text.encode()
    return {
        hashlib.sha256(data).hexdigest(),
        hashlib.md5(data).hexdigest(),
        hashlib.sha1(data).hexdigest(),
        hashlib.blake2b(data, digest_size=12).hexdigest(),
        hashlib.blake2b(data, digest_size=16).hexdigest(),
    }


async def test_mark_mode_never_sends_another_requests_text(fake, gateway_with, caplog):
    async with gateway_with(
        semantic={"enabled": True, "mode": "mark"}, tenant={"shared_namespaces": ["kb"]}
    ) as gw:
        await ask(gw, "Hello there, are you up?", tenant=2)  # tenant 2 is a known client
        await ask(gw, SECRET, tenant=1)
        await eventually(lambda: gw.gateway.semantic.entries >= 2, what="the semantic inserts")
        with caplog.at_level(logging.DEBUG, logger="carpool"):
            response = await ask(gw, PARAPHRASE, tenant=2)
        assert response.headers["x-carpool"] == "miss"
        nearest = response.headers["x-carpool-semantic-nearest"]
        assert OPAQUE.fullmatch(nearest)
        assert nearest not in guessable_digests(SECRET)
        assert response.headers["x-carpool-semantic-verdict"]
        assert float(response.headers["x-carpool-similarity"]) > 0.8
        assert not leaks(response, SECRET)
        # The text is for the operator's debug log only.
        assert any(
            SECRET in record.getMessage()
            for record in caplog.records
            if record.levelno == logging.DEBUG
        )
        assert not any(
            SECRET in record.getMessage()
            for record in caplog.records
            if record.levelno > logging.DEBUG
        )


async def test_a_semantic_hit_names_its_entry_by_an_opaque_id(fake, gateway_with):
    async with gateway_with(semantic={"enabled": True}, tenant={"shared_namespaces": ["kb"]}) as gw:
        await ask(gw, "Hello there, are you up?", tenant=2)
        await ask(gw, SECRET, tenant=1)
        await eventually(lambda: gw.gateway.semantic.entries >= 2, what="the semantic inserts")
        hit = await ask(gw, PARAPHRASE, tenant=2)
        assert hit.headers["x-carpool"] == "semantic-hit"
        entry = hit.headers["x-carpool-entry"]
        assert OPAQUE.fullmatch(entry) and entry not in guessable_digests(SECRET)
        # The same entry, served again to another paraphrase, has the same id.
        again = await ask(gw, "How can I reset my router with the serial number ZX-778?", tenant=2)
        assert again.headers["x-carpool"] == "semantic-hit"
        assert again.headers["x-carpool-entry"] == entry
        assert "x-carpool-semantic-nearest" not in hit.headers
