"""Recorded workloads for ``carpool bench``: one JSON object per line (docs/bench.md).

Contract:
- ``load_jsonl(path, tenant_header, keep)`` reads the recorded format; a malformed file raises
  ``WorkloadError`` naming the file, the line and what is wrong. Lines end at ``\n`` only (a
  ``\r`` before it is dropped): a U+2028, U+2029 or U+0085 inside a JSON string, which JSON
  allows unescaped, is part of its line (``carpool.jsonl``). ``keep`` (None: all) keeps the
  first ``keep`` requests in the file's order (blank lines are not requests), before any sorting
  by ``t``;
  the whole file is checked all the same. Its endpoints are the OpenAI classics,
  ``/v1/responses`` and ``/v1/messages`` (``workloads.ENDPOINTS``); ``endpoint`` defaults to
  chat. A ``tenant`` without the tenant header among its ``headers`` gets one
  (``tenant_header_value``).
- Headers go out as one header line each (``client.build`` writes them as given): a header name
  is an HTTP token, a value (and a ``tenant``) holds no control character but the tab, and
  ``Host``, ``Content-Length`` and ``Transfer-Encoding``, which the client sets or must not
  send, are refused; anything else is a malformed line.
- Either every line has a timestamp ``t`` or none does: a finite number of seconds from any
  origin (negative included); with them the requests kept are shifted to start at 0 and sorted
  (ties keep the file's order); without them ``timed`` is False and the run needs a rate or a
  concurrency.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from .. import exact_json, http_syntax
from ..jsonl import numbered_lines
from .workloads import CHAT, ENDPOINTS, BenchRequest, Workload, WorkloadError, tenant_header_value


def load_jsonl(
    path: str | Path, tenant_header: str = "Authorization", keep: int | None = None
) -> Workload:
    """Read a recorded workload: one JSON object per line (docs/bench.md); ``keep``: only the
    first ``keep`` requests of the file, in its order."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"{path}: cannot read it: {error}") from None
    requests: list[BenchRequest] = []
    timed: list[tuple[int, bool]] = []  # (line number, has a 't')
    for number, line in numbered_lines(text):  # (not str.splitlines(): ``carpool.jsonl``)
        where = f"{path}:{number}"
        try:
            # (An integer past 64 bits kept as its digits, as the gateway keeps it: rounded
            # to a double, another request was replayed than the one recorded.)
            row = exact_json.loads(line)
        except orjson.JSONDecodeError as error:
            raise WorkloadError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{where}: each line must be a JSON object")
        requests.append(_row(row, where, tenant_header))
        timed.append((number, "t" in row and row["t"] is not None))
    if not requests:
        raise WorkloadError(f"{path}: no requests in the file")
    has_t = [has for _, has in timed]
    if any(has_t) and not all(has_t):
        missing = next(number for number, has in timed if not has)
        raise WorkloadError(
            f"{path}:{missing}: this line has no timestamp 't' although others "
            "do; give every line a 't' or none"
        )
    if keep is not None:
        requests = requests[:keep]
    if all(has_t):
        start = min(r.t for r in requests)
        for r in requests:
            r.t = round(r.t - start, 6)
        requests.sort(key=lambda r: r.t)  # stable: ties keep the file's order
    return Workload(
        path.stem,
        requests,
        str(path),
        {"file": str(path), "tenant_header": tenant_header},
        timed=all(has_t),
    )


def _shown(value: Any) -> str:
    """``value`` as a refusal names it: a big integer by its digits (not its reader's type)."""
    return orjson.dumps(value).decode() if exact_json.is_big(value) else repr(value)


def _row(row: dict[str, Any], where: str, tenant_header: str) -> BenchRequest:
    t = row.get("t")
    if exact_json.is_big(t):  # (past 64 bits: a finite number all the same)
        t = float(orjson.dumps(t))
    if t is not None and (
        not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)
    ):
        # Any origin, a negative one included (a clock started after the first line): the
        # earliest kept becomes 0 (``load_jsonl``).
        raise WorkloadError(f"{where}: 't' must be a finite number of seconds, got {_shown(t)}")
    body = row.get("body")
    if not isinstance(body, dict):
        raise WorkloadError(
            f"{where}: 'body' must be a JSON object (the request body), got {type(body).__name__}"
        )
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError as error:
        # (orjson reads 1024 levels and writes 254: a body between was read, then its first
        # send raised, a traceback and no report.)
        raise WorkloadError(f"{where}: 'body' cannot be sent as JSON ({error})") from None
    endpoint = row.get("endpoint", CHAT)
    if endpoint not in ENDPOINTS:
        raise WorkloadError(
            f"{where}: 'endpoint' must be one of {', '.join(ENDPOINTS)}, got {_shown(endpoint)}"
        )
    headers = row.get("headers") or {}
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise WorkloadError(f"{where}: 'headers' must be an object of strings")
    for name, value in headers.items():
        _check_header(name, value, where)
    tenant = row.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise WorkloadError(f"{where}: 'tenant' must be a string, got {_shown(tenant)}")
    if tenant is not None and http_syntax.CONTROL.search(tenant):
        raise WorkloadError(
            f"{where}: 'tenant' must be a string that fits in a header (no control characters "
            f"such as CR or LF), got {tenant!r}"
        )
    headers = dict(headers)
    if tenant and tenant_header.lower() not in {k.lower() for k in headers}:
        headers[tenant_header] = tenant_header_value(tenant_header, tenant)
    return BenchRequest(float(t or 0.0), endpoint, body, headers, tenant)


SET_BY_BENCH = frozenset({"host", "content-length", "transfer-encoding"})


def _check_header(name: str, value: str, where: str) -> None:
    """One header that goes out as one header line and leaves the request's framing alone
    (``client.build`` writes headers as given)."""
    if not http_syntax.TOKEN.fullmatch(name):
        raise WorkloadError(
            f"{where}: header {name!r}: not a valid header name (letters, digits and "
            "!#$%&'*+-.^_`|~ only)"
        )
    if name.lower() in SET_BY_BENCH:
        raise WorkloadError(
            f"{where}: header {name!r}: carpool bench sets the host and framing headers itself "
            "(Host, Content-Length; no Transfer-Encoding)"
        )
    if http_syntax.CONTROL.search(value):
        raise WorkloadError(
            f"{where}: header {name!r}: its value holds a control character (CR, LF, NUL, ...), "
            f"so it would not go out as one header: {value!r}"
        )
