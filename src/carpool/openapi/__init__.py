"""The OpenAPI 3 document of the gateway's own HTTP surface, served at ``GET /openapi.json``.

Contract:
- It describes what the gateway itself accepts and answers: the cached endpoints (chat,
  completions, embeddings, OpenAI's Responses API, Anthropic's Messages API; their main request
  fields, the cache-control headers, the idempotency key, every status the gateway
  produces), the control endpoints (``/healthz``, ``/readyz``, ``/stats``, ``/metrics``,
  ``/dashboard``, ``/openapi.json``) and the ``/admin/*`` endpoints. Upstream errors pass through with the
  upstream's status and body: that is the ``default`` response of the cached endpoints.
- Request schemas name the main OpenAI fields and allow any other (``additionalProperties``):
  the gateway passes unknown fields through (and fingerprints them). The limits stated in it
  (header value lengths, number of tags, idempotency key length) are the ones ``request.py`` and
  ``idempotency.py`` enforce: they come from the same constants.
- Built once per process (``document()``), as plain JSON-able data; nothing here runs per request.

Here the assembly: every path and the security schemes. The component schemas are in
``openapi.schemas``, the operation the cached endpoints share in ``openapi.operations``: Python
rather than a shipped JSON file, because the limits and the ``x-carpool`` values are read from the
code's own constants, and the APIs share parts (the sampling fields, the error responses).
"""

from __future__ import annotations

import functools
from typing import Any

from ..metrics import IDEMPOTENCY_FIGURES
from .operations import cached_endpoint, json_response, typed_events
from .schemas import SCHEMAS, ref

__all__ = ["document"]

