"""A gateway whose system clock is stepped while it runs (NTP correcting it, an operator's
``date -s``, a VM restored): what it holds in its own memory keeps its TTL and its age.

The instance is a process of its own whose ``time.time`` reads a file of seconds to add
(``fakes/skewed_serve.py``), written again to step it. Without Redis: the in-process exact
cache, the semantic one, and the ages they tell (``Age``)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from fakes.instances import instances

NO_WINDOW = {"window_ms": 0}  # (a finished call's lingering flight would answer again)
SEMANTIC = importlib.util.find_spec("onnxruntime") is not None


def chat(content: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}


async def ask(gateway: Any, content: str) -> Any:
    response = await gateway.client.post("/v1/chat/completions", json=chat(content))
    assert response.status_code == 200, response.text
    return response


def step(file: Path, seconds: float) -> None:
    file.write_text(str(seconds))


@pytest.mark.parametrize(
    "semantic",
    [False, pytest.param(True, marks=pytest.mark.skipif(not SEMANTIC, reason="semantic extra"))],
    ids=["exact", "semantic"],
)
async def test_a_clock_stepped_forward_neither_expires_nor_ages_the_answers_held(
    fake, tmp_path, semantic
):
    # Two hours forward: every answer under a two-hour TTL was gone at once (each asked
    # upstream again; here, an hour's), and one that was not said it was two hours old.
    clock = tmp_path / "skew"
    step(clock, 0)
    settings: dict[str, Any] = {"cache": {"default_ttl": 3600}, "coalesce": NO_WINDOW}
    if semantic:
        settings["semantic"] = {"enabled": True}
    async with instances(1, fake.url, None, settings, skews=[clock]) as (gateway,):
        assert (await ask(gateway, "How do I reset my router?")).headers["x-carpool"] == "miss"
        step(clock, 2 * 3600)
        again = await ask(
            gateway, "How can I reset my router?" if semantic else "How do I reset my router?"
        )
        assert again.headers["x-carpool"] == ("semantic-hit" if semantic else "hit")
        assert int(again.headers["age"]) < 60 and fake.count() == 1


async def test_a_clock_stepped_back_serves_no_answer_past_its_ttl(fake, tmp_path):
    # An hour back: every answer lived an hour past its TTL, served with "Age: 0".
    clock = tmp_path / "skew"
    step(clock, 0)
    settings = {"cache": {"default_ttl": 1}, "coalesce": NO_WINDOW}
    async with instances(1, fake.url, None, settings, skews=[clock]) as (gateway,):
        assert (await ask(gateway, "What is a carpool?")).headers["x-carpool"] == "miss"
        step(clock, -3600)
        await asyncio.sleep(1.5)  # (the answer's TTL, 1 s, passes on every clock but the wall)
        assert (await ask(gateway, "What is a carpool?")).headers["x-carpool"] == "miss"
        assert fake.count() == 2
