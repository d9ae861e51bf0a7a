"""The operation every cached endpoint shares in the OpenAPI document: the request headers it
reads, the statuses the gateway itself produces, and the answer (JSON, or SSE when streamed).

Contract: the limits stated (header value lengths, number of tags, idempotency key length) are
the ones ``request.py`` and ``idempotency.py`` enforce: they come from the same constants. The
``x-carpool`` header's values are ``Outcome``'s, the request types named are the configuration's
default ones (``carpool.config.DEFAULT_TYPES``). Upstream errors pass through with the upstream's
status and body: that is the ``default`` response.
"""

from __future__ import annotations

from typing import Any

from ..config import DEFAULT_TYPES
from ..idempotency import MAX_KEY_LENGTH
from ..outcome import Outcome
from ..request import MAX_HEADER_TOKEN, MAX_TAGS
from .schemas import ref


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A response with a JSON body of ``schema``."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


HEADER_PARAMETERS: list[dict[str, Any]] = [
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
        "characters, sent as UTF-8: the name `/admin/invalidate` takes).",
        "schema": {"type": "string", "maxLength": MAX_HEADER_TOKEN},
    },
    {
        "name": "x-carpool-type",
        "in": "header",
        "required": False,
        "description": "The request type: picks a TTL policy ("
        + ", ".join(f"`{name}`" for name in DEFAULT_TYPES)
        + " or a configured one).",
        "schema": {"type": "string", "maxLength": MAX_HEADER_TOKEN},
    },
    {
        "name": "x-carpool-tags",
        "in": "header",
        "required": False,
        "description": f"Comma-separated tags stored with the answer, for invalidation (at most "
        f"{MAX_TAGS} tags of at most {MAX_HEADER_TOKEN} printable characters, sent as UTF-8: "
        "the names `/admin/invalidate` takes).",
        "schema": {"type": "string"},  # (its length is the tags': a bound on each, above)
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

OUTCOME_HEADER = {
    "x-carpool": {
        "description": "What the gateway did with the request.",
        "schema": {"type": "string", "enum": [o.value for o in Outcome]},
    },
}


CHUNKS = 'One event: `data` is a chunk (JSON), or `[DONE]` last, or an `{"error": ...}` object.'


def typed_events(last: str) -> str:
    return (
        f"One typed event: `event` names it and `data` is its JSON object, whose `type` is "
        f"the same name. No `[DONE]`: the stream ends with `{last}`, or with an `error` "
        "event when it failed."
    )


def cached_endpoint(
    summary: str,
    request: str,
    answer: str,
    streams: bool,
    events: str = CHUNKS,
    error_schema: str = "Error",
) -> dict[str, Any]:
    ok_content: dict[str, Any] = {"application/json": {"schema": ref(answer)}}
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
            "`limits.max_json_depth`, holds more arrays and objects than "
            "`limits.max_json_containers`, or a field has the wrong type; or a cache-control "
            "header or the Idempotency-Key is malformed (problem+json)."
        ),
        "401": "The request presents no key `auth.client_keys_file` lists (`invalid_api_key`), "
        "or presents the admin token, which is no credential here "
        "(`admin_token_not_a_credential`); nothing was read further or sent upstream.",
        "403": "The `Host` header names the gateway by a name `allowed_hosts` does not hold "
        "(`host_not_allowed`).",
        "408": "The body, or the request line and headers, did not arrive within "
        "`limits.body_read_timeout` seconds.",
        "409": "A request with the same Idempotency-Key is still being processed.",
        "413": "The body is larger than `limits.max_body_bytes`.",
        "422": "The Idempotency-Key was already used with a different request.",
        "414": "The request target is longer than `limits.max_header_bytes`.",
        "415": "The body is sent in a content coding (`Content-Encoding`) other than identity.",
        "431": "The headers (or a chunked body's trailer fields) are larger than "
        "`limits.max_header_bytes`.",
        "501": "The body is sent in a transfer coding other than chunked.",
        "502": (
            "The upstream is unreachable, or dropped the connection after taking the whole "
            "request, or its stream broke (for a non-streaming "
            "client: a streaming one gets a 200 and an SSE error event), or its whole "
            "answer was cut after its head came; a dropped call, a broken stream or a cut "
            "answer carries `x-should-retry: false` (the engine took the call). Also the "
            "upstream's 401 or 403 to the gateway's own key (`upstream.api_key`, or a user and "
            "password in the upstream's URL), its body not relayed, with "
            "`x-should-retry: false`."
        ),
        "503": (
            "The gateway could not take the call now: every connection to the replicas stayed "
            "busy past `limits.upstream_queue_timeout`, or this machine could open none "
            "(`gateway_overloaded`), or the gateway is shutting down (`shutting_down`), or an "
            "Idempotency-Key's shared record could not be reached; with `Retry-After`."
        ),
        "504": (
            "The upstream did not answer within `limits.upstream_timeout` of the call, or "
            "its stream sent no event for that long (for a non-streaming client); with "
            "`x-should-retry: false` once the upstream had the whole call (it may be running "
            "it)."
        ),
    }
    responses: dict[str, Any] = {
        "200": {
            "description": "The answer (SSE when `stream` is true).",
            "headers": {
                **OUTCOME_HEADER,
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
                    "`stream_options.include_usage`); none is invented. `apportioned` "
                    "(embeddings): the input was merged into one upstream call with others and "
                    'its `usage` (marked `"apportioned": true`) is its share of that call\'s, '
                    "by approximate tokens: an estimate, not the engine's count for it. "
                    "`other-prompt` (a semantic hit): the answer, its `usage` too, is the "
                    "stored prompt's, another prompt than the one asked.",
                    "schema": {
                        "type": "string",
                        "enum": ["missing", "apportioned", "other-prompt"],
                    },
                },
            },
            "content": ok_content,
        }
    }
    for status, description in errors.items():
        content: dict[str, Any] = {"application/json": {"schema": ref(error_schema)}}
        if status in ("400", "409", "422"):
            content["application/problem+json"] = {"schema": ref("Problem")}
        responses[status] = {
            "description": description,
            "headers": OUTCOME_HEADER,
            "content": content,
        }
    responses["default"] = {
        "description": "An upstream error, passed through as it is.",
        "headers": OUTCOME_HEADER,
    }
    return {
        "post": {
            "summary": summary,
            "parameters": HEADER_PARAMETERS,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref(request)}},
            },
            "responses": responses,
        }
    }
