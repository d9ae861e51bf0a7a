"""The request fingerprint (CONTRACT.md "Request fingerprint", "Sampling policy", "Tenants")."""

from __future__ import annotations

import copy
import unicodedata

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.canonical import ORDERED_FIELDS
from carpool.config import Config
from carpool.fingerprint import (
    fingerprint,
    is_deterministic,
    normalize_text,
    request_digest,
    semantic_view,
)
from carpool.request import ClientRequest, parse

CHAT = "/v1/chat/completions"


def key(body, headers=None, config=None, path=CHAT):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    request = parse(ClientRequest(path, raw, headers or {}), 1 << 20)
    return fingerprint(request, config or Config()).key


def chat(content="How do I reset it?", **extra):
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }


def test_key_order_does_not_change_the_key():
    assert key(b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"x"}]}') == key(
        b'{"messages":[{"content":"x","role":"user"}],"temperature":0,"model":"m"}'
    )


def test_number_spelling_does_not_change_the_key():
    assert key(
        b'{"model":"m","temperature":0,"top_p":1,"messages":[{"role":"user","content":"x"}]}'
    ) == key(
        b'{"model":"m","temperature":0.0,"top_p":1e0,"messages":[{"role":"user","content":"x"}]}'
    )


def test_excluded_fields_do_not_change_the_key():
    base = key(chat())
    assert key(chat(user="alice")) == base
    assert key(chat(stream=True, stream_options={"include_usage": True})) == base
    assert key(chat(metadata={"trace": "1"}, request_id="abc")) == base
    # OpenAI's successors of ``user``: an SDK user following its advice shared nothing.
    assert key(chat(safety_identifier="end-user-1", prompt_cache_key="a")) == base
    # How long the prompt cache keeps the prompt: billing and latency, never the answer.
    assert key(chat(prompt_cache_retention="24h")) == base
    # SGLang's request id (its answer's id is named after it), as vLLM's ``request_id``.
    assert key(chat(rid="req-alice-1")) == base
    responses = {"model": "m", "input": "x", "temperature": 0, "store": False}
    assert key({**responses, "safety_identifier": "u1"}, path="/v1/responses") != key(
        responses, path="/v1/responses"
    )  # (echoed in a Responses answer)


def test_metadata_is_in_the_key_of_a_chat_stored_upstream():
    # The stored completion keeps its metadata (listed and filtered by it): a hit gave a
    # request with other metadata the id of a completion stored with the first one's.
    stored = chat(store=True, metadata={"feature": "a"})
    assert key({**stored, "metadata": {"feature": "b"}}) != key(stored)
    assert key(chat(store=False, metadata={"feature": "b"})) == key(chat(store=False))


@pytest.mark.parametrize(
    "options", [{"continuous_usage_stats": True}, {"include_obfuscation": False}]
)
def test_a_stream_option_other_than_include_usage_changes_the_key(options):
    # Each changes the frames (a usage in every chunk; padding or not): a client that did not
    # ask was replayed another's, its usage in every chunk.
    base = key(chat(stream=True))
    assert key(chat(stream=True, stream_options=options)) != base
    both = {**options, "include_usage": True}
    # (Beside continuous_usage_stats include_usage decides every chunk's usage: keyed.)
    same = "continuous_usage_stats" not in options
    assert (
        key(chat(stream=True, stream_options=both))
        == key(chat(stream=True, stream_options=options))
    ) is same


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "other"),
        ("max_tokens", 5),
        ("max_completion_tokens", 5),
        ("top_p", 0.5),
        ("top_k", 5),
        ("min_p", 0.1),
        ("stop", ["\n"]),
        ("seed", 1),
        ("presence_penalty", 1),
        ("frequency_penalty", 1),
        ("repetition_penalty", 1.1),
        ("logit_bias", {"1": 2}),
        ("logprobs", True),
        ("top_logprobs", 2),
        ("n", 2),
        ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "none"),
        ("some_future_field", 1),
    ],
)
def test_every_output_affecting_field_changes_the_key(field, value):
    assert key({**chat(), field: value}) != key(chat())


COLLAPSE = Config(fingerprint={"normalize_whitespace": True})


def test_whitespace_collapse_is_an_opt_in_that_merges_runs_and_ends():
    assert key(chat("How do I reset it? "), config=COLLAPSE) == key(
        chat("How do I reset   it?"), config=COLLAPSE
    )


def test_whitespace_is_kept_inside_fenced_code_even_with_collapse():
    a = "Fix:\n```py\nif x:\n    y()\n```"
    b = "Fix:\n```py\nif x:\n  y()\n```"
    assert key(chat(a), config=COLLAPSE) != key(chat(b), config=COLLAPSE)
    assert key(chat("Fix:   \n" + a[5:]), config=COLLAPSE) == key(chat(a), config=COLLAPSE)


def test_whitespace_is_kept_for_requests_of_type_code_even_with_collapse():
    code = {"x-carpool-type": "code"}
    assert key(chat("a  b"), code, COLLAPSE) != key(chat("a b"), code, COLLAPSE)


def test_whitespace_is_kept_for_embeddings_inputs_even_with_collapse():
    def embed(text):
        return key({"model": "e", "input": text}, config=COLLAPSE, path="/v1/embeddings")

    assert embed("a  b") != embed("a b")
    assert embed(["a\tb", "c"]) != embed(["a b", "c"])


