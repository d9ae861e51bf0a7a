"""The OpenAPI 3 document of the gateway's own HTTP surface, served at ``GET /openapi.json``.

Contract:
- It describes what the gateway itself accepts and answers: the cached endpoints (chat,
  completions, embeddings, OpenAI's Responses API, Anthropic's Messages API; their main request
  fields, the cache-control headers, the idempotency key, every status the gateway
  produces), the control endpoints (``/healthz``, ``/readyz``, ``/stats``, ``/metrics``,
  ``/dashboard``, ``/openapi.json``) and ``POST /admin/invalidate``. Upstream errors pass through with the
  upstream's status and body: that is the ``default`` response of the cached endpoints.
- Request schemas name the main OpenAI fields and allow any other (``additionalProperties``):
  the gateway passes unknown fields through (and fingerprints them). The limits stated in it
  (header value lengths, number of tags, idempotency key length) are the ones ``request.py`` and
  ``idempotency.py`` enforce: they come from the same constants.
- Built once per process (``document()``), as plain JSON-able data; nothing here runs per request.
"""

from __future__ import annotations

import functools
from typing import Any

from .idempotency import MAX_KEY_LENGTH
from .outcome import Outcome
from .request import MAX_HEADER_TOKEN, MAX_TAGS

__all__ = ["document"]

OPENAPI_VERSION = "3.0.3"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_HEADER_PARAMETERS: list[dict[str, Any]] = [
    {
        "name": "Cache-Control",
        "in": "header",
        "required": False,
        "description": "`no-cache`, `no-store`, `max-age=N` (seconds), comma-separated.",
        "schema": {
            "type": "string",
            "enum": ["no-cache", "no-store", "max-age=0", "max-age=60", "no-cache, max-age=10"],
        },
    },
    {
        "name": "x-carpool-namespace",
        "in": "header",
        "required": False,
        "description": f"A separate cache partition (at most {MAX_HEADER_TOKEN} printable "
        "characters).",
        "schema": {"type": "string", "maxLength": MAX_HEADER_TOKEN},
    },
    {
        "name": "x-carpool-type",
        "in": "header",
        "required": False,
        "description": "The request type: picks a TTL policy (`translation`, `faq`, `code`, "
        "`realtime`, `factual` or a configured one).",
        "schema": {"type": "string", "maxLength": MAX_HEADER_TOKEN},
    },
    {
        "name": "x-carpool-tags",
        "in": "header",
        "required": False,
        "description": f"Comma-separated tags stored with the answer, for invalidation (at most "
        f"{MAX_TAGS} tags of at most {MAX_HEADER_TOKEN} printable characters).",
        "schema": {"type": "string", "maxLength": 1024},
    },
    {
        "name": "x-carpool-freshness",
        "in": "header",
        "required": False,
        "description": "A version token: an answer stored under one token is never served to a "
        "request carrying another.",
        "schema": {"type": "string", "maxLength": MAX_HEADER_TOKEN},
    },
    {
        "name": "x-carpool-share",
        "in": "header",
        "required": False,
        "description": "`sampled`: a sampled request shares with identical-parameter requests.",
        "schema": {"type": "string", "enum": ["sampled"]},
    },
    {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": f'A structured-field string (`"..."`) or bare printable ASCII, 1 to '
        f"{MAX_KEY_LENGTH} characters; scoped by tenant. `X-Idempotency-Key` is an "
        "alias.",
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
    },
]

_OUTCOME_HEADER = {
    "x-carpool": {
        "description": "What the gateway did with the request.",
        "schema": {"type": "string", "enum": [o.value for o in Outcome]},
    },
}


_CHUNKS = 'One event: `data` is a chunk (JSON), or `[DONE]` last, or an `{"error": ...}` object.'


def _typed_events(last: str) -> str:
    return (
        f"One typed event: `event` names it and `data` is its JSON object, whose `type` is "
        f"the same name. No `[DONE]`: the stream ends with `{last}`, or with an `error` "
        "event when it failed."
    )


