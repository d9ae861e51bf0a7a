"""The official openai SDK pointed at the gateway works unchanged, streaming and not."""

from __future__ import annotations

import asyncio

import openai
import pytest

from conftest import run_gateway
from fakes.waiting import eventually

MESSAGES = [{"role": "user", "content": "What is carpool?"}]


@pytest.fixture
def sdk(gw):
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)


async def test_openai_sdk_non_streaming_miss_then_hit(sdk, fake):
    raw = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0
    )
    first = raw.parse()
    assert raw.headers["x-carpool"] == "miss"
    assert first.choices[0].message.content == "answer 1 to What is carpool?"
    assert first.usage.total_tokens > 0
    raw = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0
    )
    assert raw.headers["x-carpool"] == "hit"
    assert raw.parse().choices[0].message.content == first.choices[0].message.content
    assert fake.calls[0].headers["authorization"] == "Bearer sk-test"


async def test_openai_sdk_streaming_coalesced_and_hit(sdk, gw, fake):
    fake.chunk_gate = asyncio.Event()

    async def read_stream():
        stream = await sdk.chat.completions.create(
            model="m",
            messages=MESSAGES,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(text), usage

    leader = asyncio.create_task(read_stream())
    await fake.chunk_gate_reached.wait()
    joiner = asyncio.create_task(read_stream())
    await eventually(lambda: sum(f.clients for f in gw.gateway.flights.running()) == 2)
    fake.chunk_gate.set()
    (text1, usage1), (text2, usage2) = await asyncio.gather(leader, joiner)
    assert text1 == text2 == "answer 1 to What is carpool?"
    assert usage1 is not None and usage1.total_tokens == usage2.total_tokens > 0
    hit_text, _ = await read_stream()
    assert hit_text == text1 and fake.count() == 1


async def test_openai_sdk_embeddings_and_completions(sdk, fake):
    first = await sdk.embeddings.create(model="e", input=["a", "b"])
    second = await sdk.embeddings.create(model="e", input=["a", "b"])
    assert len(first.data) == 2 and first.data[0].embedding == second.data[0].embedding
    completion = await sdk.completions.create(model="m", prompt="Say hi", temperature=0)
    assert completion.choices[0].text == "answer 2 to Say hi"
    assert fake.count() == 2


async def test_a_null_stream_is_no_stream_as_openai_takes_it(sdk, gw, fake):
    # The SDK sends ``"stream": null`` for ``stream=None`` (its parameter is optional): OpenAI
    # and vLLM answer it whole. So does the gateway, and the upstream is asked without it (an
    # engine that types ``stream`` a plain boolean, SGLang's, refuses null).
    chat = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0, stream=None
    )
    assert chat.headers["x-carpool"] == "miss"
    assert chat.parse().choices[0].message.content == "answer 1 to What is carpool?"
    completion = await sdk.completions.create(
        model="m", prompt="Say hi", temperature=0, stream=None
    )
    assert completion.choices[0].text == "answer 2 to Say hi"
    response = await sdk.responses.create(model="m", input="Say hi", temperature=0, stream=None)
    assert response.output_text == "answer 3 to Say hi"
    assert fake.count() == 3 and all("stream" not in call.body for call in fake.calls)
    # The same request as one without ``stream``: a hit.
    again = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0
    )
    assert again.headers["x-carpool"] == "hit" and fake.count() == 3


async def test_a_field_sent_as_null_is_another_request_than_the_field_left_out(sdk, fake):
    """OpenAI reads a null as the field left out, but not every engine does: vLLM's completions
    take ``"max_tokens": null`` as "up to the context's end" and no ``max_tokens`` as 16 tokens
    (``max_tokens: Optional[int] = 16``). Shared, one would get the other's answer."""
    completion = await sdk.completions.with_raw_response.create(
        model="m", prompt="Say hi", temperature=0, max_tokens=None
    )
    assert completion.headers["x-carpool"] == "miss"
    assert fake.calls[0].body["max_tokens"] is None  # (forwarded as sent)
    left_out = await sdk.completions.with_raw_response.create(
        model="m", prompt="Say hi", temperature=0
    )
    assert left_out.headers["x-carpool"] == "miss" and "max_tokens" not in fake.calls[1].body
    assert fake.count() == 2


