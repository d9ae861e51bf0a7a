"""Properties of the parser and the fingerprint, over generated chat bodies (issue #8, part 2).

What must never change a key: JSON key order (but within the fields that carry a schema or a
tool, whose key order the answer follows), the spelling of a number, the Unicode composition of
text (but in embeddings inputs, which are exact), the fields the contract excludes (``user``,
``stream``, ``stream_options``, ``metadata``, request ids) and transport headers. What must always
change it: any change of a field that can change the output (model, messages, sampling
parameters, tools...), of the tenant, the namespace or the freshness token. And what the parser
does with anything at all: a ``Request`` or a ``RequestError``, never another exception.

Each property is compared with a reference equality written here, independently of
``fingerprint.py``: numbers by value (``1 == 1.0``, booleans apart), strings after NFC, message
text after NFC only: white space is meaning (collapsing it is an opt-in, checked on its own);
objects whatever their key order, but in ``ORDERED`` fields.
"""

from __future__ import annotations

import json
import random
import string
import unicodedata
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.config import Config
from carpool.errors import RequestError
from carpool.fingerprint import fingerprint, request_digest, semantic_view
from carpool.request import ClientRequest, parse

CHAT = "/v1/chat/completions"
CONFIG = Config()
SHARE = {"x-carpool-share": "sampled"}  # every chat request gets a key, sampled ones too
PROPERTY = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def request_of(body: Any, headers: dict[str, str] | None = None, path: str = CHAT):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse(ClientRequest(path, raw, {**SHARE, **(headers or {})}), 1 << 24)


def key(body: Any, headers: dict[str, str] | None = None, path: str = CHAT) -> str | None:
    return fingerprint(request_of(body, headers, path), CONFIG).key


def digests(body: Any, headers: dict[str, str] | None = None) -> tuple[Any, ...]:
    """The key, the idempotency digest and the semantic scope and text of one request."""
    request = request_of(body, headers)
    fp = fingerprint(request, CONFIG)
    view = semantic_view(request, fp, CONFIG)
    return fp.key, request_digest(request, fp, CONFIG), view


# --- strategies -----------------------------------------------------------------------------

# Text: any code point but surrogates (not valid UTF-8, refused by the parser), with combining
# marks and precomposed letters over-represented so that NFC/NFD differences come up often.
_ACCENTED = "éèêëñçåÅÉöüÿǅﬁΩΆἀ한글가각\u0301\u0300\u0308\u0327\u030a\u0345"
texts = st.text(
    alphabet=st.one_of(st.characters(exclude_categories=("Cs",)), st.sampled_from(_ACCENTED)),
    max_size=24,
)
# Message text without ``` (fences keep white space; the reference collapses it everywhere).
prose = texts.filter(lambda t: "`" not in t)
names = st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=8)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    texts,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(names, inner, max_size=3)),
    max_leaves=8,
)

content = st.one_of(
    prose,
    st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": prose}), min_size=1, max_size=2
    ),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
        "content": content,
    },
    optional={"name": names},
)
messages = st.lists(message, min_size=1, max_size=4)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": names}, optional={"description": texts, "parameters": json_values}
        ),
    }
)

# Every field that can change the output, each with values of its own type.
OUTPUT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": texts,
    "messages": messages,
    "temperature": st.one_of(st.integers(0, 2), st.floats(0, 2)),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 100),
    "max_tokens": st.integers(1, 2**64 - 1),
    "max_completion_tokens": st.integers(1, 4096),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 8),
    "stop": st.one_of(texts, st.lists(texts, max_size=4)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(
        st.integers(0, 50000).map(str), st.integers(-100, 100), max_size=3
    ),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": json_values}),
    ),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values),
    "some_future_field": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "gpt-4o", "llama-3-8b"]), "messages": messages},
    optional={k: v for k, v in OUTPUT_FIELDS.items() if k not in ("model", "messages")},
)


# --- reference equality and respelling ---------------------------------------------------------

# The generated fields whose objects keep their key order in a key: a schema's order is the
# order of the keys of the answer written to it, a tool's is the order a chat template renders.
ORDERED = frozenset({"response_format", "tools"})


