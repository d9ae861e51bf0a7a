"""``carpool eval-semantic``: score the semantic cache's decisions on labeled prompt pairs.

Contract:
- Input: JSONL rows ``{"a", "b", "same_answer", "category"?}``; ``a``/``b`` a string (one user
  turn) or a list of chat messages. ``a`` plays the cached request, ``b`` the new one.
- Each pair is decided exactly as the gateway decides it: both sides become chat requests
  (``temperature: 0``, one model) and go through ``fingerprint.semantic_view`` and
  ``cache.focus``; a different scope (system prompt, earlier turns, a long head) is a miss;
  otherwise the cosine similarity of the last user turns (their tails) must reach the threshold
  and the pair must pass the guard (``Guard.judge_now(new=b, [cached=a])``: the exact rules,
  then the verifier on the turns and, for conversations, on their earlier turns).
- ``half``: ``even`` (the development half: lines 0, 2, 4... of each file) or ``odd`` (the
  held-out half), or every pair (None): rules and settings are tuned on one half and reported on
  the other.
- Output: per category, for conversations (pairs where either side has more than one turn
  besides a system prompt) and overall, the share of should-hit pairs served ("hit rate") and of
  should-miss pairs served ("wrong-hit rate"); ``--decisions`` writes one row per pair;
  ``--sweep`` prints both rates over a range of similarity thresholds and verifier thresholds
  (the guard included), which is how the defaults were calibrated.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..config import Config
from ..fingerprint import SemanticView, fingerprint, semantic_view
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

    @property
    def conversation(self) -> bool:
        return any(
            isinstance(side, list)
            and sum(1 for m in side if isinstance(m, dict) and m.get("role") != "system") > 1
            for side in (self.a, self.b)
        )


@dataclass(slots=True)
class Decision:
    hit: bool
    similarity: float
    reason: str  # "served", "scope", "below_threshold", the guard's reason, or "judge"
    score: float | None = None  # the verifier's, when it was asked
    judged: bool = False  # decided by the (labeled) judge


HALVES = ("even", "odd")


def load_pairs(paths: Iterable[str | Path], half: str | None = None) -> list[Pair]:
    """The pairs of every file, or of one ``half`` of each (``even``/``odd`` rows, counting the
    non-empty lines of each file from 0)."""
    if half is not None and half not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, got {half!r}")
    pairs = []
    for path in paths:
        rows = [line for line in Path(path).read_text().splitlines() if line.strip()]
        for n, line in enumerate(rows):
            if half is not None and n % 2 != HALVES.index(half):
                continue
            pairs.append(_pair(row_of(path, n, line), path))
    return pairs


def row_of(path: str | Path, n: int, line: str) -> dict[str, Any]:
    """Line ``n`` of a pairs file as a row ``{a, b, same_answer}``, or a ``ValueError`` naming
    the file and line: ``same_answer`` a JSON boolean (``"false"`` was read as true)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}, line {n + 1}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {n + 1}: not a JSON object")
    for side in ("a", "b"):
        if not isinstance(row.get(side), str | list):
            raise ValueError(f"{path}, line {n + 1}: {side!r} must be a text or a conversation")
    if not isinstance(row.get("same_answer"), bool):
        raise ValueError(f"{path}, line {n + 1}: 'same_answer' must be true or false")
    return row


def _pair(row: dict[str, Any], path: str | Path) -> Pair:
    return Pair(row["a"], row["b"], row["same_answer"], str(row.get("category") or Path(path).stem))