OPENAPI_VERSION = "3.0.3"


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document (built once; do not mutate it)."""
    error = ref("Error")
    # With an admin token configured; open (the empty requirement) without one.
    admin: list[dict[str, list[str]]] = [{"adminToken": []}, {"adminBasic": []}, {}]
    replicas = {
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "required": ["healthy", "state"],
            "properties": {
                "healthy": {"type": "boolean"},
                "state": {"type": "string", "enum": ["healthy", "probing", "down"]},
                "failures": {"type": "integer", "minimum": 0},
            },
        },
    }
    ready = {
        "type": "object",
        "required": ["ready", "replicas"],
        "properties": {"ready": {"type": "boolean"}, "replicas": replicas},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "carpool gateway",
            "version": "1",
            "description": "An OpenAI-compatible gateway that deduplicates LLM inference: "
            "exact cache, single-flight coalescing, semantic cache.",
        },
        "paths": {
            "/v1/chat/completions": cached_endpoint(
                "Chat completion (cached, coalesced)",
                "ChatCompletionRequest",
                "ChatCompletion",
                streams=True,
            ),
            "/v1/completions": cached_endpoint(
                "Text completion (cached, coalesced)",
                "CompletionRequest",
                "Completion",
                streams=True,
            ),
            "/v1/embeddings": cached_endpoint(
                "Embeddings (cached, coalesced, batched)",
                "EmbeddingRequest",
                "EmbeddingList",
                streams=False,
            ),
            "/v1/responses": cached_endpoint(
                "OpenAI Responses API (cached, coalesced; `background` and `conversation` "
                "pass through unshared; `GET /v1/responses/{id}` passes through)",
                "ResponseRequest",
                "Response",
                streams=True,
                events=typed_events(
                    "response.completed` (or `response.incomplete`, `response.failed"
                ),
            ),
            "/v1/messages": cached_endpoint(
                "Anthropic Messages API (cached, coalesced; errors in Anthropic's shape)",
                "MessageRequest",
                "Message",
                streams=True,
                events=typed_events("message_stop"),
                error_schema="AnthropicError",
            ),
            "/healthz": {
                "get": {
                    "summary": "200 while the gateway serves",
                    "responses": {
                        "200": json_response(
                            {
                                "type": "object",
                                "required": ["status", "replicas", "redis"],
                                "properties": {
                                    "status": {"type": "string", "enum": ["ok", "degraded"]},
                                    "replicas": replicas,
                                    "redis": {"type": "object"},
                                },
                            },
                            "The gateway serves; degraded: Redis or a replica is down.",
                        )
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": "200 while some replica is reachable",
                    "responses": {
                        "200": json_response(ready, "Ready."),
                        "503": json_response(ready, "No replica is believed reachable."),
                    },
                }
            },
            "/stats": {
                "get": {
                    "summary": "JSON counters",
                    "security": admin,
                    "responses": {
                        "200": json_response(
                            {
                                "type": "object",
                                "required": [
                                    "requests",
                                    "hits",
                                    "semantic_hits",
                                    "coalesced",
                                    "misses",
                                    "bypass",
                                    "rejected",
                                    "abandoned",
                                    "upstream_calls",
                                    "upstream_errors",
                                    "tokens_saved",
                                    "saved_fraction",
                                    "layers",
                                    "replicas",
                                ],
                                "properties": {
                                    # (Left out for a library caller's own records.)
                                    "idempotency": _object(
                                        {
                                            name: {"type": "integer", "minimum": 0}
                                            for name in IDEMPOTENCY_FIGURES
                                        }
                                    ),
                                },
                            },
                            "The counters.",
                        ),
                        "401": json_response(
                            error, "An admin token is configured and was not given."
                        ),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus text format",
                    "security": admin,
                    "responses": {
                        "200": {
                            "description": "The metrics.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": json_response(
                            error, "An admin token is configured and was not given."
                        ),
                    },
                }
            },
            "/dashboard": {
                "get": {
                    "summary": "A live HTML page",
                    "security": admin,
                    "responses": {
                        "200": {
                            "description": "The page.",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        },
                        "401": json_response(
                            error, "An admin token is configured and was not given."
                        ),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {
                        "200": json_response({"type": "object"}, "The OpenAPI document.")
                    },
                }
            },
            "/admin/invalidate": _admin(
                "post",
                "Drop the matching answers from every layer",
                ref("Invalidate"),
                _object({"invalidated": {"type": "integer", "minimum": 0}}),
                "How many answers were dropped: one per copy a layer held (the exact "
                "cache's, the semantic cache's, and this instance's coalescing window's where "
                "no cache keeps the answer).",
                "Not exactly one valid selector, or not JSON.",
            ),
            "/admin/semantic/feedback": _admin(
                "post",
                "Report a wrong semantic hit: its entry is dropped and counts as wrong",
                _object({"entry": {"type": "string", "minLength": 1}}),
                _object(
                    {
                        "dropped": {"type": "boolean"},
                        "namespace": {"type": "string"},
                        "tenant": {"type": "string"},
                    }
                ),
                "The entry was dropped; a wrong hit counts in its error budget (its tenant's, by "
                "label, in its namespace).",
                'No "entry", or not JSON.',
                "No admin token is configured, the semantic cache is off, or no such entry here.",
            ),
            "/admin/semantic/audit": _admin(
                "get",
                "Each namespace's audits of semantic hits, wrong-hit estimate and state, and its "
                "error budgets' by tenant label",
                None,
                {"type": "object", "additionalProperties": ref("SemanticAudit")},
                "By namespace (the default namespace is the empty string).",
            ),
            "/admin/semantic/audit/reset": _admin(
                "post",
                "Put the error budgets of a namespace, a tenant label, both (or all) back to "
                "serving, with no audits",
                {
                    "type": "object",
                    "properties": {"namespace": {"type": "string"}, "tenant": {"type": "string"}},
                    "additionalProperties": False,
                },
                _object({"reset": {"type": "integer", "minimum": 0}}),
                "How many error budgets were reset (on every worker).",
                "Not an object, another key, or a value that is not a string.",
            ),
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "adminToken": {"type": "http", "scheme": "bearer"},
                "adminBasic": {
                    "type": "http",
                    "scheme": "basic",
                    "description": "The admin token as the password (any user): for browsers.",
                },
            },
        },
    }


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": list(properties), "properties": properties}


def _admin(
    method: str,
    summary: str,
    body: dict[str, Any] | None,
    ok: dict[str, Any],
    ok_description: str,
    bad: str | None = None,
    missing: str = "No admin token is configured: admin is disabled.",
) -> dict[str, Any]:
    """An ``/admin/*`` operation: the admin token required (401), absent without one (404)."""
    error = ref("Error")
    responses = {
        "200": json_response(ok, ok_description),
        **({"400": json_response(error, bad)} if bad else {}),
        "401": json_response(error, "The admin token is missing or wrong."),
        "404": json_response(error, missing),
    }
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"adminToken": []}],
        "responses": responses,
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return {method: operation}