def ref(value: Any, *, text: bool = False, ordered: bool = False) -> Any:
    """A value up to what the contract calls the same: numbers by value, strings exact but the
    input text (``text``) in NFC, objects whatever their key order (``ordered``: in it, and an
    int apart from a float)."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, (int, float)):
        if ordered:  # (rendered as text: 1 and 1.0 are two)
            return ("number", type(value).__name__, value)
        return ("number", value)  # Python compares int and float exactly
    if isinstance(value, str):
        # (outside the input text, as written: a stop sequence is matched by its code points,
        # an enum value copied into the answer)
        return ("text", unicodedata.normalize("NFC", value) if text else value)
    if isinstance(value, list):
        return ("list", tuple(ref(v, text=text, ordered=ordered) for v in value))
    members = [(k, ref(v, text=text, ordered=ordered)) for k, v in value.items()]
    return ("object", tuple(members if ordered else sorted(members)))


def ref_messages(value: list[dict[str, Any]]) -> Any:
    out = []
    for m in value:
        parts = m["content"]
        content = (
            ref(parts, text=True)
            if isinstance(parts, str)
            else ("list", tuple(ref(p, text=True) for p in parts))
        )
        out.append((ref({k: v for k, v in m.items() if k != "content"}), content))
    return tuple(out)


def ref_field(name: str, value: Any) -> Any:
    return ref_messages(value) if name == "messages" else ref(value, ordered=name in ORDERED)


def shuffled(value: Any, rng: random.Random, *, keep: frozenset[str] = frozenset()) -> Any:
    """``value`` with the members of every object in another order (but inside the members
    named in ``keep``, of the outermost object)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: v if k in keep else shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def decomposed(body: dict[str, Any], form: str) -> dict[str, Any]:
    """``body`` with its input text (every message's content, a string or its text parts) in
    Unicode normal form ``form``; every other string as it was (exact there: a stop sequence,
    a schema's strings)."""

    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "text": unicodedata.normalize(form, p["text"])}

    return {
        **body,
        "messages": [
            {
                **m,
                "content": unicodedata.normalize(form, m["content"])
                if isinstance(m["content"], str)
                else [part(p) for p in m["content"]],
            }
            for m in body["messages"]
        ],
    }


INTEGER_FIELDS = {"top_k", "seed", "n"}  # the parser wants JSON integers there (as OpenAI does)


def spelled(
    value: Any, rng: random.Random, *, integral_only: bool = False, ordered: bool = False
) -> str:
    """``value`` as JSON text, each number spelled one of the ways that denote the same value
    (``ordered``: an int as an int and a float as a float, the same double)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int):
        options = [str(value)]
        if value == 0 and not ordered:
            options.append("-0")
        if not (integral_only or ordered) and float(value) == value:  # the same as a float
            options += [f"{value}.0", f"{value}e0", f"{value}.000E+0"]
            if value:
                options.append(f"{value}0e-1")  # "00e-1" is not JSON (leading zero)
        return rng.choice(options)
    if isinstance(value, float):
        options = [repr(value), f"{value:.17e}", f"{value:.17g}", f"{value:.25E}"]
        if value.is_integer() and not ordered:
            options.append(str(int(value)))
        if ordered:  # (a float spelled without a point or an exponent is parsed as an int)
            options = [o for o in options if any(c in o for c in ".eE")]
        return rng.choice(options)
    if isinstance(value, list):
        return "[" + ",".join(spelled(v, rng, ordered=ordered) for v in value) + "]"
    return (
        "{"
        + ",".join(json.dumps(k) + ":" + spelled(v, rng, ordered=ordered) for k, v in value.items())
        + "}"
    )


# --- what never changes a key --------------------------------------------------------------------


@PROPERTY
@given(body=chat_bodies, rng=st.randoms(use_true_random=False))
def test_key_order_never_changes_a_fingerprint(body, rng):
    reordered = shuffled(body, rng, keep=ORDERED)
    assert digests(reordered) == digests(body)
    # As raw bytes too, as a client would send them.
    assert key(json.dumps(reordered).encode()) == key(body)


@PROPERTY
@given(body=chat_bodies, rng=st.randoms(use_true_random=False))
def test_key_order_within_a_schema_or_a_tool_changes_a_fingerprint(body, rng):
    """Structured outputs write an object's keys in its schema's order, chat templates render
    tools as given: there, another order is another request."""
    reordered = shuffled(body, rng)
    same = all(ref_field(k, reordered[k]) == ref_field(k, v) for k, v in body.items())
    assert (key(reordered) == key(body)) is same


@PROPERTY
@given(body=chat_bodies, rng=st.randoms(use_true_random=False))
def test_number_spelling_never_changes_a_fingerprint(body, rng):
    """0 / 0.0 / -0 / 0e0, 1 / 1.0 / 1e0 / 10e-1, 0.5 / 5.00000000000000000e-01: one value (in
    a schema or a tool, rendered as text, an int and a float are two: there 1.0 / 1e0 alone)."""
    raw = (
        "{"
        + ",".join(
            json.dumps(k)
            + ":"
            + spelled(v, rng, integral_only=k in INTEGER_FIELDS, ordered=k in ORDERED)
            for k, v in body.items()
        )
        + "}"
    )
    assert key(raw.encode()) == key(body)


@pytest.mark.parametrize("value", [2**53, 2**60, 2**63 - 1024, 2**64 - 2048, -(2**63), 10**20])
def test_a_large_integer_and_its_float_spelling_are_one_fingerprint(value):
    """Integral numbers beyond 2**53 (a 64-bit seed, a token budget) are integers in any
    spelling, up to the parser's integer range (past it every spelling is the same double)."""
    assert float(value) == value
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    as_int = json.dumps({**body, "max_tokens": value}).encode()
    as_float = json.dumps({**body, "max_tokens": float(value)}).encode()
    assert key(as_int) == key(as_float)


