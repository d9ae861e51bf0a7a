"""The APIs the gateway caches, one ``Api`` object each (``apis.base``), by kind and by path.

    kind          path                    module
    chat          /v1/chat/completions    apis.openai
    completion    /v1/completions         apis.openai
    embedding     /v1/embeddings          apis.openai
    responses     /v1/responses           apis.responses   (OpenAI Responses API)
    messages      /v1/messages            apis.messages    (Anthropic Messages API)

Every other path (``GET /v1/responses/{id}``, ``/v1/messages/count_tokens``, ...) passes through.
"""

from __future__ import annotations

from .base import Api
from .messages import MessagesApi
from .openai import ChatApi, CompletionApi, EmbeddingApi
from .responses import ResponsesApi

APIS: dict[str, Api] = {
    api.kind: api
    for api in (ChatApi(), CompletionApi(), EmbeddingApi(), ResponsesApi(), MessagesApi())
}
BY_PATH: dict[str, Api] = {api.path: api for api in APIS.values()}


def api_at(path: str) -> Api | None:
    """The API served at ``path``: its endpoint's, or with one trailing slash (the gateway
    serves ``/v1/messages/`` as ``/v1/messages``, and refuses there in the same shape)."""
    return BY_PATH.get(path) or (BY_PATH.get(path[:-1]) if path[-1:] == "/" else None)


def api_of(kind: str) -> Api:
    """The ``Api`` of a cached endpoint's kind (``KeyError`` for another)."""
    return APIS[kind]


__all__ = ["APIS", "Api", "BY_PATH", "api_at", "api_of"]