def _cached_endpoint(
    summary: str,
    request: str,
    answer: str,
    streams: bool,
    events: str = _CHUNKS,
    error_schema: str = "Error",
) -> dict[str, Any]:
    ok_content: dict[str, Any] = {"application/json": {"schema": _ref(answer)}}
    if streams:
        ok_content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": events,
                "required": ["data"],
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            }
        }
    errors = {
        "400": (
            "The body is not valid JSON, not an object, nested deeper than "
            "`limits.max_json_depth`, or a field has the wrong type; or a cache-control "
            "header or the Idempotency-Key is malformed (problem+json)."
        ),
        "408": "The body did not arrive within `limits.body_read_timeout` seconds.",
        "409": "A request with the same Idempotency-Key is still being processed.",
        "413": "The body is larger than `limits.max_body_bytes`.",
        "422": "The Idempotency-Key was already used with a different request.",
        "431": "The headers are larger than `limits.max_header_bytes`.",
        "502": (
            "The upstream is unreachable, or its stream broke (for a non-streaming "
            "client: a streaming one gets a 200 and an SSE error event); a broken stream "
            "carries `x-should-retry: false`."
        ),
        "504": "The upstream did not answer within `limits.upstream_timeout`.",
    }
    responses: dict[str, Any] = {
        "200": {
            "description": "The answer (SSE when `stream` is true).",
            "headers": {
                **_OUTCOME_HEADER,
                "age": {
                    "description": "On hits: seconds since the answer was produced.",
                    "schema": {"type": "integer"},
                },
                "idempotent-replayed": {
                    "description": "`true` on a replayed response.",
                    "schema": {"type": "string"},
                },
                "x-carpool-usage": {
                    "description": "`missing`: the answer has no `usage` "
                    "because the upstream reported none (it ignored "
                    "`stream_options.include_usage`); none is invented.",
                    "schema": {"type": "string", "enum": ["missing"]},
                },
            },
            "content": ok_content,
        }
    }
    for status, description in errors.items():
        content: dict[str, Any] = {"application/json": {"schema": _ref(error_schema)}}
        if status in ("400", "409", "422"):
            content["application/problem+json"] = {"schema": _ref("Problem")}
        responses[status] = {
            "description": description,
            "headers": _OUTCOME_HEADER,
            "content": content,
        }
    responses["default"] = {
        "description": "An upstream error, passed through as it is.",
        "headers": _OUTCOME_HEADER,
    }
    return {
        "post": {
            "summary": summary,
            "parameters": _HEADER_PARAMETERS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": responses,
        }
    }


_TEXT_OR_TOKENS: dict[str, Any] = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        {
            "type": "array",
            "minItems": 1,
            "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        },
    ]
}

