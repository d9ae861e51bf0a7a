"""Exact rules the verifier is not trusted with: what a cached answer must match word for word.

Contract
--------
A rule is a module-level object with a ``reason`` (:class:`carpool.semantic.guard.Reason`) and
``differs(a, b) -> bool``: True when the two prompts differ in what the rule reads, so that an
answer to one is not an answer to the other. Every rule is pure, symmetric (``differs(a, b) ==
differs(b, a)``), deterministic and fast (microseconds for a short prompt: each text is read once
and memoised; linear in the text, which the guard bounds: ``guard.READ_CHARS``; a rule may run
on a worker thread), and reads English and Chinese. A rule never proves two prompts the same; it only
refuses, ahead of the model, what the model reads badly:

- :mod:`.quoted`: quoted strings, code spans and the input of a task (translate, convert...;
  after a colon, "Put this in Spanish: ..."), code outside backticks to its punctuation, and
  what an error or a log says ("The error says permission denied");
- :mod:`.numbers`: numbers (digits, spelled out, Chinese), units and currencies (each with
  the number it is written on), numbers written together in their order ("1/3", "03/04/2025"),
  a time of day's am / pm or in words ("noon"), relative dates; its lists are in :mod:`.units`;
- :mod:`.operators`: comparison and code operators, in symbols or words;
- :mod:`.identifiers`: codes and identifiers (``S24``, ``snake_case``, URLs, paths, ``ALLCAPS``);
- :mod:`.entities`: names (capitalised words inside a sentence);
- :mod:`.order`: the same words in another order ("the cat chased the mouse" / "the mouse chased
  the cat", "JSON to YAML" / "YAML to JSON"), a direction between phrases reversed ("from Google
  Photos to iCloud", read by :mod:`.directions`) and roles exchanged through a pronoun ("My
  landlord is suing me" / "I am suing my landlord"; a role named by a phrase, "My friend's dog
  bit me" / "I bit my friend's dog", read by :mod:`.phrases`);
- :mod:`.polarity`: a negation, an exclusion or a one-word opposite on one side only ("safe" /
  "unsafe", "bigger" / "smaller", "closed" / "open", "odd" / "even", "overvalued" /
  "undervalued", "exceed" / "fall short of", "still" / "no longer", "is happening" / "is no
  longer happening", "except"),
  the kind the verifier was measured to miss; and :mod:`.unread`, another language's negation
  in an English text ("he said se puede" / "he said no se puede", "içilmez" / "içilir");
- :mod:`.substitution`: one thing named in place of another, the rest word for word ("reset my
  router please" / "reset my modem please", "check my essay" / "check your essay"), which shared
  filler hides from the verifier;
- :mod:`.relations`: another relative reached through a possessive ("my wife's brother" / "my
  brother's wife", "my boss's boss" / "my boss");
- :mod:`.qualifiers`: a small edit of a qualifier, how many, on what condition, must or may,
  when, how much, in what form ("all" / "some", "if" / "unless", "must" / "can", "was" / "is",
  "too hot" / "hot enough", "as a table" / "as a bulleted list"); its lists are in
  :mod:`.qualifier_words`;
- :mod:`.tone`: emoticons (":)" / ":("); it also gives the text the verifier reads
  (:func:`.tone.reading`: without emoticons and chat filler, a run of "!" or "?" as one mark),
  which the packaged one misread ("Explain machine learning!" / "Explain quantum computing!").

:data:`RULES` is their order in the guard: the first that fires names the reason.
"""

from __future__ import annotations

from . import (
    entities,
    identifiers,
    numbers,
    operators,
    order,
    polarity,
    qualifiers,
    quoted,
    relations,
    substitution,
    tone,
    unread,
)

RULES = (
    quoted.RULE,
    numbers.RULE,
    operators.RULE,
    identifiers.RULE,
    entities.RULE,
    order.RULE,
    polarity.RULE,
    unread.RULE,
    substitution.RULE,
    relations.RULE,
    qualifiers.RULE,
    tone.RULE,
)

__all__ = ["RULES"]
