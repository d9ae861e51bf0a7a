"""What a simulated replica answers, before any generation: its identity, its endpoints, its
reply type and its errors.

Contract:
- Endpoints (paths relative to ``/v1``; ``strip_v1`` accepts full ``/v1/...`` paths too):
  ``/chat/completions``, ``/completions``, ``/embeddings`` (POST) and ``/models`` (GET). Bodies
  and streamed chunks have OpenAI's shapes; any model name is accepted and echoed. An invalid body
  is a 400 and an unknown path a 404, both in OpenAI's error shape ``{"error": {"message", "type",
  "param", "code"}}``. The Responses API (``POST /responses``) and Anthropic's Messages API
  (``POST /messages``) are served too, as their chat equivalent (``sim_apis.py``: same text, cost
  model, prefix cache and pacing), in their own shapes and typed event streams
  (``SimReply.typed``); their other paths (``/responses/{id}``, ``/messages/count_tokens``) are a
  404 that says so, the latter in Anthropic's error shape ``{"type": "error", "error": {"type":
  "not_found_error", "message"}}``.
- It is labelled as a simulator wherever it appears: ``x-carpool-simulated: true`` in the
  headers of every answer (``JSON_HEADERS``; through the gateway too, which adds it to every
  answer of a cached endpoint it serves in front of the simulator: ``server.py``), and
  ``system_fingerprint: "carpool-sim"`` (``SYSTEM_FINGERPRINT``) in the bodies whose API has
  that field (chat and completions; the Responses, Messages and embeddings shapes have none).
- ``SimReply`` is a JSON body, or (streaming, 200) an async iterator of chunk objects; ``typed``
  chunks are the Responses / Messages APIs' typed events, which have no ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

MODEL_ID = "carpool-sim"
SYSTEM_FINGERPRINT = "carpool-sim"
SIMULATED_HEADER = ("x-carpool-simulated", "true")
JSON_HEADERS = {"content-type": "application/json", SIMULATED_HEADER[0]: SIMULATED_HEADER[1]}

ENDPOINTS = ("/chat/completions", "/completions", "/embeddings", "/responses", "/messages")
SERVED = (
    "it serves POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses "
    "and /v1/messages"
)


@dataclass(slots=True)
class SimReply:
    """A replica's answer: a JSON body, or (streaming, 200) an async iterator of chunk objects."""

    status: int
    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    typed: bool = False  # the chunks are typed events (Responses, Messages): no [DONE]


def error_reply(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> SimReply:
    """An error in OpenAI's shape."""
    return SimReply(
        status, {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def not_found_reply(method: str, path: str) -> SimReply:
    if path.rstrip("/") == "/messages" or path.startswith("/messages/"):
        # A path of Anthropic's Messages API that the simulator does not serve: that API's own
        # error shape, so that its SDK reports a clear NotFoundError.
        return SimReply(
            404,
            {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": f"the simulated engine does not serve {method} /v1{path}: {SERVED}",
                },
            },
        )
    if path.rstrip("/") == "/responses" or path.startswith("/responses/"):
        return error_reply(
            404,
            f"the simulated engine does not serve {method} /v1{path} (of "
            f"the Responses API): {SERVED}",
            code="unknown_url",
        )
    # OpenAI's own wording for a path it does not serve.
    return error_reply(404, f"Invalid URL ({method} /v1{path})")


def strip_v1(path: str) -> str:
    """Accept paths relative to the /v1 base and full ``/v1/...`` paths alike."""
    path = "/" + path.lstrip("/")
    return path[3:] if path.startswith("/v1/") else path