def test_whitespace_is_meaning_by_default():
    assert key(chat("a  b")) != key(chat("a b"))
    assert key(chat("x ")) != key(chat("x"))


def test_unicode_composition_does_not_change_the_key():
    composed, decomposed = "café", unicodedata.normalize("NFD", "café")
    assert composed != decomposed
    assert key(chat(composed)) == key(chat(decomposed))


def test_embeddings_inputs_are_exact_not_nfc():
    # An embedding is of the code points sent: NFC would fold distinct characters (the Ohm
    # sign into Omega, the Kelvin sign into K) and composed with decomposed, which tokenize
    # apart and embed as different vectors.
    def embed(text):
        return key({"model": "e", "input": text}, path="/v1/embeddings")

    for a, b in [("\u2126", "\u03a9"), ("\u212a", "K"), ("e\u0301", "\u00e9")]:
        assert embed(f"x {a}") != embed(f"x {b}")
        assert embed([f"x {a}", "y"]) != embed([f"x {b}", "y"])
    assert embed("x \u2126") == embed("x \u2126")


def test_two_schemas_differing_only_in_property_order_are_two_keys():
    # OpenAI's structured outputs write an object's keys in the schema's order, and chat
    # templates render tools as given: two orders are two answers.
    name_age = {"name": {"type": "string"}, "age": {"type": "integer"}}
    age_name = {"age": {"type": "integer"}, "name": {"type": "string"}}

    def schema(properties):
        return {"type": "object", "properties": properties, "required": ["name", "age"]}

    def response_format(properties):
        return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema(properties)}}

    def tools(properties):
        function = {"name": "f", "parameters": schema(properties)}
        return [{"type": "function", "function": function}]

    for field, of in [
        ("response_format", response_format),
        ("tools", tools),
        ("functions", lambda p: [{"name": "f", "parameters": schema(p)}]),
        ("guided_json", schema),
        ("text", lambda p: {"format": {"type": "json_schema", "name": "p", "schema": schema(p)}}),
    ]:
        assert key(chat(**{field: of(name_age)})) != key(chat(**{field: of(age_name)})), field
        assert key(chat(**{field: of(name_age)})) == key(chat(**{field: of(dict(name_age))}))
    # Elsewhere the order of keys is the JSON text's alone (a field the gateway does not know).
    assert key(chat(some_future_field=name_age)) == key(chat(some_future_field=age_name))
    # Ordered, an object is still one to one: not the same as a list of its pairs.
    pairs = [["name", {"type": "string"}], ["age", {"type": "integer"}]]
    assert key(chat(guided_json=name_age)) != key(chat(guided_json=pairs))
    assert key(chat(guided_json={"\x00": pairs})) != key(chat(guided_json=name_age))


def test_an_anthropic_output_config_schema_keeps_its_property_order():
    # vLLM's Anthropic endpoint makes output_config.format.schema a json_schema response format:
    # generation follows its order. The second client got the first's keys in its order.
    def body(properties):
        schema = {"type": "object", "properties": properties}
        return {**chat(), "output_config": {"format": {"type": "json_schema", "schema": schema}}}

    name_age = {"name": {"type": "string"}, "age": {"type": "integer"}}
    age_name = {"age": {"type": "integer"}, "name": {"type": "string"}}
    assert key(body(name_age), path="/v1/messages") != key(body(age_name), path="/v1/messages")


def test_a_messages_tool_use_input_keeps_its_key_order():
    # vLLM renders an earlier tool call's input with json.dumps (its order): two prompts.
    def body(arguments):
        call = {"type": "tool_use", "id": "t1", "name": "weather", "input": arguments}
        return {
            "model": "m",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            ],
        }

    city_date = {"city": "Paris", "date": "today"}
    date_city = {"date": "today", "city": "Paris"}
    assert key(body(city_date), path="/v1/messages") != key(body(date_city), path="/v1/messages")
    assert key(body(city_date), path="/v1/messages") == key(
        body(dict(city_date)), path="/v1/messages"
    )


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "m", "temperature": 0, "echo": True}),
        ("/v1/completions", {"model": "m", "temperature": 0, "prompt_logprobs": 0}),
        ("/v1/completions", {"model": "m", "temperature": 0, "return_token_ids": True}),
        (CHAT, {"model": "m", "temperature": 0, "echo": True}),
        ("/v1/responses", {"model": "m", "temperature": 0, "store": False}),
        # (vLLM's rendered prompt, SGLang's prompt token ids: an engine review)
        (CHAT, {"model": "m", "temperature": 0, "return_prompt_text": True}),
        (CHAT, {"model": "m", "temperature": 0, "return_prompt_token_ids": True}),
    ],
    ids=[
        "completions-echo",
        "prompt_logprobs",
        "return_token_ids",
        "chat-echo",
        "responses",
        "return_prompt_text",
        "return_prompt_token_ids",
    ],
)
def test_an_answer_that_repeats_its_prompt_is_keyed_by_the_prompt_exactly_as_sent(path, body):
    # The answer carries the prompt (echo, the prompt's tokens or logprobs; a Responses
    # answer its instructions): folded in the key (NFC, white space), one spelling was served
    # the other's text back, word for word, as its own.
    def asked(text: str) -> dict:
        if path == "/v1/completions":
            return {**body, "prompt": text}
        if path == CHAT:
            return {**body, "messages": [{"role": "user", "content": text}]}
        return {**body, "input": "x", "instructions": text}

    nfc, nfd = "Caf\u00e9 cr\u00e8me", "Cafe\u0301 cre\u0300me"
    assert key(asked(nfc), path=path) != key(asked(nfd), path=path)
    spaced, tight = "def f():\n    return  1", "def f(): return 1"
    assert key(asked(spaced), path=path, config=COLLAPSE) != key(
        asked(tight), path=path, config=COLLAPSE
    )
    # Without an echo, the prompt is input text: NFC (and collapsed when asked), as before.
    if path == "/v1/completions":
        plain = {"model": "m", "temperature": 0}
        assert key({**plain, "prompt": nfc}, path=path) == key({**plain, "prompt": nfd}, path=path)


