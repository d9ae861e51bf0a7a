"""The component schemas of the OpenAPI document: the request and answer bodies of every cached
API (OpenAI's chat completions, completions and embeddings; OpenAI's Responses API; Anthropic's
Messages API), the error shapes, and the selector of ``POST /admin/invalidate``.

Contract: request schemas name the main fields of each API and allow any other
(``additionalProperties``): the gateway passes unknown fields through (and fingerprints them).
Plain JSON-able data, built at import; ``ref(name)`` points at one of them.
"""

from __future__ import annotations

from typing import Any


def ref(name: str) -> dict[str, str]:
    """A reference to the component schema ``name``."""
    return {"$ref": f"#/components/schemas/{name}"}


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
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "user": {"type": "string"},
}

_STATES = ["serving", "backed-off", "mark"]
_BUDGET_FIGURES: dict[str, Any] = {
    "audited": {"type": "integer", "minimum": 0},
    "wrong": {"type": "integer", "minimum": 0},
    "estimate": {"type": "number", "minimum": 0, "maximum": 1},
    "low": {"type": "number", "minimum": 0, "maximum": 1},
    "high": {"type": "number", "minimum": 0, "maximum": 1},
    "state": {"type": "string", "enum": _STATES},
}
# One error budget's audits (``semantic.audit.Audits.snapshot``): a tenant's in a namespace.
_BUDGET = {"type": "object", "required": list(_BUDGET_FIGURES), "properties": _BUDGET_FIGURES}

# OpenAI's error object: an ``Error``'s, and a ``Problem``'s beside its RFC 9457 members.
_ERROR = {
    "type": "object",
    "required": ["message", "type", "code"],
    "properties": {
        "message": {"type": "string"},
        "type": {"type": "string"},
        "code": {"type": "string", "nullable": True},
        "param": {"type": "string", "nullable": True},
    },
}

SCHEMAS: dict[str, Any] = {
    # A namespace's budgets together; ``tenants``: each one's, by tenant label (the admin's).
    "SemanticAudit": {
        "type": "object",
        "required": [*_BUDGET_FIGURES, "budgets"],
        "properties": {
            **_BUDGET_FIGURES,
            "budgets": {
                "type": "object",
                "properties": {state: {"type": "integer", "minimum": 1} for state in _STATES},
                "additionalProperties": False,
            },
            "tenants": {"type": "object", "additionalProperties": _BUDGET},
        },
    },
    "Error": {"type": "object", "required": ["error"], "properties": {"error": _ERROR}},
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details (idempotency errors), with OpenAI's `error` "
        "member beside them (where the SDKs read an error's message and code).",
        "required": ["type", "title", "status", "detail", "error"],
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "message": {"type": "string"},
            "code": {"type": "string"},
            "error": _ERROR,
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
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
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
            # (null: OpenAI's default prompt, passed on to the upstream to answer)
            "prompt": {**_TEXT_OR_TOKENS, "nullable": True},
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
            "stream": {"type": "boolean", "nullable": True},
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
            "stream": {"type": "boolean", "nullable": True},
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
                # ("": the default namespace, the requests that named none.)
                "properties": {"namespace": {"type": "string"}},
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
