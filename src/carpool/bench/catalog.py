"""The text of the synthetic workloads: a catalog of support questions, their paraphrases, and
each tenant's long system prompts.

Contract:
- ``question(index)`` is catalog entry ``index``: ``(the canonical question, its core phrase)``;
  every index names a distinct question (after the first ``len(ACTIONS) * len(OBJECTS) *
  len(CONTEXTS)`` entries, the same phrases again with ``(case N)``), and no two questions share
  an answer: the catalog has no synonyms, so a correct semantic hit can never look wrong.
- ``PARAPHRASES`` reword a core phrase (``.format(q=core)``): a new fingerprint, the same meaning.
  ``core_of(text)`` reads the core phrase back from a canonical question or a paraphrase (None
  for any other text): what an upstream that answers by meaning keys its answers on.
- ``system_prompt(rng, tenant, variant, words)``: about ``words`` words of policy text that name
  the tenant's company; ``completion_prompt(system, text)`` puts one before a question for
  ``/v1/completions``. Pure functions: the same arguments (and rng state) give the same text.
"""

from __future__ import annotations

import random
import re

# No two synonyms ("change"/"update", "recover"/"restore"): two catalog questions must never
# have the same answer, or a correct semantic hit would look like a wrong one in the report.
ACTIONS = (
    "reset",
    "change",
    "cancel",
    "export",
    "delete",
    "recover",
    "share",
    "renew",
    "upgrade",
    "downgrade",
    "transfer",
    "verify",
    "unlock",
    "pause",
    "merge",
    "rename",
    "back up",
    "archive",
)
OBJECTS = (
    "my password",
    "my subscription",
    "the billing address",
    "two-factor authentication",
    "my order",
    "the shipping address",
    "my invoices",
    "my account",
    "the team workspace",
    "my payment method",
    "the API key",
    "my email address",
    "the mobile number",
    "a shared folder",
    "my profile photo",
    "the data export",
    "a support ticket",
    "my gift card",
    "the delivery slot",
    "my loyalty points",
    "the device list",
    "my notification settings",
    "the return label",
    "a saved cart",
    "my tax documents",
    "the admin role",
    "my security questions",
    "the warranty",
    "my username",
    "the trial plan",
)
CONTEXTS = (
    "",
    " on the mobile app",
    " from the web dashboard",
    " for a team account",
    " after a failed payment",
    " without logging in",
    " in bulk",
    " on a new phone",
)
PARAPHRASES = (
    "What is the best way to {q}?",
    "Can you tell me how to {q}?",
    "how to {q}",
    "I need to {q}. How?",
    "Steps to {q}, please.",
)
COMPANIES = (
    "Northwind",
    "Acme",
    "Globex",
    "Initech",
    "Umbrella",
    "Hooli",
    "Vandelay",
    "Stark",
    "Wayne",
    "Tyrell",
    "Soylent",
    "Cyberdyne",
    "Wonka",
    "Gringotts",
    "Oscorp",
    "Monarch",
)
POLICY_WORDS = (
    "customer",
    "account",
    "order",
    "refund",
    "policy",
    "secure",
    "verify",
    "help",
    "clearly",
    "briefly",
    "always",
    "never",
    "escalate",
    "agent",
    "privacy",
    "data",
    "billing",
    "delivery",
    "return",
    "warranty",
    "polite",
    "accurate",
    "steps",
    "link",
    "support",
    "hours",
    "region",
    "language",
    "summary",
    "confirm",
)


def question(index: int) -> tuple[str, str]:
    """Catalog entry ``index``: (the canonical question, its core phrase for paraphrases)."""
    per_round = len(ACTIONS) * len(OBJECTS) * len(CONTEXTS)
    rounds, rest = divmod(index, per_round)
    action = ACTIONS[rest % len(ACTIONS)]
    rest //= len(ACTIONS)
    obj = OBJECTS[rest % len(OBJECTS)]
    context = CONTEXTS[rest // len(OBJECTS)]
    core = f"{action} {obj}{context}" + (f" (case {rounds + 1})" if rounds else "")
    return f"How do I {core}?", core


WORDINGS = ("How do I {q}?", *PARAPHRASES)  # the canonical question's shape first
_WORDING_PATTERNS = tuple(
    re.compile(re.escape(wording).replace(re.escape("{q}"), "(.+)")) for wording in WORDINGS
)


def core_of(text: str) -> str | None:
    """The core phrase of a catalog question in any of its wordings; None for other text."""
    for pattern in _WORDING_PATTERNS:
        found = pattern.fullmatch(text)
        if found:
            return found.group(1)
    return None


def system_prompt(rng: random.Random, tenant: int, variant: int, words: int) -> str:
    company = COMPANIES[tenant % len(COMPANIES)]
    head = (
        f"You are the support assistant of {company} (tenant {tenant + 1}, policy "
        f"{variant + 1}). Follow these rules exactly."
    )
    body = [rng.choice(POLICY_WORDS) for _ in range(max(0, words - len(head.split())))]
    sentences = [" ".join(body[i : i + 12]).capitalize() + "." for i in range(0, len(body), 12)]
    return " ".join([head, *sentences])


def completion_prompt(system: str, text: str) -> str:
    return f"{system}\n\nQuestion: {text}\nAnswer:"