@pytest.mark.parametrize(
    "path, body, apart",
    [
        ("/v1/completions", {"model": "m", "temperature": 0, "prompt": "Hi", "echo": True}, True),
        (
            "/v1/completions",
            {"model": "m", "temperature": 0, "prompt": "Hi", "logprobs": 1, "echo": 1},
            True,
        ),
        (
            CHAT,
            {
                "model": "m",
                "temperature": 0,
                "echo": True,
                "messages": [{"role": "user", "content": "Hi"}],
            },
            True,
        ),
        (
            "/v1/completions",
            {"model": "m", "temperature": 0, "prompt": "Hi", "return_token_ids": True},
            False,
        ),
        # vLLM refuses prompt_logprobs with a stream (but 0) and sends them in a whole answer
        # only: a stream was served the JSON answer's hit (an engine review).
        (
            CHAT,
            {
                "model": "m",
                "temperature": 0,
                "prompt_logprobs": 1,
                "messages": [{"role": "user", "content": "Hi"}],
            },
            True,
        ),
    ],
    ids=["completions-echo", "echo-logprobs", "chat-echo", "return_token_ids", "prompt_logprobs"],
)
def test_an_echo_request_is_keyed_apart_streamed_or_not(path, body, apart):
    # llama.cpp's server repeats the prompt (echo) in a whole answer, not in a stream: the
    # answer assembled from a streaming client's call was stored and served to the JSON
    # clients of the request, and joined by them, without its prompt. Streamed or not, an
    # echo request is a request of its own; any other is the same request either way (vLLM's
    # return_token_ids streams the prompt's ids in its first chunk).
    streamed = key({**body, "stream": True}, path=path)
    assert streamed is not None
    assert (streamed != key(body, path=path)) is apart
    assert key(body, path=path) == key({**body, "stream": False}, path=path)
    plain = {k: v for k, v in body.items() if k not in ("echo", "prompt_logprobs")}
    assert key({**plain, "stream": True}, path=path) == key(plain, path=path)


def test_strings_in_a_schema_are_exact_while_prompt_text_is_nfc():
    # An enum value is written into the answer as given: a client whose enum said "café" in
    # NFD got the NFC client's "café", which its own schema does not allow.
    nfc, nfd = "caf\u00e9", "cafe\u0301"

    def body(value, content="x"):
        schema = {"type": "object", "properties": {"d": {"enum": [value]}}}
        return chat(
            content, response_format={"type": "json_schema", "json_schema": {"schema": schema}}
        )

    assert key(body(nfc)) != key(body(nfd))
    assert key(body(nfc, content=nfc)) == key(body(nfc, content=nfd))  # the prompt: NFC


def test_stop_sequences_and_choice_constraints_are_exact_not_nfc():
    # The engine matches a stop sequence, a guided choice, a regex or a grammar against the
    # tokens it writes, and fetches an image by the URL's bytes: "é" and "e" + U+0301 there
    # are two requests with two answers. NFC is for the input text alone.
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    for field, of in [
        ("stop", lambda v: [v]),
        ("stop", lambda v: v),
        ("guided_choice", lambda v: [v, "tea"]),
        ("guided_regex", lambda v: v + "|tea"),
        ("regex", lambda v: v + "|tea"),  # SGLang
        ("ebnf", lambda v: f'root ::= "{v}"'),  # SGLang
        ("guided_grammar", lambda v: f'root ::= "{v}"'),
    ]:
        assert key(chat(**{field: of(nfc)})) != key(chat(**{field: of(nfd)})), field
        assert key(chat(**{field: of(nfc)})) == key(chat(**{field: of(nfc)}))

    def messages(stop):
        return {**chat(), "max_tokens": 8, "stop_sequences": [stop]}

    assert key(messages(nfc), path="/v1/messages") != key(messages(nfd), path="/v1/messages")

    def image(url, text="describe"):
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
        return chat(parts)

    assert key(image(f"https://x.test/{nfc}.png")) != key(image(f"https://x.test/{nfd}.png"))
    # The input text still is NFC: in a message, a text part, a prompt, a system prompt.
    assert key(chat(nfc, stop=["."])) == key(chat(nfd, stop=["."]))
    assert key(image("https://x.test/a.png", nfc)) == key(image("https://x.test/a.png", nfd))
    prompt = {"model": "m", "temperature": 0}
    assert key({**prompt, "prompt": nfc}, path="/v1/completions") == key(
        {**prompt, "prompt": nfd}, path="/v1/completions"
    )
    system = {**chat(), "max_tokens": 8}
    assert key({**system, "system": nfc}, path="/v1/messages") == key(
        {**system, "system": nfd}, path="/v1/messages"
    )


