"""What every error answer of the gateway must look like: OpenAI's shape, checked in one place."""

from __future__ import annotations

from typing import Any


def assert_openai_error(
    response: Any, status: int, code: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    """``response`` is ``status`` with ``{"error": {"message", "type", "code"}}`` as JSON (and
    the given ``code`` and ``type_``, when given); returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    return error