@PROPERTY
@given(body=chat_bodies, form=st.sampled_from(["NFC", "NFD"]))
def test_unicode_composition_never_changes_a_fingerprint(body, form):
    """NFC and NFD of the same input text are one request: the input text is compared in NFC
    (every other string is exact: a stop sequence, a schema's strings)."""
    assert digests(decomposed(body, form)) == digests(body)


@PROPERTY
@given(text=texts, field=st.sampled_from(["stop", "guided_choice", "guided_regex", "model"]))
def test_unicode_composition_of_any_other_string_is_exact(text, field):
    """A stop sequence, a guided choice or a regex is matched against the code points the
    engine writes: there NFC and NFD are two requests (unless they are the same text)."""
    nfd, nfc = unicodedata.normalize("NFD", text), unicodedata.normalize("NFC", text)
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    assert (key({**body, field: nfd}) == key({**body, field: nfc})) is (nfd == nfc)


@PROPERTY
@given(text=prose)
def test_canonically_equivalent_prompts_are_one_fingerprint_but_embeddings_inputs_are_exact(text):
    nfd, nfc = unicodedata.normalize("NFD", text), unicodedata.normalize("NFC", text)
    assert key({"model": "m", "temperature": 0, "prompt": nfd}, path="/v1/completions") == key(
        {"model": "m", "temperature": 0, "prompt": nfc}, path="/v1/completions"
    )
    # An embedding is of the code points sent, which tokenize apart.
    assert (
        key({"model": "e", "input": [nfd, "b"]}, path="/v1/embeddings")
        == key({"model": "e", "input": [nfc, "b"]}, path="/v1/embeddings")
    ) is (nfd == nfc)


SPACES = st.sampled_from(
    [" ", "  ", "\n", "\t", " \n ", "\u00a0", "\u3000", "  \n", "\r\n", "\x0b", "\x1f"]
)


def _respaced(body: dict[str, Any], pad: list[str]) -> dict[str, Any]:
    return {
        **body,
        "messages": [
            {**m, "content": pad[0] + m["content"].replace(" ", pad[1]) + pad[2]}
            if isinstance(m["content"], str)
            else m
            for m in body["messages"]
        ],
    }


@PROPERTY
@given(body=chat_bodies, pad=st.lists(SPACES, min_size=3, max_size=3))
def test_white_space_is_meaning_any_change_of_it_changes_a_fingerprint(body, pad):
    respaced = _respaced(body, pad)
    assert (key(respaced) == key(body)) is (
        ref_field("messages", respaced["messages"]) == ref_field("messages", body["messages"])
    )