def test_a_messages_request_with_an_origin_is_keyed_apart_from_one_without():
    # Anthropic answers a request carrying Origin (a browser's) without its opt-in header a 401
    # ("CORS requests must set 'anthropic-dangerous-direct-browser-access' header"): neutral,
    # Origin let one be served another's 200, and a server-side request joining its call got
    # its 401. Its presence is in a Messages key, not its value; elsewhere it stays neutral.
    body = {**chat(), "max_tokens": 8}
    plain = key(body, path="/v1/messages")
    site = key(body, {"origin": "https://a.example"}, path="/v1/messages")
    assert site != plain
    assert site == key(body, {"origin": "https://b.example"}, path="/v1/messages")
    assert key(chat(), {"origin": "https://a.example"}) == key(chat())


def test_an_int_and_a_float_in_a_tool_schema_are_two_keys():
    # A chat template renders a tool with tojson, structured outputs write an enum value as
    # given: "minimum": 1 and "minimum": 1.0, [1] and [1.0] are two prompts, two answers.
    def tool(minimum):
        parameters = {"type": "object", "properties": {"n": {"type": "number", "minimum": minimum}}}
        return chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        )

    def enum(values):
        schema = {"type": "object", "properties": {"v": {"enum": values}}}
        return chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}})

    assert key(tool(1)) != key(tool(1.0))
    assert key(tool(0)) != key(tool(0.0))
    assert key(enum([1, 2.5])) != key(enum([1.0, 2.5]))
    # A float is the same float however it is spelled, an int the same int.
    assert key(tool(1.0)) == key(orjson.loads(orjson.dumps(tool(1.0)).replace(b"1.0", b"1e0")))
    assert key(tool(1)) == key(tool(1))
    # Sampling parameters are numbers by value: 1 and 1.0 are one temperature.
    assert key(chat(temperature=1, seed=3)) == key(chat(temperature=1.0, seed=3))


def test_an_int_and_a_float_a_chat_template_renders_are_two_keys():
    # vLLM, SGLang and llama.cpp hand ``chat_template_kwargs`` (vLLM ``documents`` too) to the
    # template as given: Seed-OSS's writes "within 512 tokens" for 512, "within 512.0 tokens"
    # for 512.0, two prompts that were keyed as one.
    budget = {"thinking_budget": 512}
    assert key(chat(chat_template_kwargs=budget)) != key(
        chat(chat_template_kwargs={"thinking_budget": 512.0})
    )
    assert key(chat(chat_template_kwargs=budget)) == key(chat(chat_template_kwargs=dict(budget)))
    documents = [{"title": "t", "pages": 2}]
    assert key(chat(documents=documents)) != key(chat(documents=[{"title": "t", "pages": 2.0}]))


ORDERED_VALUES = {
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t"}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "response_format": {"type": "json_object"},
}


@pytest.mark.parametrize("field", sorted(ORDERED_FIELDS))
def test_a_request_holding_an_ordered_field_never_takes_an_older_instances_key(field, monkeypatch):
    # An ordered field is keyed as its JSON text: a string. Before a field was ordered, a string
    # value of it was keyed as that string: an older instance's key for the string was a newer
    # one's for the object, and on one Redis the newer served (and replayed under an
    # Idempotency-Key) the answer to the other request. A request holding one has a key
    # version of its own; every other request keeps its key.
    from carpool import canonical

    value = ORDERED_VALUES.get(field, {"type": "object", "properties": {"a": {"minimum": 1}}})
    new = key(chat(**{field: value}))
    monkeypatch.setattr(canonical, "ORDERED_FIELDS", canonical.ORDERED_FIELDS - {field})
    older = key(chat(**{field: orjson.dumps(value).decode()}))
    assert new != older
    assert key(chat()) == key(chat())  # (and a request without one: as before, below)


def test_an_ordered_field_as_deep_as_the_depth_limit_allows_gets_a_key():
    # Each ordered object took three levels in the key's JSON: past ~85 levels of a tool's
    # schema (max_json_depth allows 200) the digest raised and the request was a 500.
    deep: dict = {"type": "string"}
    for _ in range(96):  # two levels each: 192, and the body's own 7
        deep = {"type": "object", "properties": {"x": deep}}
    body = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep}}])
    request = parse(ClientRequest(CHAT, orjson.dumps(body), {}), 1 << 24, max_json_depth=200)
    assert fingerprint(request, Config()).key


def test_tenants_never_share_a_key():
    assert key(chat(), {"authorization": "Bearer a"}) != key(chat(), {"authorization": "Bearer b"})


def test_the_tenant_is_a_hash_never_the_raw_credential():
    request = parse(
        ClientRequest(CHAT, orjson.dumps(chat()), {"authorization": "Bearer sk-secret"}), 1 << 20
    )
    fp = fingerprint(request, Config())
    assert "sk-secret" not in fp.tenant and "sk-secret" not in fp.key


