"""RFC 9110's header syntax, written once for every place that checks a header before it
goes on the wire (the upstream client, the library's headers, config, `carpool bench`).

Contract:
- ``TOKEN`` full-matches a header name (RFC 9110 5.1: ``tchar``, no space, tab, colon or
  separator).
- ``CONTROL`` finds what no header value may hold (RFC 9110 5.5: a control character but the
  tab), so no value can end its line and start another.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
