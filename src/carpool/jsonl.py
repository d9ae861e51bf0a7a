"""JSON Lines files as carpool reads them: ``carpool bench --workload-file`` and
``carpool eval-semantic --pairs``.

Contract: ``numbered_lines(text)`` yields each non-blank line of a file's text with its number
in the file (from 1, blank lines counted), for messages to name the line a reader finds it at. A
line ends at a line feed only, a carriage return before it dropped: U+2028, U+2029 and U+0085
inside a JSON string, which JSON allows unescaped (orjson and ``json.dumps(ensure_ascii=False)``
write them so), are part of their line, where ``str.splitlines()`` would end it.
"""

from __future__ import annotations

from collections.abc import Iterator


def numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number in the file, line) for each line of ``text`` that is not blank."""
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line