def test_a_configured_tenant_header_is_used_beside_the_credential_headers():
    config = Config(tenant={"header": "X-Team"})
    assert key(chat(), {"x-team": "a"}, config) != key(chat(), {"x-team": "b"}, config)
    assert key(chat(), {"x-team": "a", "authorization": "1"}, config) != key(
        chat(), {"x-team": "a", "authorization": "2"}, config
    )
    # Not a credential any more, Authorization is not the tenant; forwarded upstream, it is still
    # in the key (it might change the answer).
    only_team = Config(tenant={"header": "X-Team", "credential_headers": []})

    def fp(value):
        raw = orjson.dumps(chat())
        headers = {"x-team": "a", "authorization": value}
        return fingerprint(parse(ClientRequest(CHAT, raw, headers), 1 << 20), only_team)

    assert fp("1").tenant == fp("2").tenant and fp("1").key != fp("2").key


# What hosting platforms, CDNs and load balancers add to every request they forward: a new
# value each request (an id, a queue time) or each connection (the client's port), or the
# client's address and geography. In the key, nothing behind them was ever shared.
PLATFORM_HEADERS = [
    "x-request-start",  # Heroku's router; nginx for New Relic's queue time
    "x-queue-start",
    "connect-time",  # Heroku's legacy router
    "fly-request-id",
    "fly-client-ip",
    "fly-forwarded-port",
    "fly-region",
    "rndr-id",  # Render
    "x-railway-request-id",
    "x-nf-request-id",  # Netlify
    "x-vercel-id",
    "x-vercel-forwarded-for",
    "x-vercel-ip-city",
    "x-amz-cf-id",  # CloudFront
    "cloudfront-viewer-address",
    "cloudfront-viewer-country",
    "x-azure-ref",  # Front Door
    "x-azure-clientip",
    "x-appgw-trace-id",  # Application Gateway
    "x-arr-log-id",  # App Service
    "x-client-ip",
    "x-client-port",
    "x-appengine-city",
    "x-appengine-request-log-id",
    "fastly-client-ip",
    "x-cluster-client-ip",
    "x-original-forwarded-for",  # ingress-nginx
    "x-forwarded-server",  # Apache, Traefik: the proxy replica
]


@pytest.mark.parametrize("name", PLATFORM_HEADERS)
def test_hosting_platforms_per_request_headers_do_not_change_the_key(name):
    base = key(chat())
    assert key(chat(), {name: "one"}) == base == key(chat(), {name: "two"})


@pytest.mark.parametrize(
    "name",
    [
        # The client's certificate identity (Envoy, Istio): an upstream may authorize by it.
        "x-forwarded-client-cert",
        "x-arr-clientcert",
        "x-amzn-mtls-clientcert",
        # An origin's check that the request came through its own Front Door.
        "x-azure-fdid",
        # Who is calling, to App Engine's users, cron and tasks; the target before a rewrite;
        # the deployment a request is for; the client's language.
        "x-appengine-user-email",
        "x-appengine-cron",
        "x-original-uri",
        "x-original-url",
        "x-vercel-deployment-url",
        "x-vercel-oidc-token",
        "accept-language",
    ],
)
def test_a_platform_header_that_may_identify_the_client_or_pick_the_answer_stays_in_the_key(name):
    assert key(chat(), {name: "one"}) != key(chat(), {name: "two"})


def test_headers_named_in_fingerprint_neutral_headers_do_not_change_the_key():
    config = Config(fingerprint={"neutral_headers": ["X-Edge-Request", "x-ingress-hop"]})
    base = key(chat(), config=config)
    for headers in ({"x-edge-request": "1"}, {"x-edge-request": "2", "x-ingress-hop": "b"}):
        assert key(chat(), headers, config) == base
    # Another header, and the same one under a config that does not name it, are in the key.
    assert key(chat(), {"x-edge-requests": "1"}, config) != base
    assert key(chat(), {"x-edge-request": "1"}) != key(chat(), {"x-edge-request": "2"})
    # Neutral is not shared across tenants: the tenant is the credential headers, still.
    assert key(chat(), {"authorization": "a", "x-edge-request": "1"}, config) != key(
        chat(), {"authorization": "b", "x-edge-request": "1"}, config
    )


def test_a_header_neutral_under_one_config_is_still_in_the_key_under_another():
    # The names seen not to vary the key are remembered per config: one config's neutral
    # header, once seen, must not leave the key of another that does not name it.
    neutral = Config(fingerprint={"neutral_headers": ["x-edge-request"]})
    assert key(chat(), {"x-edge-request": "1"}, neutral) == key(chat(), {}, neutral)
    assert key(chat(), {"x-edge-request": "1"}) != key(chat(), {"x-edge-request": "2"})