async def test_a_null_prompt_is_the_upstreams_to_answer_as_openai_takes_it(sdk, fake):
    # The SDK sends ``"prompt": null`` for ``prompt=None``; OpenAI answers it (its default
    # prompt, ``<|endoftext|>``). The gateway refused it with its own 400, calling no upstream.
    completion = await sdk.completions.with_raw_response.create(
        model="m", prompt=None, temperature=0
    )
    assert completion.headers["x-carpool"] == "miss" and completion.parse().choices
    assert fake.count() == 1 and fake.calls[0].body["prompt"] is None
    with pytest.raises(openai.BadRequestError, match="'prompt' must be"):
        await sdk.completions.create(model="m", prompt=7, temperature=0)  # type: ignore[arg-type]
    assert fake.count() == 1


async def test_a_null_prompt_is_an_empty_one_to_the_simulated_engine():
    async with run_gateway([]) as sim:
        sdk = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="k", max_retries=0)
        completion = await sdk.completions.create(model="m", prompt=None, temperature=0)
        assert completion.choices[0].finish_reason in ("stop", "length")
        await sdk.close()


async def test_openai_sdk_raises_on_a_stream_that_fails_part_way(sdk, fake):
    fake.cut_after = 2
    stream = await sdk.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, stream=True
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


async def test_openai_sdk_sees_upstream_errors_with_their_status(sdk, fake):
    fake.fail_status = 429
    with pytest.raises(openai.RateLimitError):
        await sdk.chat.completions.create(model="m", messages=MESSAGES, temperature=0)


async def test_an_upstream_refusals_retry_headers_reach_the_client_and_its_sdk_obeys_them(gw, fake):
    # They were dropped on the cached endpoints: the SDK retried a 429 the upstream had said
    # not to, at once, whatever its Retry-After said. What it says of the account is not relayed.
    fake.fail_status = 429
    fake.response_headers = [
        (b"retry-after", b"7"),
        (b"retry-after-ms", b"7000"),
        (b"x-should-retry", b"false"),
        (b"x-ratelimit-remaining-requests", b"0"),
    ]
    retrying = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=2)
    with pytest.raises(openai.RateLimitError) as raised:
        await retrying.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    assert fake.count() == 1  # x-should-retry: false, obeyed
    headers = raised.value.response.headers
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("7", "7000")
    assert "x-ratelimit-remaining-requests" not in headers
    # A stream's refusal and a joiner of the refused call say it too.
    fake.gate = asyncio.Event()
    leader = asyncio.create_task(gw.chat("again", stream=True))
    await fake.wait_for_calls(2)
    joiner = asyncio.create_task(gw.chat("again"))
    await eventually(
        lambda: sum(f.clients for f in gw.gateway.flights.running()) == 2, what="a joiner"
    )
    fake.gate.set()
    for response in await asyncio.gather(leader, joiner):
        assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert fake.count() == 2


async def test_models_retrieve_of_a_name_holding_a_slash_is_a_400_the_list_names_it(sdk, fake):
    """The SDK sends the ``/`` of ``org/name`` encoded (``%2F``), which an upstream may decode
    into a separator and route on: refused, reaching nobody (docs/security.md)."""
    with pytest.raises(openai.BadRequestError, match=r"encoded /"):
        await sdk.models.retrieve("Qwen/Qwen2.5-7B-Instruct")
    assert fake.count() == 0
    assert [model.id for model in (await sdk.models.list()).data] == ["fake-model"]
    await sdk.models.retrieve("fake-model")  # (passed through: a name without a slash)
    assert fake.calls[-1].path == "/v1/models/fake-model"
