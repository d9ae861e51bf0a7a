"""A fake judge: an OpenAI-compatible ``/v1/chat/completions`` that answers carpool's judge
questions yes or no from labels, counting its calls.

- "same answer?" questions (``carpool.semantic.judge.SAME_ANSWER``): yes when the pair of
  requests (either order) is in ``same``, or ``decide(a, b)`` says so.
- "do these answers agree?" (``ANSWERS_AGREE``): yes when the two answers are the same text, or
  the pair is in ``agree``.
- ``fail_status`` answers that status instead; ``hang`` holds every call until released;
  ``reply`` overrides the text answered (the yes/no protocol's tests), ``body`` the whole
  JSON body answered (a reply of another shape); ``padding`` bytes of
  whitespace follow the reply's JSON (a reply body of any size).
- A conversation's request (an object of ``earlier_turns`` and ``last_message``) is read as
  its two texts joined by a newline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson

from carpool.semantic.judge import SAME_ANSWER, Text, question_of


class FakeJudge:
    def __init__(self) -> None:
        self.same: set[frozenset[str]] = set()
        self.decide: Callable[[str, str], bool] | None = None
        self.agree: set[frozenset[str]] = set()
        self.questions: list[tuple[str, str, str]] = []  # (kind, a, b)
        self.bodies: list[dict[str, Any]] = []
        self.fail_status: int | None = None
        self.hang: asyncio.Event | None = None
        self.reply: str | None = None
        self.body: Any = None
        self.padding = 0

    def says_same(self, a: str, b: str) -> None:
        self.same.add(frozenset((a, b)))

    def calls(self, kind: str | None = None) -> int:
        return sum(1 for q in self.questions if kind is None or q[0] == kind)

    def _verdict(self, body: dict[str, Any]) -> tuple[str, bool]:
        asked = question_of(body)
        assert asked is not None, body
        question, *texts = asked
        a, b = (_read(text) for text in texts)
        if question is SAME_ANSWER:
            self.questions.append(("same", a, b))
            decided = self.decide is not None and self.decide(a, b)
            return "same", decided or frozenset((a, b)) in self.same
        self.questions.append(("agree", a, b))
        return "agree", a == b or frozenset((a, b)) in self.agree

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = orjson.loads(raw)
        self.bodies.append(body)
        _, yes = self._verdict(body)
        if self.hang is not None:
            await self.hang.wait()
        if self.fail_status is not None:
            status, payload = self.fail_status, {"error": {"message": "judge down"}}
        elif self.body is not None:
            status, payload = 200, self.body
        else:
            text = self.reply if self.reply is not None else ("Yes." if yes else "No.")
            status = 200
            payload = {
                "id": "judge-1",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
            }
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        reply = orjson.dumps(payload) + b" " * self.padding
        await send({"type": "http.response.body", "body": reply})


def _read(text: Text) -> str:
    return text if isinstance(text, str) else f"{text['earlier_turns']}\n{text['last_message']}"