def test_a_tenant_accepted_in_a_shared_namespace_is_accepted_whatever_its_neutral_headers():
    # The grant an upstream accepted leaves out the neutral headers as the key does: a request
    # id that the platform changes each time would have kept every request its own tenant's.
    from carpool.fingerprint import grant_of, names_of, neutral_of

    config = Config(
        tenant={"shared_namespaces": ["docs"]},
        fingerprint={"neutral_headers": ["x-edge-request"]},
    )
    shared = {"authorization": "a", "x-carpool-namespace": "docs"}

    def fp(headers):
        raw = orjson.dumps(chat())
        return fingerprint(parse(ClientRequest(CHAT, raw, headers), 1 << 20), config, accepted)

    accepted: set = set()
    plain = parse(ClientRequest(CHAT, orjson.dumps(chat()), shared), 1 << 20)
    accepted.add(
        (fp(shared).owner, grant_of(plain, names_of(config.tenant), neutral_of(config.fingerprint)))
    )
    for extra in ({"fly-request-id": "r1"}, {"x-edge-request": "e1"}):
        assert fp({**shared, **extra}).tenant == "*"
    assert fp({**shared, "openai-beta": "x"}).tenant != "*"  # a header in the key is not


def test_namespaces_and_freshness_tokens_scope_the_key():
    assert key(chat(), {"x-carpool-namespace": "a"}) != key(chat(), {"x-carpool-namespace": "b"})
    assert key(chat(), {"x-carpool-freshness": "v1"}) != key(chat(), {"x-carpool-freshness": "v2"})


def test_shared_namespace_is_shared_across_tenants():
    config = Config(tenant={"shared_namespaces": ["docs"]})
    a = key(chat(), {"authorization": "a", "x-carpool-namespace": "docs"}, config)
    b = key(chat(), {"authorization": "b", "x-carpool-namespace": "docs"}, config)
    assert a == b


@pytest.mark.parametrize(
    "params, shared",
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.7, "seed": 3}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({}, False),
        ({"temperature": 1, "seed": None}, False),
        ({"temperature": 0.7, "seed": 0}, True),
        ({"temperature": 0, "seed": -1}, True),
    ],
)
def test_sampling_policy_strict(params, shared):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **params}
    assert is_deterministic(body) is shared
    assert (key(body) is not None) is shared


@pytest.mark.parametrize(
    "params, shared",
    [
        ({"top_k": 1, "temperature": -1}, False),
        ({"top_k": 1, "temperature": 0.9, "mirostat_mode": 2}, False),
        ({"top_k": 1, "mirostat": 1}, False),
        ({"top_k": 1, "temperature": 0.9, "mirostat_mode": 0}, True),
        ({"top_k": 1, "temperature": -1, "seed": 3}, True),
        ({"temperature": 0, "mirostat_mode": 2}, True),
        ({"top_k": 1, "temperature": 1, "samplers": ["temperature"]}, False),
        ({"top_k": 1, "temperature": 1, "samplers": "t"}, False),
        ({"top_k": 1, "temperature": 1, "samplers": []}, False),
        ({"top_k": 1, "temperature": 1, "samplers": ["top_k", "temperature"]}, True),
        ({"top_k": 1, "temperature": 1, "samplers": "kt"}, True),
        # llama.cpp at temperature 0: its chain is ``samplers`` then a draw; without the
        # temperature sampler in it, the draw samples (the README: "If a sampler is not set,
        # it will not be used"); a dynamic temperature range makes 0 a positive temperature;
        # XTC draws whether to cut the top tokens. A seed makes each draw the same.
        ({"temperature": 0, "samplers": ["top_k", "top_p"]}, False),
        ({"temperature": 0, "samplers": "kp"}, False),
        ({"temperature": 0, "samplers": []}, False),
        ({"temperature": 0, "samplers": ["top_k", "temperature"]}, True),
        ({"temperature": 0, "samplers": "kt"}, True),
        ({"temperature": 0, "dynatemp_range": 1.5}, False),
        ({"temperature": 0, "dynatemp_range": 0}, True),
        ({"temperature": 0, "xtc_probability": 0.5}, False),
        ({"top_k": 1, "xtc_probability": 0.5, "samplers": ["xtc", "top_k"]}, False),
        ({"temperature": 0, "xtc_probability": 0.5, "seed": 3}, True),
        # A time budget: where the answer stops depends on the machine's speed, seed or not.
        ({"temperature": 0, "t_max_predict_ms": 50}, False),
        ({"temperature": 0, "t_max_predict_ms": 50, "seed": 3}, False),
        ({"temperature": 0, "t_max_predict_ms": 0}, True),
        # (llama.cpp reads a JSON boolean as a number: true is a range of 1, a 1 ms budget.)
        ({"temperature": 0, "dynatemp_range": True}, False),
        ({"temperature": 0, "t_max_predict_ms": True}, False),
    ],
)
def test_top_k_1_is_no_determinism_where_the_engine_samples_past_it(params, shared):
    # llama-cpp-python's sampler samples the whole distribution at a negative temperature,
    # mirostat takes top_k's place, and llama.cpp's ``samplers`` may leave top-k out: three
    # "regenerates" with top_k 1 there gave three texts, and the gateway served each the first.
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **params}
    assert is_deterministic(body) is shared
    assert (key(body) is not None) is shared


@pytest.mark.parametrize("seed", [-1, 2**32 - 1, -7, 2**40])
def test_a_seed_an_engine_reads_as_random_does_not_make_a_request_shareable(seed):
    # llama.cpp's and Ollama's -1 (and llama.cpp's 0xFFFFFFFF) pick a random seed: a sampled
    # "regenerate" with it was cached, and every try got the first text.
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.8}
    assert not is_deterministic({**body, "seed": seed}) and key({**body, "seed": seed}) is None