@PROPERTY
@given(
    body=chat_bodies,
    pad=st.lists(st.sampled_from([" ", "  ", "\n", "\t", " \n "]), min_size=3, max_size=3),
)
def test_with_collapse_opted_in_white_space_runs_and_ends_never_change_a_fingerprint(body, pad):
    collapse = Config(fingerprint={"normalize_whitespace": True})

    def collapsed(body: dict[str, Any]) -> str | None:
        return fingerprint(request_of(body), collapse).key

    assert collapsed(_respaced(body, pad)) == collapsed(body)


@PROPERTY
@given(
    body=chat_bodies,
    name=st.sampled_from(
        ["authorization", "api-key", "x-api-key", "openai-organization", "openai-project"]
    ),
    a=st.text(string.ascii_letters + string.digits + "-_ ", min_size=1, max_size=20),
    b=st.text(string.ascii_letters + string.digits + "-_ ", min_size=1, max_size=20),
    other=st.dictionaries(
        st.sampled_from(["authorization", "api-key", "x-api-key"]),
        st.sampled_from(["k1", "k2"]),
        max_size=2,
    ),
)
def test_any_credential_header_makes_the_tenant(body, name, a, b, other):
    base = {k: v for k, v in other.items() if k != name}
    assert (
        key(body, {**base, name: a.strip() or "x"}) == key(body, {**base, name: b.strip() or "x"})
    ) is ((a.strip() or "x") == (b.strip() or "x"))
    assert key(body, {**base, name: "k"}) != key(body, base)  # present vs absent


excluded = st.fixed_dictionaries(
    {},
    optional={
        "user": json_values,
        "stream": st.booleans(),
        "stream_options": st.one_of(
            st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})
        ),
        "metadata": json_values,
        "request_id": json_values,
    },
).map(
    # Stream options are out of a stream's key only: without one, where the engines refuse
    # them, they are in it (``canonical``).
    lambda extra: {**extra, "stream": True} if extra.get("stream_options") else extra
)
transport = st.dictionaries(
    st.sampled_from(
        [
            "x-request-id",
            "user-agent",
            "traceparent",
            "tracestate",
            "x-stainless-lang",
            "x-stainless-retry-count",
            "x-ms-client-request-id",
            "amz-sdk-request",
            "accept",
            "accept-encoding",
            "content-type",
            "cache-control",
            "x-amz-cf-id",  # (tags are in the key now: an answer is invalidated by them)
            "connection",
            "x-forwarded-for",
        ]
    ),
    st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=12),
    max_size=5,
)


@PROPERTY
@given(body=chat_bodies, extra=excluded, headers=transport)
def test_excluded_fields_and_transport_headers_never_change_a_fingerprint(body, extra, headers):
    if "cache-control" in headers:
        headers["cache-control"] = random.Random(headers["cache-control"]).choice(
            ["no-cache", "no-store", "max-age=5"]
        )
    before = key(body)
    assert key({**body, **extra}, headers) == before
    assert key({**extra, **body}, headers) == before


# --- what always changes a key --------------------------------------------------------------------


@PROPERTY
@given(base=chat_bodies, data=st.data())
def test_any_change_of_an_output_affecting_field_changes_the_fingerprint(base, data):
    name = data.draw(st.sampled_from(sorted(OUTPUT_FIELDS)), label="field")
    a = data.draw(OUTPUT_FIELDS[name], label="a")
    b = data.draw(st.one_of(OUTPUT_FIELDS[name], st.just(a)), label="b")
    same = ref_field(name, a) == ref_field(name, b)
    assert (key({**base, name: a}) == key({**base, name: b})) is same
    if name != "model" and name != "messages":
        # Absent and present are different requests too (an absent field is the upstream's
        # default, which the gateway does not know).
        without = {k: v for k, v in base.items() if k != name}
        assert key(without) != key({**without, name: a})


