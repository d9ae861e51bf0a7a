"""The audits' estimate and the error budget (``carpool.semantic.audit``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from carpool.semantic.audit import BACKED_OFF, MARK, SERVING, Audits, answer_text, wilson


def test_the_wilson_estimate_matches_its_formula_on_known_values() -> None:
    assert wilson(0, 0) == (0.0, 0.0, 1.0)  # no audits: nothing known
    estimate, low, high = wilson(5, 100)
    assert estimate == 0.05
    assert math.isclose(low, 0.02154, abs_tol=1e-4) and math.isclose(high, 0.11175, abs_tol=1e-4)
    _, low, high = wilson(0, 10)
    assert low == 0.0 and math.isclose(high, 0.27753, abs_tol=1e-4)
    _, low, high = wilson(10, 10)
    assert math.isclose(low, 0.72247, abs_tol=1e-4) and math.isclose(high, 1.0)


@given(st.integers(0, 2000), st.integers(1, 2000))
@example(0, 249)  # (rounding once put the low bound 8.7e-19 above an estimate of 0)
def test_the_interval_always_holds_the_estimate(wrong: int, extra: int) -> None:
    n = wrong + extra
    estimate, low, high = wilson(wrong, n)
    assert 0 <= low <= estimate <= high <= 1


def test_audits_are_sampled_at_the_rate() -> None:
    draws = iter([0.05, 0.5, 0.09, 0.1])
    audits = Audits(0.1, sample=lambda: next(draws))
    assert [audits.sampled() for _ in range(4)] == [True, False, True, False]
    assert Audits(0.0, sample=lambda: 0.0).sampled() is False


def test_without_a_budget_a_namespace_keeps_serving_whatever_its_rate() -> None:
    audits = Audits(1.0)
    for _ in range(50):
        audits.record("faq", True)
    report = audits.snapshot()["faq"]
    assert report["state"] == SERVING and report["audited"] == report["wrong"] == 50
    assert report["estimate"] == 1.0


def test_a_namespace_over_budget_backs_off_then_marks_while_another_keeps_serving() -> None:
    audits = Audits(1.0, window=100, budget=0.05)
    for _ in range(20):
        audits.record("other", False)
    audits.record("faq", True)  # one wrong of one: the interval's low bound is 0.21 > 0.05
    assert audits.state("faq") == BACKED_OFF
    assert audits.snapshot()["faq"]["audited"] == 1  # in all, though the window starts afresh
    audits.record("faq", True, near=True)  # a near repeat wrong too: the backed-off bar fails
    assert audits.state("faq") == MARK
    audits.record("faq", True, near=True)
    assert audits.state("faq") == MARK  # the last step
    assert audits.state("other") == SERVING
    assert audits.state("never audited") == SERVING


def test_a_backed_off_namespace_is_judged_on_the_near_repeats_it_still_serves() -> None:
    audits = Audits(1.0, window=100, budget=0.05)
    audits.record("faq", True)
    assert audits.state("faq") == BACKED_OFF
    for _ in range(30):  # the usual bar stays wrong, the near repeats right
        audits.record("faq", True)
        audits.record("faq", False, near=True)
    assert audits.state("faq") == BACKED_OFF  # not marked: what it serves is right
    report = audits.snapshot()["faq"]  # the estimate of the bar it serves at
    assert report["estimate"] == 0.0 and report["high"] < 0.15


def test_a_namespace_comes_back_one_step_at_a_time_once_under_budget() -> None:
    audits = Audits(1.0, window=100, budget=0.5)
    for _ in range(4):  # 4 of 4 wrong: low bound 0.51 > 0.5
        audits.record("faq", True)
    assert audits.state("faq") == BACKED_OFF
    for _ in range(4):
        audits.record("faq", True, near=True)
    assert audits.state("faq") == MARK
    steps = []
    for _ in range(4):  # far matches right: nothing a marked namespace would serve next
        audits.record("faq", False)
        steps.append(audits.state("faq"))
    for _ in range(4):  # near repeats right: the upper bound falls under 0.5 after 4
        audits.record("faq", False, near=True)
        steps.append(audits.state("faq"))
    for _ in range(4):  # and the usual bar right: serving again
        audits.record("faq", False)
        steps.append(audits.state("faq"))
    assert steps == [MARK] * 7 + [BACKED_OFF] * 4 + [SERVING]


def test_reset_puts_namespaces_back_to_serving_with_no_audits() -> None:
    audits = Audits(1.0, budget=0.05)
    audits.record("a", True)
    audits.record("b", True)
    assert audits.reset("a") == 1 and audits.state("a") == SERVING
    assert "a" not in audits.snapshot() and audits.state("b") == BACKED_OFF
    assert audits.reset("nothing") == 0
    assert audits.reset() == 1 and audits.snapshot() == {}


def test_the_totals_outlast_a_reset_of_one_namespace_or_all() -> None:
    audits = Audits(1.0, budget=0.05)
    for _ in range(3):
        audits.record("a", False)
    audits.record("b", True)
    audits.reset("a")
    audits.record("a", True)
    assert audits.snapshot()["a"]["audited"] == 1
    assert audits.totals() == {"a": (4, 1), "b": (1, 1)}
    audits.reset()
    assert audits.snapshot() == {} and audits.totals() == {"a": (4, 1), "b": (1, 1)}


def test_the_window_is_the_latest_audits() -> None:
    audits = Audits(1.0, window=10)
    for wrong in [True] * 10 + [False] * 10:
        audits.record("faq", wrong)
    report = audits.snapshot()["faq"]
    assert report["estimate"] == 0.0 and (report["audited"], report["wrong"]) == (20, 10)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"choices": [{"message": {"role": "assistant", "content": "Four."}}]}, "Four."),
        ({"choices": [{"text": " four"}]}, " four"),
        ({"output": [{"type": "message", "content": [{"type": "output_text", "text": "4"}]}]}, "4"),
        ({"content": [{"type": "text", "text": "IV"}]}, "IV"),
        ({"data": [], "id": "x"}, '{"data":[]}'),
    ],
)
def test_the_text_of_an_answer_for_every_api(body: object, text: str) -> None:
    assert answer_text(body) == text


def _chat_call(call_id: str, arguments: str, created: int) -> dict:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "weather", "arguments": arguments},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"id": f"chatcmpl-{call_id}", "created": created, "choices": [{"message": message}]}


def test_two_answers_making_the_same_tool_call_say_the_same_whatever_their_ids():
    # A tool call was compared as its whole body, ids and times included: every audit of one
    # was "wrong", and the error budget stopped the namespace serving.
    same = _chat_call("call_1", '{"city": "Paris", "unit": "C"}', 1)
    other = _chat_call("call_2", '{"unit":"C","city":"Paris"}', 2)
    assert answer_text(same) == answer_text(other) == 'weather {"city":"Paris","unit":"C"}'
    assert answer_text(_chat_call("call_3", '{"city": "Rome"}', 3)) != answer_text(same)
    responses = {
        "id": "resp_1",
        "output": [
            {
                "type": "function_call",
                "call_id": "c",
                "name": "weather",
                "arguments": '{"city":"Paris"}',
            }
        ],
    }
    messages = {
        "id": "msg_1",
        "content": [{"type": "tool_use", "id": "t", "name": "weather", "input": {"city": "Paris"}}],
    }
    assert answer_text(responses) == answer_text(messages) == 'weather {"city":"Paris"}'
