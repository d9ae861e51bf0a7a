"""``carpool eval-semantic``: score the semantic cache's decisions on labeled prompt pairs.

Contract:
- Input: JSONL rows ``{"a", "b", "same_answer", "category"?}``; ``a``/``b`` a string (one user
  turn) or a list of chat messages, each side a chat request the gateway would take (else a
  ``ValueError`` naming the file and line). ``a`` plays the cached request, ``b`` the new one.
  A file that is not UTF-8, or files (or a half) with no pair at all, are a ``ValueError`` too:
  never a report of nothing. Lines are read as ``carpool bench`` reads its workload files
  (``carpool.jsonl``: a U+2028 in a text is part of its line; a message names the line by its
  number in the file, blank lines counted), each row as the gateway reads a body (orjson: a
  lone surrogate is not JSON).
- Each pair is decided exactly as the gateway decides it: both sides become chat requests
  (``temperature: 0``, one model); sides with the same exact key (``Fingerprint.key``) are
  served (``exact``: the exact cache's hit, with or without a semantic view); otherwise they
  go through ``fingerprint.semantic_view`` (with the
  gateway's config: ``semantic.english_only``, ``scripts`` and ``max_text_chars`` decide which
  sides have a view at all) and ``cache.focus``; a different scope (system prompt, earlier
  turns, a long head) is a miss; otherwise the cosine similarity of the last user turns (their
  tails) must reach the threshold and the pair must pass the guard (``Guard.judge_now(new=b,
  [cached=a])``: the exact rules, then the verifier on the turns and, for conversations, on
  their earlier turns).
- ``half``: ``even`` (the development half: pairs 0, 2, 4... of each file, in its order, blank
  lines not counted) or ``odd`` (the held-out half), or every pair (None): rules and settings are
  tuned on one half and reported on the other.
- Output: per category, and in totals kept apart from the categories (a category may be named
  ``all``), for conversations (pairs where either side has more than one turn besides a system
  or developer prompt) and overall, the share of should-hit pairs served ("hit rate") and of
  should-miss pairs served ("wrong-hit rate"); ``--decisions`` writes one row per pair;
  ``--sweep`` prints both rates over a range of similarity thresholds and verifier thresholds
  (the guard included), which is how the defaults were calibrated. A :class:`LabeledJudge`
  decides the same pairs in the report, the decisions and the sweep. ``--one-scope``
  (``Evaluator.one_scope``) also looks each ``b`` up among every pair's ``a`` as one cache
  would, counting apart the lookups served another prompt's answer (not labelled).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy
import orjson

from ..config import Config
from ..errors import RequestError
from ..fingerprint import INSTRUCTION_ROLES, SemanticView, fingerprint, semantic_view
from ..jsonl import numbered_lines
from ..request import ClientRequest, parse
from .cache import focus
from .guard import RulesThenVerifier, Scored, Side
from .verdict import Reason


@dataclass(slots=True)
class Pair:
    a: Any
    b: Any
    same_answer: bool
    category: str
    where: str = ""  # "FILE, line N": what an error about the pair names

    @property
    def conversation(self) -> bool:
        return any(
            isinstance(side, list)
            # A developer prompt is an instruction, as the gateway reads it: no turn.
            and sum(
                1 for m in side if isinstance(m, dict) and m.get("role") not in INSTRUCTION_ROLES
            )
            > 1
            for side in (self.a, self.b)
        )


@dataclass(slots=True)
class Decision:
    hit: bool
    similarity: float
    reason: str  # "served", "exact", "scope", "below_threshold", the guard's reason, "judge"
    score: float | None = None  # the verifier's, when it was asked
    judged: bool = False  # decided by the (labeled) judge


@dataclass(frozen=True, slots=True)
class LabeledJudge:
    """``semantic.judge`` at its best, answering from the pair's own label: it decides the pairs
    in the similarity ``band`` that only the verifier judged (with a score in ``verifier_band``)
    or that a rule in ``overrules`` refused (what a judge can buy, and how often it is asked)."""

    band: tuple[float, float]
    overrules: frozenset[str] = frozenset()
    verifier_band: tuple[float, float] = (0.0, 1.0)


HALVES = ("even", "odd")
#: The report's totals: kept apart from the categories, whatever those are named.
TOTALS = ("conversations", "all")


def load_pairs(paths: Iterable[str | Path], half: str | None = None) -> list[Pair]:
    """The pairs of every file, or of one ``half`` of each (``even``/``odd`` rows, counting the
    non-empty lines of each file from 0: a blank line moves no pair to the other half)."""
    if half is not None and half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    pairs = []
    for path in paths:
        try:
            text = Path(path).read_bytes().decode()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        for n, (number, line) in enumerate(numbered_lines(text)):
            if half is not None and n % 2 != HALVES.index(half):
                continue
            pairs.append(_pair(row_of(path, number, line), path, number))
    if not pairs:  # (a report of no pairs would read as a report)
        where = ", ".join(str(p) for p in paths)
        raise ValueError(f"no pairs in {where}" + (f" (in its {half} half)" if half else ""))
    return pairs


def row_of(path: str | Path, number: int, line: str) -> dict[str, Any]:
    """Line ``number`` (from 1) of a pairs file as a row ``{a, b, same_answer}``, or a
    ``ValueError`` naming the file and line: ``same_answer`` a JSON boolean (``"false"`` was read
    as true)."""
    try:
        # As the gateway reads a body: what it refuses (a lone surrogate) is no pair to score.
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {number}: not a JSON object")
    for side in ("a", "b"):
        if not isinstance(row.get(side), str | list):
            raise ValueError(f"{path}, line {number}: {side!r} must be a text or a conversation")
    if not isinstance(row.get("same_answer"), bool):
        raise ValueError(f"{path}, line {number}: 'same_answer' must be true or false")
    return row


def _pair(row: dict[str, Any], path: str | Path, number: int) -> Pair:
    category = str(row.get("category") or Path(path).stem)
    return Pair(row["a"], row["b"], row["same_answer"], category, f"{path}, line {number}")


def _view(side: Any, config: Config) -> tuple[str | None, SemanticView | None]:
    """The side's exact key (``Fingerprint.key``: None, not shared) and its semantic view, if
    it has one."""
    messages = [{"role": "user", "content": side}] if isinstance(side, str) else side
    body = orjson.dumps({"model": "m", "temperature": 0, "messages": messages})
    request = parse(ClientRequest("/v1/chat/completions", body, {}), 1 << 30)
    print_ = fingerprint(request, config)
    view = semantic_view(request, print_, config)
    return print_.key, focus(view) if view is not None else None


class Evaluator:
    """Embeds every distinct text once, judges each pair once, then decides pairs at any
    similarity threshold and verifier threshold."""

    def __init__(
        self,
        pairs: Sequence[Pair],
        embedder: Any,
        guard: RulesThenVerifier,
        config: Config | None = None,
    ):
        self.pairs = pairs
        self.guard = guard
        config = config or Config()
        self.views = []
        self.keys: list[tuple[str | None, str | None]] = []  # per pair: its sides' exact keys
        self.exact: list[bool] = []  # per pair: the same exact key (an exact hit, view or none)
        for p in pairs:
            try:
                (key_a, a), (key_b, b) = _view(p.a, config), _view(p.b, config)
            except RequestError as error:  # (a side the gateway would refuse: no pair to score)
                raise ValueError(f"{p.where}: not a chat request: {error.message}") from None
            self.views.append((a, b))
            self.keys.append((key_a, key_b))
            self.exact.append(key_a is not None and key_a == key_b)
        texts = sorted({v.text for pair in self.views for v in pair if v is not None})
        vectors = embedder.encode(texts) if texts else []
        row = {text: i for i, text in enumerate(texts)}
        self._vectors, self._row = vectors, row  # (``one_scope`` compares every pair's)
        self.similarity: list[float | None] = []
        for a, b in self.views:
            if a is None or b is None or a.scope != b.scope:
                self.similarity.append(None)
                continue
            self.similarity.append(float(vectors[row[a.text]] @ vectors[row[b.text]]))
        self._scored: dict[int, Scored] = {}  # the model asked once per pair

    def decide(
        self,
        i: int,
        threshold: float,
        verifier_threshold: float | None = None,
        judge: LabeledJudge | None = None,
    ) -> Decision:
        """Pair ``i``'s decision at these thresholds, with ``judge`` (:class:`LabeledJudge`)
        deciding the pairs it would be asked about."""
        similarity = self.similarity[i]
        if self.exact[i]:  # (the gateway's exact cache answers it, whatever its view)
            return Decision(True, 1.0, "exact")
        if similarity is None:
            return Decision(False, 0.0, "scope")
        if similarity < threshold:
            return Decision(False, similarity, "below_threshold")
        scored = self._scored.get(i)
        if scored is None:
            cached, new = self.views[i]
            assert cached is not None and new is not None  # (a similarity implies both views)
            scored = self._scored[i] = self.guard.scored_now(
                Side(new.text, new.context), [Side(cached.text, cached.context)]
            )
        (verdict,) = self.guard.decide(scored, [similarity], verifier_threshold)
        if (
            judge is not None
            and judge.band[0] <= similarity <= judge.band[1]
            and (
                str(verdict.reason) in judge.overrules
                or (
                    (verdict.ok or verdict.reason in (Reason.MEANING, Reason.CONTEXT))
                    and (
                        verdict.score is None
                        or judge.verifier_band[0] <= verdict.score <= judge.verifier_band[1]
                    )
                )
            )
        ):
            same = self.pairs[i].same_answer
            return Decision(same, similarity, "judge", verdict.score, judged=True)
        return Decision(
            verdict.ok, similarity, "served" if verdict.ok else str(verdict.reason), verdict.score
        )

    def one_scope(
        self, threshold: float, candidates: int, verifier_threshold: float | None = None
    ) -> dict[str, dict[str, dict[str, int]]]:
        """The pairs as one cache meets them: every pair's ``a`` cached (each in its scope), then
        each ``b`` looked up as ``SemanticCache.probe`` looks it up: its ``candidates`` nearest
        entries at or above ``threshold`` (an exact search; the index's is approximate), most
        similar first, the first the guard passes served (the cache asks the nearest alone, then
        the others together: the same verdicts, each pair scored alone). ``{"categories": {name:
        counts}, "totals": {"all": counts}}``: the lookups per label served their own pair's
        ``a`` and those served another prompt's answer (``other_*``: not labelled, right or
        wrong; what the per-pair figures never see); a ``b`` with the exact key of some pair's
        ``a`` (an exact hit) is not counted; the labelled judge is not asked."""
        entries: dict[str, list[SemanticView]] = defaultdict(list)
        for view in dict.fromkeys(a for a, _ in self.views if a is not None):
            entries[view.scope].append(view)
        vectors = {
            scope: numpy.stack([self._vectors[self._row[v.text]] for v in views])
            for scope, views in entries.items()
        }
        first_keys = {key for key, _ in self.keys if key is not None}
        names = ("should_hit", "served", "other_hit", "should_miss", "wrong", "other_miss")
        categories: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(names, 0))
        total = dict.fromkeys(names, 0)  # (apart: a category may be named "all")
        for pair, (own, new), (_, key) in zip(self.pairs, self.views, self.keys, strict=True):
            label = names[:3] if pair.same_answer else names[3:]
            counted = categories[pair.category]  # (listed, even with no lookup counted)
            if key in first_keys:
                # The same request as some pair's first: an exact hit at the gateway (the
                # answer that one got), not the semantic cache's to serve.
                continue
            served = None
            if new is not None and new.scope in entries:
                served = self._first_passed(
                    new,
                    entries[new.scope],
                    vectors[new.scope],
                    threshold,
                    candidates,
                    verifier_threshold,
                )
            for c in (counted, total):
                c[label[0]] += 1
                if served is not None:
                    c[label[1] if served == own else label[2]] += 1
        return {"categories": dict(sorted(categories.items())), "totals": {TOTALS[-1]: total}}

    def _first_passed(
        self,
        new: SemanticView,
        entries: list[SemanticView],
        vectors: Any,
        threshold: float,
        candidates: int,
        verifier_threshold: float | None,
    ) -> SemanticView | None:
        """The entry of ``entries`` (their ``vectors``) a lookup of ``new`` is served, if any."""
        similarities = vectors @ self._vectors[self._row[new.text]]
        for k in numpy.argsort(-similarities, kind="stable")[:candidates]:
            similarity = float(similarities[k])
            if not similarity >= threshold:
                return None
            cached = entries[int(k)]
            scored = self.guard.scored_now(
                Side(new.text, new.context), [Side(cached.text, cached.context)]
            )
            (verdict,) = self.guard.decide(scored, [similarity], verifier_threshold)
            if verdict.ok:
                return cached
        return None

    def report(
        self,
        threshold: float,
        verifier_threshold: float | None = None,
        judge: LabeledJudge | None = None,
    ) -> dict[str, dict[str, dict[str, Any]]]:
        """``{"categories": {name: rates}, "totals": {"conversations"?: rates, "all": rates}}``
        (``hit_rate``/``wrong_rate`` None when there is no pair to rate)."""
        # Keyed apart: a category named "all" (a file all.jsonl) is not the total.
        categories: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        lookups = judged = 0
        for i, pair in enumerate(self.pairs):
            decision = self.decide(i, threshold, verifier_threshold, judge)
            hit = decision.hit
            # (A candidate in its scope: a lookup; an exact hit makes none.)
            lookups += self.similarity[i] is not None and not self.exact[i]
            judged += decision.judged
            counted = [categories[pair.category], totals["all"]]
            if pair.conversation:
                counted.append(totals["conversations"])
            for c in counted:
                if pair.same_answer:
                    c[0] += 1
                    c[1] += hit
                else:
                    c[2] += 1
                    c[3] += hit
        report = {
            "categories": {name: _rates(c) for name, c in sorted(categories.items())},
            "totals": {
                name: _rates(totals[name]) for name in TOTALS if name in totals or name == "all"
            },
        }
        if judge is not None:
            report["totals"]["all"]["judge_per_lookup"] = judged / lookups if lookups else 0.0
        return report

    def sweep(
        self,
        thresholds: Sequence[float],
        verifier_thresholds: Sequence[float | None] = (None,),
        judge: LabeledJudge | None = None,
    ) -> list[dict[str, Any]]:
        """The overall rates at each similarity threshold and verifier threshold."""
        return [
            {"threshold": t, "verifier_threshold": v, **self.report(t, v, judge)["totals"]["all"]}
            for v in verifier_thresholds
            for t in thresholds
        ]


def _rates(c: list[int]) -> dict[str, Any]:
    return {
        "should_hit": c[0],
        "hit_rate": c[1] / c[0] if c[0] else None,
        "should_miss": c[2],
        "wrong_rate": c[3] / c[2] if c[2] else None,
    }


def percent(rate: float | None) -> str:
    """A rate as the report prints it: ``-`` when there was no pair to rate."""
    return "-" if rate is None else f"{100 * rate:.1f}%"


def format_report(
    report: dict[str, dict[str, dict[str, Any]]],
    threshold: float,
    verifier_threshold: float | None = None,
) -> str:
    """The thresholds used, the categories, a rule, then the totals (a category may bear a
    total's name)."""
    verifier = "" if verifier_threshold is None else f"  verifier {verifier_threshold:.3f}"
    lines = [
        f"threshold {threshold:.3f}{verifier}",
        f"{'category':<22}{'should-hit':>11}{'served':>9}{'should-miss':>13}{'wrong':>8}",
    ]
    for section in ("categories", "totals"):
        if section == "totals":
            lines.append("-" * 63)
        for name, r in report[section].items():
            hit, wrong = percent(r["hit_rate"]), percent(r["wrong_rate"])
            lines.append(f"{name:<22}{r['should_hit']:>11}{hit:>9}{r['should_miss']:>13}{wrong:>8}")
    judge = report["totals"]["all"].get("judge_per_lookup")
    if judge is not None:
        lines.append(f"labeled judge: {judge:.3f} calls per lookup")
    return "\n".join(lines)


def format_one_scope(counts: dict[str, dict[str, dict[str, int]]]) -> str:
    """``Evaluator.one_scope``'s counts as the report prints them: per category, then the total
    (apart, as ``format_report``'s), the share of its should-hit and should-miss lookups served
    their own pair's answer, and another's."""
    lines = [
        "\none scope: every first prompt cached, each second one looked up among them",
        f"{'category':<22}{'should-hit':>11}{'own':>8}{'other':>8}"
        f"{'should-miss':>13}{'own':>8}{'other':>8}",
    ]
    for section in ("categories", "totals"):
        if section == "totals":
            lines.append("-" * 78)
        for name, c in counts[section].items():
            hit, miss = c["should_hit"], c["should_miss"]
            rates = [
                percent(n / of if of else None)
                for n, of in (
                    (c["served"], hit),
                    (c["other_hit"], hit),
                    (c["wrong"], miss),
                    (c["other_miss"], miss),
                )
            ]
            lines.append(
                f"{name:<22}{hit:>11}{rates[0]:>8}{rates[1]:>8}{miss:>13}{rates[2]:>8}{rates[3]:>8}"
            )
    lines.append("(own: its pair's first prompt's answer; other: another prompt's, right or wrong)")
    return "\n".join(lines)


def write_decisions(
    evaluator: Evaluator,
    threshold: float,
    out: TextIO,
    verifier_threshold: float | None = None,
    judge: LabeledJudge | None = None,
) -> None:
    """One row per pair, decided as the report decides it (the same thresholds and judge),
    written to ``out`` (opened by the caller: before the run, so that a file that cannot be
    written fails first)."""
    for i, pair in enumerate(evaluator.pairs):
        d = evaluator.decide(i, threshold, verifier_threshold, judge)
        out.write(
            json.dumps(
                {
                    "a": pair.a,
                    "b": pair.b,
                    "same_answer": pair.same_answer,
                    "category": pair.category,
                    "similarity": round(d.similarity, 4),
                    "decision": "hit" if d.hit else "miss",
                    "reason": d.reason,
                    "score": None if d.score is None else round(d.score, 4),
                    "correct": d.hit == pair.same_answer,
                }
            )
            + "\n"
        )