@PROPERTY
@given(base=chat_bodies, rng=st.randoms(use_true_random=False), data=st.data())
def test_messages_role_content_and_order_change_the_fingerprint(base, rng, data):
    msgs = base["messages"]
    reordered = list(msgs)
    rng.shuffle(reordered)
    assert (key({**base, "messages": reordered}) == key(base)) is (
        ref_messages(reordered) == ref_messages(msgs)
    )
    i = data.draw(st.integers(0, len(msgs) - 1), label="i")
    role = data.draw(st.sampled_from(["system", "user", "assistant", "tool"]), label="role")
    edited = [*msgs[:i], {**msgs[i], "role": role}, *msgs[i + 1 :]]
    assert (key({**base, "messages": edited}) == key(base)) is (role == msgs[i]["role"])
    dropped = msgs[:i] + msgs[i + 1 :]
    if dropped:
        assert key({**base, "messages": dropped}) != key(base)


scope_tokens = st.text(
    alphabet=string.ascii_letters + string.digits + "*?[]{}:-_/.", min_size=1, max_size=20
)


@PROPERTY
@given(
    body=chat_bodies,
    header=st.sampled_from(["authorization", "x-carpool-namespace", "x-carpool-freshness"]),
    a=scope_tokens,
    b=scope_tokens,
)
def test_tenant_namespace_and_freshness_always_scope_the_fingerprint(body, header, a, b):
    keys = key(body, {header: a}), key(body, {header: b})
    assert (keys[0] == keys[1]) is (a == b)
    assert key(body, {header: a}) != key(body)
    assert digests(body, {header: a})[1] != digests(body)[1]


@PROPERTY
@given(body=chat_bodies)
def test_endpoints_never_share_a_fingerprint(body):
    text = body["messages"][-1]["content"]
    if not isinstance(text, str):
        text = "x"
    chat = key({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]})
    completion = key({"model": "m", "temperature": 0, "prompt": text}, path="/v1/completions")
    embedding = key({"model": "m", "input": text}, path="/v1/embeddings")
    assert len({chat, completion, embedding}) == 3


# --- the parser on anything at all ------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    body=st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(
                [
                    "model",
                    "messages",
                    "prompt",
                    "input",
                    "stream",
                    "temperature",
                    "top_p",
                    "top_k",
                    "seed",
                    "n",
                    "stream_options",
                    "user",
                ]
            ),
            json_values,
            max_size=6,
        ),
    ),
    headers=st.dictionaries(
        st.sampled_from(
            [
                "cache-control",
                "x-carpool-namespace",
                "x-carpool-type",
                "x-carpool-tags",
                "x-carpool-freshness",
                "x-carpool-share",
                "authorization",
            ]
        ),
        st.text(max_size=30),
        max_size=3,
    ),
)
def test_the_parser_answers_any_json_with_a_request_or_a_request_error(path, body, headers):
    try:
        request = parse(ClientRequest(path, orjson.dumps(body), headers), 1 << 20)
    except RequestError as error:
        assert error.status in (400, 413) and error.message
        return
    fp = fingerprint(request, CONFIG)  # and whatever was accepted can be keyed
    assert fp.key is None or (len(fp.key) == 32 and set(fp.key) <= set(string.hexdigits))
    semantic_view(request, fp, CONFIG)
    request_digest(request, fp, CONFIG)


@settings(max_examples=100, deadline=None)
@given(raw=st.one_of(st.binary(max_size=64), texts.map(str.encode)))
def test_the_parser_answers_any_bytes_with_a_request_or_a_request_error(raw):
    try:
        parse(ClientRequest(CHAT, raw, {}), 1 << 20)
    except RequestError:
        pass


@PROPERTY
@given(body=chat_bodies, secret=st.text(alphabet=string.ascii_letters, min_size=12, max_size=40))
def test_a_key_is_a_digest_carrying_no_credential_and_no_prompt(body, secret):
    headers = {"authorization": f"Bearer sk-{secret}"}
    request = request_of(body, headers)
    fp = fingerprint(request, CONFIG)
    assert fp.key is not None and len(fp.key) == 32 and int(fp.key, 16) >= 0
    assert secret not in fp.tenant and len(fp.tenant) == 16
    for m in body["messages"]:
        if isinstance(m["content"], str) and len(m["content"]) > 3:
            assert m["content"] not in fp.key