_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "max_tokens": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stop": {
        "oneOf": [{"type": "string"}, {"type": "array", "maxItems": 4, "items": {"type": "string"}}]
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number"}},
    "logprobs": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": "string", "nullable": True},
                    "param": {"type": "string", "nullable": True},
                },
            }
        },
    },
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details (idempotency errors).",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {
                "type": "string",
                "enum": ["system", "developer", "user", "assistant", "tool"],
            },
            "content": {
                "nullable": True,
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
                        },
                    },
                ],
            },
            "name": {"type": "string"},
            "tool_call_id": {"type": "string"},
            "tool_calls": {"type": "array", "items": {"type": "object"}},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "additionalProperties": True,
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "response_format": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}
                },
            },
            "tools": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            },
            "tool_choice": {
                "oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {"type": "object"},
                ]
            },
            "metadata": {"type": "object"},
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "additionalProperties": True,
        "properties": {
            **_SAMPLING,
            "prompt": _TEXT_OR_TOKENS,
            "echo": {"type": "boolean"},
            "suffix": {"type": "string"},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["model", "input"],
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string"},
            "input": _TEXT_OR_TOKENS,
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1, "maximum": 4096},
            "user": {"type": "string"},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object", "nullable": True},
        },
    },
    "Completion": {
        "type": "object",
        "required": ["choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object", "nullable": True},
        },
    },
    "EmbeddingList": {
        "type": "object",
        "required": ["data"],
        "properties": {
            "object": {"type": "string"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object", "nullable": True},
        },
    },
    "ResponseRequest": {
        "type": "object",
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string"},
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "role": {
                                    "type": "string",
                                    "enum": ["user", "assistant", "system", "developer"],
                                },
                                "type": {"type": "string"},
                                "content": {
                                    "oneOf": [
                                        {"type": "string"},
                                        {
                                            "type": "array",
                                            "items": {
                                                "type": "object",
                                                "required": ["type"],
                                                "properties": {
                                                    "type": {"type": "string"},
                                                    "text": {"type": "string"},
                                                },
                                            },
                                        },
                                    ]
                                },
                            },
                        },
                    },
                ]
            },
            "instructions": {"type": "string"},
            "temperature": _SAMPLING["temperature"],
            "top_p": _SAMPLING["top_p"],
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "stream": {"type": "boolean"},
            "background": {"type": "boolean"},
            "store": {"type": "boolean"},
            "previous_response_id": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]},
            "text": {"type": "object"},
            "reasoning": {"type": "object"},
            "metadata": {"type": "object"},
        },
    },
    "Response": {
        "type": "object",
        "required": ["output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "status": {"type": "string"},
            "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object", "nullable": True},
        },
    },
    "MessageRequest": {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string"},
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"type": "string", "enum": ["user", "assistant"]},
                        "content": {
                            "oneOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["type"],
                                        "properties": {
                                            "type": {"type": "string"},
                                            "text": {"type": "string"},
                                        },
                                    },
                                },
                            ]
                        },
                    },
                },
            },
            "system": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]
            },
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": _SAMPLING["top_p"],
            "top_k": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "stream": {"type": "boolean"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"type": "object"},
            "thinking": {"type": "object"},
            "metadata": {"type": "object"},
        },
    },
    "Message": {
        "type": "object",
        "required": ["content"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string"},
            "role": {"type": "string"},
            "model": {"type": "string"},
            "content": {"type": "array", "items": {"type": "object"}},
            "stop_reason": {"type": "string", "nullable": True},
            "usage": {"type": "object"},
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "description": "Anthropic's error shape, on /v1/messages.",
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
    "Invalidate": {
        "description": "Exactly one selector: a tag, a namespace, a prompt prefix, or all.",
        "oneOf": [
            {
                "type": "object",
                "required": ["tag"],
                "additionalProperties": False,
                "properties": {"tag": {"type": "string", "minLength": 1}},
            },
            {
                "type": "object",
                "required": ["namespace"],
                "additionalProperties": False,
                "properties": {"namespace": {"type": "string", "minLength": 1}},
            },
            {
                "type": "object",
                "required": ["prefix"],
                "additionalProperties": False,
                "properties": {"prefix": {"type": "string", "minLength": 1}},
            },
            {
                "type": "object",
                "required": ["all"],
                "additionalProperties": False,
                "properties": {"all": {"type": "boolean", "enum": [True]}},
            },
        ],
    },
}


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI document (built once; do not mutate it)."""
    error = _ref("Error")
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
            "/v1/chat/completions": _cached_endpoint(
                "Chat completion (cached, coalesced)",
                "ChatCompletionRequest",
                "ChatCompletion",
                streams=True,
            ),
            "/v1/completions": _cached_endpoint(
                "Text completion (cached, coalesced)",
                "CompletionRequest",
                "Completion",
                streams=True,
            ),
            "/v1/embeddings": _cached_endpoint(
                "Embeddings (cached, coalesced, batched)",
                "EmbeddingRequest",
                "EmbeddingList",
                streams=False,
            ),
            "/v1/responses": _cached_endpoint(
                "OpenAI Responses API (cached, coalesced; `background` and `conversation` "
                "pass through unshared; `GET /v1/responses/{id}` passes through)",
                "ResponseRequest",
                "Response",
                streams=True,
                events=_typed_events(
                    "response.completed` (or `response.incomplete`, `response.failed"
                ),
            ),
            "/v1/messages": _cached_endpoint(
                "Anthropic Messages API (cached, coalesced; errors in Anthropic's shape)",
                "MessageRequest",
                "Message",
                streams=True,
                events=_typed_events("message_stop"),
                error_schema="AnthropicError",
            ),
            "/healthz": {
                "get": {
                    "summary": "200 while the gateway serves",
                    "responses": {
                        "200": _json(
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
                        "200": _json(ready, "Ready."),
                        "503": _json(ready, "No replica is believed reachable."),
                    },
                }
            },
            "/stats": {
                "get": {
                    "summary": "JSON counters",
                    "security": admin,
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": [
                                    "requests",
                                    "hits",
                                    "semantic_hits",
                                    "coalesced",
                                    "misses",
                                    "bypass",
                                    "upstream_calls",
                                    "upstream_errors",
                                    "tokens_saved",
                                    "saved_fraction",
                                    "layers",
                                    "replicas",
                                ],
                            },
                            "The counters.",
                        ),
                        "401": _json(error, "An admin token is configured and was not given."),
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
                        "401": _json(error, "An admin token is configured and was not given."),
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
                        "401": _json(error, "An admin token is configured and was not given."),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
                }
            },
            "/admin/invalidate": {
                "post": {
                    "summary": "Drop the matching answers from every layer",
                    "security": [{"adminToken": []}],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("Invalidate")}},
                    },
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["invalidated"],
                                "properties": {"invalidated": {"type": "integer", "minimum": 0}},
                            },
                            "How many answers were dropped.",
                        ),
                        "400": _json(error, "Not exactly one valid selector, or not JSON."),
                        "401": _json(error, "The admin token is missing or wrong."),
                        "404": _json(error, "No admin token is configured: admin is disabled."),
                    },
                }
            },
        },
        "components": {
            "schemas": _SCHEMAS,
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