def _view(side: Any, config: Config) -> SemanticView | None:
    messages = [{"role": "user", "content": side}] if isinstance(side, str) else side
    body = orjson.dumps({"model": "m", "temperature": 0, "messages": messages})
    request = parse(ClientRequest("/v1/chat/completions", body, {}), 1 << 30)
    view = semantic_view(request, fingerprint(request, config), config)
    return focus(view) if view is not None else None


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
        self.views = [(_view(p.a, config), _view(p.b, config)) for p in pairs]
        texts = sorted({v.text for pair in self.views for v in pair if v is not None})
        vectors = embedder.encode(texts) if texts else []
        row = {text: i for i, text in enumerate(texts)}
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
        band: tuple[float, float] | None = None,
        overrules: frozenset[str] = frozenset(),
        verifier_band: tuple[float, float] = (0.0, 1.0),
    ) -> Decision:
        """``band``: a labeled judge (``semantic.judge`` answering from the pair's own label)
        decides the pairs in this similarity band that only the verifier judged (or a rule in
        ``overrules`` refused): what a judge can buy at best, and how often it is asked."""
        similarity = self.similarity[i]
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
            band is not None
            and band[0] <= similarity <= band[1]
            and (
                str(verdict.reason) in overrules
                or (
                    (verdict.ok or verdict.reason in (Reason.MEANING, Reason.CONTEXT))
                    and (
                        verdict.score is None
                        or verifier_band[0] <= verdict.score <= verifier_band[1]
                    )
                )
            )
        ):
            same = self.pairs[i].same_answer
            return Decision(same, similarity, "judge", verdict.score, judged=True)
        return Decision(
            verdict.ok, similarity, "served" if verdict.ok else str(verdict.reason), verdict.score
        )

    def report(
        self,
        threshold: float,
        verifier_threshold: float | None = None,
        band: tuple[float, float] | None = None,
        overrules: frozenset[str] = frozenset(),
        verifier_band: tuple[float, float] = (0.0, 1.0),
    ) -> dict[str, Any]:
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        lookups = judged = 0
        for i, pair in enumerate(self.pairs):
            decision = self.decide(i, threshold, verifier_threshold, band, overrules, verifier_band)
            hit = decision.hit
            lookups += self.similarity[i] is not None  # (a candidate in its scope: a lookup)
            judged += decision.judged
            names = (
                (pair.category, "conversations", "all")
                if pair.conversation
                else (pair.category, "all")
            )
            for name in names:
                c = counts[name]
                if pair.same_answer:
                    c[0] += 1
                    c[1] += hit
                else:
                    c[2] += 1
                    c[3] += hit
        report = {
            name: {
                "should_hit": c[0],
                "hit_rate": c[1] / c[0] if c[0] else None,
                "should_miss": c[2],
                "wrong_rate": c[3] / c[2] if c[2] else None,
            }
            for name, c in sorted(
                counts.items(),
                key=lambda kv: (kv[0] in ("conversations", "all"), kv[0] == "all", kv[0]),
            )
        }
        if band is not None and "all" in report:
            report["all"]["judge_per_lookup"] = judged / lookups if lookups else 0.0
        return report

    def sweep(
        self,
        thresholds: Sequence[float],
        verifier_thresholds: Sequence[float | None] = (None,),
    ) -> list[dict[str, Any]]:
        return [
            {"threshold": t, "verifier_threshold": v, **self.report(t, v)["all"]}
            for v in verifier_thresholds
            for t in thresholds
        ]


def format_report(report: dict[str, Any], threshold: float) -> str:
    lines = [
        f"threshold {threshold:.3f}",
        f"{'category':<22}{'should-hit':>11}{'served':>9}{'should-miss':>13}{'wrong':>8}",
    ]
    for name, r in report.items():
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        wrong = "-" if r["wrong_rate"] is None else f"{100 * r['wrong_rate']:.1f}%"
        lines.append(f"{name:<22}{r['should_hit']:>11}{hit:>9}{r['should_miss']:>13}{wrong:>8}")
    judge = report.get("all", {}).get("judge_per_lookup")
    if judge is not None:
        lines.append(f"labeled judge: {judge:.3f} calls per lookup")
    return "\n".join(lines)


def write_decisions(evaluator: Evaluator, threshold: float, out: Path) -> None:
    with out.open("w") as f:
        for i, pair in enumerate(evaluator.pairs):
            d = evaluator.decide(i, threshold)
            f.write(
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