def test_sampled_requests_share_when_opted_in_with_identical_parameters_only():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.7}
    opt_in = {"x-carpool-share": "sampled"}
    assert key(body, opt_in) is not None
    assert key(body, opt_in) == key(body, opt_in)
    assert key({**body, "temperature": 0.8}, opt_in) != key(body, opt_in)
    assert key(body, config=Config(sampling="same-params")) is not None


def test_embeddings_are_always_shareable():
    assert key({"model": "e", "input": "hello"}, path="/v1/embeddings") is not None


# --- properties -----------------------------------------------------------------------------

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(content=texts, temperature=st.sampled_from([0, 0.0, -0.0]), max_tokens=st.integers(1, 99))
def test_property_spelling_never_changes_a_key(content, temperature, max_tokens):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    respelled = {
        "max_tokens": float(max_tokens),
        "temperature": 0.0,
        "messages": [{"content": unicodedata.normalize("NFD", content), "role": "user"}],
        "model": "m",
    }
    assert key(body) == key(respelled)


@settings(max_examples=150, deadline=None)
@given(content=texts, other=texts)
def test_property_any_change_of_input_text_changes_the_key(content, other):
    same = normalize_text(content, False) == normalize_text(other, False)  # NFC, exact
    assert (key(chat(content)) == key(chat(other))) is same


@settings(max_examples=100, deadline=None)
@given(
    field=st.sampled_from(["max_tokens", "top_p", "seed", "presence_penalty", "n"]),
    a=st.integers(0, 50),
    b=st.integers(0, 50),
)
def test_property_any_change_of_a_parameter_changes_the_key(field, a, b):
    body = chat()
    changed = copy.deepcopy(body)
    body[field], changed[field] = a, b
    assert (key(body) == key(changed)) is (a == b)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list("ab \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\xa0é")), max_size=20
    )
)
def test_property_the_fast_path_agrees_with_split_and_join(text):
    assert normalize_text(text, True) == " ".join(unicodedata.normalize("NFC", text).split())


def keys_of(config, headers=None, content="How do I reset it?"):
    """Every key a request has (its answer, its idempotency record, its semantic scope) under
    ``config``: what instances sharing one Redis compare."""
    request = parse(ClientRequest(CHAT, orjson.dumps(chat(content)), headers or {}), 1 << 20)
    found = fingerprint(request, config)
    return (
        found.key,
        request_digest(request, found, config),
        semantic_view(request, found, config).scope,
    )


# What an instance's config changes in the answer it gives, or in whom it gives one to: an
# instance that differs in it (a fleet mid-change) must share none of its keys.
KEYED_SETTINGS = {
    "held key": {"upstream": {"api_key": "sk-held"}},
    "held keys": {"upstreams": ["http://a/v1"], "upstream": {"api_keys": ["sk-held"]}},
    "held URL credentials": {"upstreams": ["http://user:pw@a/v1"]},
    "collapsed white space": {"fingerprint": {"normalize_whitespace": True}},
    "neutral headers": {"fingerprint": {"neutral_headers": ["x-deployment"]}},
}


@pytest.mark.parametrize("setting", KEYED_SETTINGS)
def test_each_key_of_an_instance_whose_config_changes_the_answer_is_apart(setting):
    # (No x-deployment: a client that sends none asks both alike, but for their configs.)
    default = keys_of(Config())
    keyed = keys_of(Config(**KEYED_SETTINGS[setting]))
    assert all(mine != theirs for mine, theirs in zip(keyed, default, strict=True))


def test_each_setting_that_changes_the_answer_keys_apart_from_every_other():
    every = {setting: keys_of(Config(**config)) for setting, config in KEYED_SETTINGS.items()}
    held = [every.pop("held keys"), every.pop("held URL credentials")]
    assert all(keys == every["held key"] for keys in held)  # one notion: a credential held
    assert len({keys[0] for keys in every.values()}) == len(every)


def test_rotating_the_held_key_keeps_every_key():
    """The mark is that a key is held, not which: rotating it must not empty the cache."""
    assert keys_of(Config(upstream={"api_key": "sk-old"})) == keys_of(
        Config(upstream={"api_key": "sk-new"})
    )


def test_a_default_config_keeps_its_keys():
    """Keys of a config holding no key, collapsing nothing and naming no neutral header are
    what they were before those settings were keyed (pinned: a change of any key empties a
    fleet's shared cache at its upgrade, and must come with ``KEY_VERSION`` or
    ``ANSWER_EPOCH``)."""
    answer, digest, semantic = keys_of(Config(), {"x-deployment": "beta"})
    assert (answer, digest) == (
        "90e4ef6ee3bfdc632f8d03683bae1bc9",
        "a99b68b0af065fc6a6d7c8db01fe457e",
    )
    assert semantic == SEMANTIC_SCOPE


#: The semantic scope of ``keys_of(Config(), {"x-deployment": "beta"})`` now, and before the
#: earlier turns were normalised one by one (``view.SEMANTIC_FORMAT``).
SEMANTIC_SCOPE = "acbe09c282fe93d8478d3680c3e69bff"
SEMANTIC_SCOPE_BEFORE = "8c7bca84bcf78c52ed573404e07ee3b7"


def test_an_upgrade_shares_no_semantic_entry_with_a_release_that_compared_otherwise():
    """Before, a context collapsed whole ran its turns into one line, read as one turn: an
    older instance's entry, on one Redis, met a newer's conversation with a turn on one side
    only, read whole (served, similarity 1.0). The semantic scope moved; the answer keys, and
    with them the exact cache, stay."""
    answer, _, semantic = keys_of(Config(), {"x-deployment": "beta"})
    assert semantic != SEMANTIC_SCOPE_BEFORE
    assert answer == "90e4ef6ee3bfdc632f8d03683bae1bc9"


def test_an_upgrade_shares_no_answer_with_a_release_that_keyed_requests_together():
    """The keys of the release before ``ANSWER_EPOCH`` 1 (pinned): it keyed a Messages request
    with an Origin as one without, and on one Redis, during a rolling upgrade, its instances
    kept writing that key, whose answer (a browser's 401) the newer served to a server's
    request. No answer or semantic key of this release is one of that release's; the request
    digest, an Idempotency-Key's record, is its own still, so a retry is replayed across."""
    earlier_chat = (
        "d679d71e2632a9c7c6fe7c05bb83c605",
        "a99b68b0af065fc6a6d7c8db01fe457e",
        "1004606a6c2a04f8c7b2e5e8450302d3",
    )
    answer, digest, semantic = keys_of(Config(), {"x-deployment": "beta"})
    assert answer != earlier_chat[0] and semantic != earlier_chat[2]
    assert digest == earlier_chat[1]
    messages = {**chat(), "max_tokens": 64}
    for headers in ({}, {"origin": "https://app.example"}):
        assert key(messages, headers, path="/v1/messages") != "4c10badcf59bdf33e658d2e0942fd66c"


def test_an_upgrade_shares_no_answer_with_the_release_before_epoch_2():
    """The release before ``ANSWER_EPOCH`` 2 (pinned: its keys of the default chat and of a
    semantic scope) keyed vLLM's ``return_prompt_text`` by the NFC prompt, a
    ``prompt_logprobs`` stream as its JSON twin, stream options without a stream as none:
    during a rolling upgrade its instances' answers would be served to requests this one keys
    apart (one spelling's rendered prompt to the other)."""
    answer, digest, semantic = keys_of(Config(), {"x-deployment": "beta"})
    assert answer != "67d98a882467545047cd7148bfdef16b"
    assert semantic != "b2fc8174dc8f7cb93eb463e166ebc8c2"
    assert digest == "a99b68b0af065fc6a6d7c8db01fe457e"  # (retries replayed across)


@pytest.mark.parametrize(
    ("engine", "params", "shared"),
    [
        # TGI's and Ollama's OpenAI routes drop ``top_k`` (TGI sets none; Ollama's request type
        # has no such field): ``top_k: 1`` there samples at the temperature sent, or 1.
        ("tgi", {"top_k": 1}, False),
        ("ollama", {"top_k": 1, "temperature": 0.7}, False),
        ("generic", {"top_k": 1}, True),
        # TGI samples whenever a warper is set, ``top_p`` < 1 among them (and ``typical_p``),
        # temperature 0 or not, with a random seed of its own unless one is sent.
        ("tgi", {"temperature": 0, "top_p": 0.9}, False),
        ("tgi", {"temperature": 0, "top_p": 0.9, "seed": 3}, True),
        ("tgi", {"temperature": 0}, True),
        ("tgi", {"temperature": 0, "typical_p": 0.5}, True),  # (its OpenAI routes drop it)
        ("ollama", {"temperature": 0, "top_p": 0.9}, True),
        ("generic", {"temperature": 0, "top_p": 0.9}, True),
    ],
)
def test_an_engine_that_samples_past_the_sampling_rule_is_named_by_upstream_engine(
    engine, params, shared
):
    """The sampling rule takes ``top_k: 1`` and ``temperature: 0`` for greedy, as vLLM, SGLang
    and llama.cpp read them; TGI and Ollama, named upstreams, do not: with ``upstream.engine``
    naming them, their requests that sample are not shared (each "regenerate" was served the
    first sample)."""
    from carpool.config import Config

    config = Config(upstream={"engine": engine})
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **params}
    assert (key(body, config=config) is not None) is shared


def test_stream_options_without_a_stream_are_in_the_key():
    # vLLM and OpenAI answer such a request 400; it was keyed as the plain request and served
    # that request's stored 200 (a review).
    for options in ({"include_usage": True}, {"include_usage": False}):
        assert key(chat(stream_options=options)) != key(chat()), options
        assert key(chat(stream=False, stream_options=options)) != key(chat(stream=False))
    assert key(chat(stream=True, stream_options={"include_usage": True})) == key(chat())
    assert key(chat(stream_options=None)) == key(chat(stream_options={})) == key(chat())
    # Never a stream's key, whatever the options (the stream's keyed otherwise came out equal).
    for options in (
        {"include_usage": True, "continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
        {"continuous_usage_stats": False},
    ):
        for streamed in (
            options,
            {k: v for k, v in options.items() if k != "include_usage"},
            {**options, "include_usage": True},
        ):
            assert key(chat(stream_options=options)) != key(
                chat(stream=True, stream_options=streamed)
            ), (options, streamed)
