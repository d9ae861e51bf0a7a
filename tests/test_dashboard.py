"""The live /dashboard, rendered by a real browser in front of a real gateway (CONTRACT.md, /stats).

Debian's ``chromium`` is driven by Playwright's async API (no browser is ever downloaded); the
gateway runs over loopback in front of the counting fake upstream. The page polls the relative URL
``stats`` and exposes what it drew as ``window.carpoolDashboard``; the tests compare that, the
headline tiles and the canvases' pixels with the live ``/stats`` numbers.

Without chromium the browser test is skipped, unless ``REQUIRE_CHROMIUM`` is set (CI sets
it), in which case it fails.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from fakes.required import missing, required
from fakes.waiting import eventually

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRE_BROWSER = required("REQUIRE_CHROMIUM")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
]
POLL_MS = 150  # ?interval= : the page polls faster than its default 1 s
WAIT_MS = 5000  # bound of every wait_for_function

# The page's outcome keys (x-carpool values) and the /stats counters they chart.
STAT = {
    "hit": "hits",
    "semantic-hit": "semantic_hits",
    "coalesced": "coalesced",
    "miss": "misses",
    "bypass": "bypass",
}
COLOR = {
    "hit": (0x3F, 0xB9, 0x50),
    "coalesced": (0xA3, 0x71, 0xF7),
    "miss": (0xF0, 0x88, 0x3E),
    "bypass": (0x8B, 0x94, 0x9E),
}

# One consistent view of the page (JS runs to completion: no poll lands in the middle): the
# dashboard's record of what it drew, the headline tiles, each chart's data attributes and, when
# asked (``colors``), its opaque pixels: all, "saturated" ones (series colours; axes, grid and
# labels are grey) and those near each given colour.
SNAPSHOT_JS = """(colors) => {
  const tiles = {}, charts = {};
  for (const t of document.querySelectorAll('.tile')) {
    const v = t.querySelector('.value');
    tiles[t.id] = {text: v.textContent, value: v.dataset.value, entries: t.dataset.entries,
                   bytes: t.dataset.bytes};
  }
  for (const c of document.querySelectorAll('canvas[data-chart]')) {
    const chart = charts[c.dataset.chart] = {points: Number(c.dataset.points)};
    if (!colors) continue;
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, near = {};
    const targets = Object.entries(colors);
    let opaque = 0, saturated = 0;
    for (const [k] of targets) near[k] = 0;
    for (let i = 0; i < d.length; i += 4) {
      if (d[i + 3] < 128) continue;
      opaque++;
      if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) saturated++;
      for (const [k, [r, g, b]] of targets) {
        if (Math.abs(d[i] - r) + Math.abs(d[i + 1] - g) + Math.abs(d[i + 2] - b) < 60) near[k]++;
      }
    }
    Object.assign(chart, {opaque, saturated, near});
  }
  return {board: window.carpoolDashboard, tiles, charts};
}"""


# What the page's Content-Security-Policy refused, as the browser reports it (the console says
# so too, as an error): an init script records it from the first byte of the page on.
VIOLATIONS_JS = """window.violations = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.violations.push(e.violatedDirective + ' ' + e.blockedURI));"""


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if CHROMIUM is None:
        missing("chromium is not on PATH (apt-get install chromium)", "REQUIRE_CHROMIUM")
    if not REQUIRE_BROWSER:
        pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:  # a fresh temporary profile each time
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


async def traffic(gw, fake, tag: str) -> Counter[str]:
    """Misses, hits, coalesced answers (one streamed) and a bypass; the outcomes, from headers."""
    outcomes: Counter[str] = Counter()
    for _ in range(3):  # a miss, then two hits
        outcomes[(await gw.chat(f"{tag}: repeated")).headers["x-carpool"]] += 1
    fake.gate = asyncio.Event()  # four at once: one call, three join

    async def together(i: int) -> str:
        if i == 3:
            response, _ = await gw.stream_chat(f"{tag}: together")
            return response.headers["x-carpool"]
        return (await gw.chat(f"{tag}: together")).headers["x-carpool"]

    calls = fake.count()
    clients = [asyncio.create_task(together(i)) for i in range(4)]
    await fake.wait_for_calls(calls + 1)
    await eventually(lambda: gw.gateway.flights.waiters == 4, what="4 clients on the flight")
    fake.gate.set()
    outcomes.update(await asyncio.gather(*clients))
    fake.gate = None
    outcomes[(await gw.chat(f"{tag}: sampled", temperature=0.9)).headers["x-carpool"]] += 1
    assert outcomes == {"miss": 2, "hit": 2, "coalesced": 3, "bypass": 1}
    return outcomes


async def stats(gw) -> dict[str, Any]:
    response = await gw.client.get("/stats")
    assert response.status_code == 200
    return response.json()


def check_tiles(tiles: dict[str, dict], live: dict[str, Any], polled: dict[str, Any]) -> None:
    """The headline numbers are /stats' numbers, as data and as text: the counters those of the
    test's own /stats (no request since), the gauges those of the page's last poll."""
    for tile, key, source in [
        ("tile-requests", "requests", live),
        ("tile-upstream", "upstream_calls", live),
        ("tile-tokens", "tokens_saved", live),
        ("tile-flights", "flights", polled),
    ]:  # lingering flights expire
        assert int(tiles[tile]["value"]) == source[key], tile
        assert int(tiles[tile]["text"].replace(",", "")) == source[key], tile
    assert float(tiles["tile-saved"]["value"]) == live["saved_fraction"]
    assert tiles["tile-saved"]["text"] == f"{100 * live['saved_fraction']:.1f}%"
    for layer, info in live["layers"].items():
        shown = tiles[f"tile-layer-{layer}"]
        assert int(shown["entries"]) == info["entries"] and int(shown["bytes"]) == info["bytes"]
    assert tiles["tile-redis"]["text"] == live["redis"]["state"]


def check_latency(drawn: dict[str, Any], doc: dict[str, Any]) -> None:
    """The latency bars are the document's percentiles, or the page says they are missing."""
    latency = doc.get("latency_ms")
    if latency is None:  # a gateway without the field: handled, not drawn
        assert drawn == {"available": False, "points": 0, "lastValue": None, "outcomes": {}}
        return
    shown = {k: v for k, v in latency.items() if v.get("count")}
    assert drawn["available"] and drawn["points"] == len(shown)
    assert {k.replace("_", "-"): v for k, v in shown.items()} == drawn["outcomes"]


async def test_dashboard_draws_the_live_stats_and_follows_new_traffic(gw, fake, browser):
    before = await traffic(gw, fake, "before")  # the page opens on a busy gateway
    problems: list[str] = []
    requested: list[str] = []
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.on(
        "console",
        lambda m: m.type in ("error", "warning") and problems.append(f"console {m.type}: {m.text}"),
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("request", lambda r: requested.append(r.url))
    await page.add_init_script(VIOLATIONS_JS)  # (run by the browser, outside the page's policy)
    response = await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
    assert response is not None and response.status == 200
    assert "content-security-policy" in response.headers  # (the page works under it)
    assert "carpool" in await page.title() and await page.inner_text(".logo") == "carpool"

    await page.wait_for_function(
        "() => (window.carpoolDashboard || {}).ticks >= 2", timeout=WAIT_MS
    )
    first = await stats(gw)
    assert first["requests"] == sum(before.values())
    view = await page.evaluate(SNAPSHOT_JS, None)
    board = view["board"]
    assert board["errors"] == 0
    assert {STAT[o]: n for o, n in before.items()}.items() <= board["last"].items()
    check_tiles(view["tiles"], first, board["last"])
    saved = board["drawn"]["saved"]
    assert saved["points"] == board["ticks"] and saved["lastValue"] == first["saved_fraction"]
    replicas = board["drawn"]["replicas"]
    assert replicas["names"] == list(first["replicas"]) and replicas["points"] == board["ticks"]
    for name, info in first["replicas"].items():
        assert replicas["series"][name]["calls"] == info["calls"] == fake.count()
        assert replicas["series"][name]["lastValue"] == info["in_flight"] == 0
    check_latency(board["drawn"]["latency"], board["last"])

    after = await traffic(gw, fake, "after")  # then the page follows new traffic
    second = await stats(gw)
    assert second["requests"] == first["requests"] + sum(after.values())
    await page.wait_for_function(
        "n => { const d = window.carpoolDashboard; return d.last.requests === n "
        "&& d.drawn.outcomes.series.miss.total > 0 }",
        arg=second["requests"],
        timeout=WAIT_MS,
    )
    view = await page.evaluate(SNAPSHOT_JS, {k: list(rgb) for k, rgb in COLOR.items()})
    board = view["board"]
    assert board["errors"] == 0
    check_tiles(view["tiles"], second, board["last"])
    outcomes = board["drawn"]["outcomes"]
    assert outcomes["points"] == board["ticks"] - 1 >= 2
    for outcome, stat in STAT.items():
        series = outcomes["series"][outcome]
        assert series["base"] == first[stat]  # the page's first poll
        assert series["total"] == second[stat] - first[stat] == after[outcome]  # its deltas
        assert (series["max"] > 0) == (after[outcome] > 0)  # drawn as a rate
    assert board["drawn"]["saved"]["lastValue"] == second["saved_fraction"]
    check_latency(board["drawn"]["latency"], board["last"])

    # What was drawn reached the pixels: every chart has coloured series, each outcome its own.
    charts = view["charts"]
    for chart in ("outcomes", "saved", "replicas") + (
        ("latency",) if board["drawn"]["latency"]["available"] else ()
    ):
        assert charts[chart]["points"] == board["drawn"][chart]["points"] > 0, chart
        assert charts[chart]["saturated"] > 20, (chart, charts[chart])
    for outcome in COLOR:
        assert charts["outcomes"]["near"][outcome] >= 3, (outcome, charts["outcomes"])

    assert problems == []  # no console error or warning, no failed request
    assert await page.evaluate("() => window.violations") == []  # none of the page's policy
    assert requested and all(url.startswith(gw.url + "/") for url in requested), requested
    assert {url.split("?")[0] for url in requested} == {f"{gw.url}/dashboard", f"{gw.url}/stats"}
    await page.close()


async def polling(
    browser, gw, docs: list[dict[str, Any] | None] | Callable[[], dict[str, Any]]
) -> tuple[Any, list[str]]:
    """A page of the dashboard whose polls of ``stats`` get ``docs`` in turn (the last one
    again and again; None: a 503), or what ``docs()`` returns at each poll, and the errors it
    throws."""
    polls = 0

    async def stats_route(route) -> None:
        nonlocal polls
        doc = docs() if callable(docs) else docs[min(polls, len(docs) - 1)]
        polls += 1
        if doc is None:
            await route.fulfill(status=503, body="unavailable")
        else:
            await route.fulfill(status=200, content_type="application/json", body=json.dumps(doc))

    page = await browser.new_page()
    thrown: list[str] = []
    page.on("pageerror", lambda e: thrown.append(str(e)))
    await page.route("**/stats", stats_route)
    await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
    return page, thrown


async def test_dashboard_copes_with_a_sparse_stats_document_and_an_outage(gw, browser):
    """An older gateway (no latency_ms, no replicas, no layers) and a failed poll: the page says
    so, draws what it has, keeps polling, and throws nothing."""
    docs = [
        {"requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.333333},
        None,
        {"requests": 5, "hits": 2, "misses": 3, "saved_fraction": 0.4},
    ]
    page, thrown = await polling(browser, gw, docs)
    await page.wait_for_function(
        "() => { const d = window.carpoolDashboard; return d.errors >= 1 && d.ticks >= 2 }",
        timeout=WAIT_MS,
    )
    view = await page.evaluate(SNAPSHOT_JS, None)
    board = view["board"]
    assert thrown == [] and "503" in board["lastError"]
    assert board["last"]["requests"] == 5 and view["tiles"]["tile-requests"]["text"] == "5"
    assert view["tiles"]["tile-saved"]["text"] == "40.0%"
    assert board["drawn"]["latency"] == {
        "available": False,
        "points": 0,
        "lastValue": None,
        "outcomes": {},
    }
    assert board["drawn"]["replicas"]["names"] == []
    assert board["drawn"]["outcomes"]["series"]["miss"]["total"] == 1
    # Live again after the outage, once a poll answers: waited for, not read at one instant (on
    # two loaded cores a poll answered later than its 500 ms and the page said "stale" then).
    await page.wait_for_function(
        "() => document.querySelector('#status').innerText.includes('live')", timeout=WAIT_MS
    )
    await page.close()


async def test_dashboard_shows_each_namespaces_wrong_hit_estimate_and_budget_state(gw, browser):
    """/stats ``semantic_audit``: one tile per namespace, the estimate, its interval, the state."""
    audit = {
        "": {
            "audited": 40,
            "wrong": 1,
            "estimate": 0.025,
            "low": 0.004,
            "high": 0.129,
            "state": "serving",
        },
        "faq/en": {
            "audited": 9,
            "wrong": 4,
            "estimate": 0.444,
            "low": 0.189,
            "high": 0.733,
            "state": "backed-off",
        },
        # A client's namespace named like the default one's tile: a tile of its own.
        "default": {
            "audited": 100,
            "wrong": 1,
            "estimate": 0.01,
            "low": 0.002,
            "high": 0.054,
            "state": "serving",
        },
    }
    doc = {"requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.33, "semantic_audit": audit}
    page, _ = await polling(browser, gw, [doc])
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    tiles = (await page.evaluate(SNAPSHOT_JS, None))["tiles"]
    assert tiles["tile-audit-default"]["text"] == "2.5%"
    assert tiles["tile-audit-ns-faq%2Fen"]["text"] == "44.4%"
    assert tiles["tile-audit-ns-default"]["text"] == "1.0%"
    note = await page.inner_text("#tile-audit-ns-faq\\%2Fen .note")
    assert note == "18.9%–73.3% · 9 audited · backed-off"
    label = await page.inner_text("#tile-audit-default .label")
    assert label.lower() == "wrong hits · default namespace"
    await page.close()


async def test_dashboard_is_one_self_contained_html_page(gw):
    response = await gw.client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "<title>carpool" in html and "carpool" in html
    assert not re.search(r"https?://", html, re.IGNORECASE)  # no CDN, no web font
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*//""", html)  # nor protocol-relative
    assert not re.search(r"@import|<script[^>]+src=|<link[^>]+stylesheet", html)
    assert re.search(r"""fetch\(\s*['"]stats['"]""", html)  # relative: any host/prefix


async def test_the_dashboard_is_served_with_a_content_security_policy_and_no_caching(gw, browser):
    """The page draws what clients named (namespaces, models): were anything of theirs ever to
    reach it as markup, its policy runs no script but its own, loads nothing, sends nowhere but
    back to the gateway, and no other site may frame it. A browser keeps no copy of it (it is
    behind the admin token) and sends no Referer from it."""
    response = await gw.client.get("/dashboard")
    assert response.status_code == 200
    headers = response.headers
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    assert headers["referrer-policy"] == "no-referrer"
    policy = {
        directive.split()[0]: directive.split()[1:]
        for directive in headers["content-security-policy"].split(";")
        if directive.strip()
    }
    assert policy["default-src"] == ["'none'"]
    assert policy["connect-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"]
    (script,) = re.findall(r"^<script>(.*?)</script>", response.text, re.DOTALL | re.MULTILINE)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert policy["script-src"] == [f"'sha256-{digest}'"]  # its own script, no other
    assert "'unsafe-inline'" not in policy.get("style-src", []) + policy.get("img-src", [])

    # A browser holds the page to it: a script put into it (what an injection would be) does
    # not run, and says so; the page's own goes on polling.
    page = await browser.new_page()
    await page.add_init_script(VIOLATIONS_JS)
    await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    assert await page.evaluate("() => window.violations") == []
    await page.evaluate(
        """() => { const s = document.createElement('script');
          s.textContent = 'window.injected = true'; document.body.append(s); }"""
    )
    await page.wait_for_function("() => window.violations.length > 0", timeout=WAIT_MS)
    assert await page.evaluate("() => window.injected") is None
    assert all(v.startswith("script-src") for v in await page.evaluate("() => window.violations"))
    await page.close()


async def test_with_an_admin_token_the_dashboard_asks_for_it_and_then_polls_stats(
    fake, gateway_with, browser
):
    token = "dash-token"
    async with gateway_with(admin_token=token) as gw:
        await gw.chat("counted")
        refused = await gw.client.get("/dashboard")
        assert refused.status_code == 401 and "basic" in refused.headers["www-authenticate"].lower()
        # What a browser does once its user typed the token into the login prompt.
        context = await browser.new_context(
            http_credentials={"username": "admin", "password": token}
        )
        page = await context.new_page()
        response = await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
        assert response is not None and response.status == 200
        await page.wait_for_function(
            "() => (window.carpoolDashboard || {}).ticks >= 2", timeout=WAIT_MS
        )
        board = await page.evaluate("() => window.carpoolDashboard")
        assert board["errors"] == 0 and board["last"]["requests"] == 1
        await context.close()


async def test_under_workers_the_dashboard_draws_the_runs_totals(gw, browser):
    """``carpool serve --workers N``: one worker answers every poll (the page keeps its
    connection); its document's ``run`` holds the run's figures, which the page draws and shows
    instead of that worker's own."""
    docs = [
        {
            "pid": 7,
            "requests": 1,
            "misses": 1,
            "hits": 0,
            "saved_fraction": 0.0,
            "run": {"requests": 4, "misses": 2, "hits": 2, "saved_fraction": 0.5, "workers": 2},
        },
        {
            "pid": 7,
            "requests": 1,
            "misses": 1,
            "hits": 0,
            "saved_fraction": 0.0,
            "run": {"requests": 10, "misses": 3, "hits": 7, "saved_fraction": 0.7, "workers": 2},
        },
        # A worker missed this poll (its figures left out), then answers again: no rate from
        # either, and no restart (the charts were cleared, then drew its lifetime as one step).
        {
            "pid": 7,
            "run": {"requests": 6, "misses": 2, "hits": 4, "saved_fraction": 0.67, "workers": 1},
        },
        {
            "pid": 7,
            "run": {"requests": 15, "misses": 3, "hits": 12, "saved_fraction": 0.8, "workers": 2},
        },
    ]
    page, thrown = await polling(browser, gw, docs)
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 5", timeout=WAIT_MS)
    view = await page.evaluate(SNAPSHOT_JS, None)
    assert thrown == []
    assert view["tiles"]["tile-requests"]["text"] == "15"
    assert view["tiles"]["tile-saved"]["text"] == "80.0%"
    series = view["board"]["drawn"]["outcomes"]["series"]
    assert series["hit"]["total"] == 5 and series["miss"]["total"] == 1  # (the run's deltas)
    await page.close()


async def test_a_tile_for_what_stats_no_longer_reports_leaves_the_page(gw, browser):
    """A layer's tile and a namespace's wrong-hit tile were made once and never taken away: a
    namespace whose audits were reset stayed on the page, red, until it was reloaded."""
    audit = {"audited": 20, "wrong": 20, "estimate": 1.0, "low": 0.8, "high": 1.0}
    before = {
        "requests": 3,
        "layers": {"exact": {"entries": 2, "bytes": 10}, "semantic": {"entries": 1, "bytes": 5}},
        "semantic_audit": {
            "": {**audit, "state": "serving"},
            "faq": {**audit, "state": "backed-off"},
        },
    }
    after = {"requests": 4, "layers": {"exact": {"entries": 3, "bytes": 15}}}
    after["semantic_audit"] = {"": before["semantic_audit"][""]}
    current = before
    page, _ = await polling(browser, gw, lambda: current)
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    shown = set((await page.evaluate(SNAPSHOT_JS, None))["tiles"])
    assert {"tile-layer-semantic", "tile-audit-ns-faq"} <= shown
    current = after
    await page.wait_for_function(
        "() => window.carpoolDashboard.last.requests === 4", timeout=WAIT_MS
    )
    tiles = (await page.evaluate(SNAPSHOT_JS, None))["tiles"]
    assert "tile-layer-semantic" not in tiles and "tile-audit-ns-faq" not in tiles
    assert tiles["tile-layer-exact"]["entries"] == "3" and "tile-audit-default" in tiles
    assert list(tiles)[-1] == "tile-redis"  # (the ones made for /stats' keys go before it)
    await page.close()


async def test_a_namespace_reset_by_the_admin_api_leaves_the_page(fake, gateway_with, browser):
    """The real gateway: wrong audits back a namespace off, then mark it (a red tile); POST
    /admin/semantic/audit/reset takes it out of /stats, and so off the page."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    from carpool.semantic.audit import MIN_AUDITS, SHARED, Budget

    token = "dash-token"
    semantic = {"enabled": True, "audit_rate": 1.0, "max_wrong_rate": 0.05}
    async with gateway_with(admin_token=token, semantic=semantic) as gw:
        for _ in range(2 * MIN_AUDITS):  # (a window's worth to back off, another to mark)
            gw.gateway.layers.audits.record(Budget(SHARED, "faq"), True, near=True)
        context = await browser.new_context(
            http_credentials={"username": "admin", "password": token}
        )
        page = await context.new_page()
        await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
        await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
        state = await page.get_attribute("#tile-audit-ns-faq", "data-state")
        assert state in ("backed-off", "mark")  # (a red tile)
        reset = await gw.client.post(
            "/admin/semantic/audit/reset",
            headers={"Authorization": f"Bearer {token}"},
            json={"namespace": "faq"},
        )
        assert reset.json() == {"reset": 1}
        await page.wait_for_function(
            "() => !('faq' in window.carpoolDashboard.last.semantic_audit)", timeout=WAIT_MS
        )
        assert await page.query_selector("#tile-audit-ns-faq") is None
        await context.close()


# What the page asks setTimeout for between two polls (each delay given for its ``poll``).
RECORD_POLL_DELAYS = """
window.pollDelays = [];
const setTimeoutOfThePage = window.setTimeout;
window.setTimeout = function (f, delay, ...rest) {
  if (f && f.name === 'poll') window.pollDelays.push(delay);
  return setTimeoutOfThePage.call(window, f, delay, ...rest);
};
"""


@pytest.mark.parametrize(
    "given, used",
    [
        ("1500", 1500),
        ("50", 100),  # the floor
        ("3000000000", 3_600_000),  # setTimeout takes past 2^31-1 ms as 0: polls without a pause
        ("2147483648", 3_600_000),
        ("Infinity", 1000),  # not a number of milliseconds: the default
        ("1e400", 1000),
        ("NaN", 1000),
        ("-5", 1000),
        ("soon", 1000),
    ],
)
async def test_the_poll_interval_is_a_finite_number_of_ms_between_100_ms_and_an_hour(
    gw, browser, given, used
):
    page = await browser.new_page()
    await page.add_init_script(RECORD_POLL_DELAYS)
    await page.goto(f"{gw.url}/dashboard?interval={given}")
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    board = await page.evaluate(
        "() => ({interval: window.carpoolDashboard.interval, delays: window.pollDelays, "
        "cadence: document.getElementById('cadence').textContent})"
    )
    assert board["interval"] == used
    assert board["delays"] and set(board["delays"]) == {used}
    every = (
        f"{used // 1000} s"
        if used % 1000 == 0
        else f"{used / 1000:g} s"
        if used > 1000
        else f"{used} ms"
    )
    assert board["cadence"].startswith(f"polled every {every} ·"), board["cadence"]
    await page.close()


async def test_the_charts_start_again_when_another_process_answers(gw, browser):
    """A restarted gateway (another ``pid``) that counted past the old one by the next poll:
    no counter went back, and the page drew the new process's lifetime as one interval."""
    docs = [
        {"pid": 100, "requests": 2, "hits": 0, "misses": 2, "saved_fraction": 0.0},
        {"pid": 100, "requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.33},
        None,  # restarting
        {"pid": 200, "requests": 60, "hits": 50, "misses": 10, "saved_fraction": 0.83},
        {"pid": 200, "requests": 64, "hits": 53, "misses": 11, "saved_fraction": 0.83},
    ]
    page, thrown = await polling(browser, gw, docs)
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 6", timeout=WAIT_MS)
    board = await page.evaluate("() => window.carpoolDashboard")
    assert thrown == []
    series = board["drawn"]["outcomes"]["series"]
    assert series["hit"]["base"] == 50 and series["miss"]["base"] == 10  # the new process's
    assert series["hit"]["total"] == 3 and series["miss"]["total"] == 1  # its deltas alone
    await page.close()


async def test_under_workers_the_charts_start_again_when_a_worker_was_replaced(gw, browser):
    """``run.pids``: the workers whose figures make the run's. Another of them answering the
    poll is the same run; a worker replaced (its counters from 0) is not, whatever the sums."""

    def doc(pid: int, pids: list[int], hits: int, misses: int) -> dict[str, Any]:
        run = {"requests": hits + misses, "hits": hits, "misses": misses, "workers": len(pids)}
        return {"pid": pid, "run": {**run, "pids": pids}}

    docs = [
        doc(7, [7, 8], 1, 1),
        doc(8, [7, 8], 3, 2),  # another worker answered: the same run, its deltas drawn
        doc(8, [8, 9], 30, 20),  # 7 replaced by 9
        doc(9, [8, 9], 34, 20),
    ]
    page, thrown = await polling(browser, gw, docs)
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 5", timeout=WAIT_MS)
    board = await page.evaluate("() => window.carpoolDashboard")
    assert thrown == []
    series = board["drawn"]["outcomes"]["series"]
    assert series["hit"]["base"] == 30 and series["hit"]["total"] == 4
    assert series["miss"]["total"] == 0
    await page.close()


REPLICAS_JS = """() => {
  const d = window.carpoolDashboard.drawn.replicas;
  return {names: d.names,
          series: d.names.map((n) => Object.hasOwn(d.series, n) ? d.series[n] : null),
          legend: document.getElementById('legend-replicas').innerText};
}"""


async def test_replicas_named_like_object_properties_are_drawn_with_their_numbers(
    fake, gateway_with, browser
):
    """Replica names are the operator's (``upstream_names``): the page kept each replica's
    figures in plain objects, so ``__proto__`` set an object's prototype instead of an entry
    and ``toString`` found the prototype's function (``name in ...``): no numbers, or a page
    error at the first poll."""
    names = ["__proto__", "toString"]
    async with gateway_with(upstreams=[fake.url, fake.url], upstream_names=names) as gw:
        for i in range(6):
            assert (await gw.chat(f"question {i}")).status_code == 200
        page = await browser.new_page()
        thrown: list[str] = []
        page.on("pageerror", lambda e: thrown.append(str(e)))
        await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
        await page.wait_for_function("() => window.carpoolDashboard.ticks >= 3", timeout=WAIT_MS)
        drawn = await page.evaluate(REPLICAS_JS)
        replicas = (await stats(gw))["replicas"]
        assert thrown == [] and drawn["names"] == names
        for name, series in zip(names, drawn["series"], strict=True):
            assert series is not None, name
            assert series["calls"] == replicas[name]["calls"] and series["lastValue"] == 0
            assert series["callRate"] == 0  # (no calls between the polls: a rate, not "none")
            # (the legend item: its name, then "0 in flight · <rate> calls/s · <n> calls")
            assert (
                f"{name}0 in flight · 0.00 calls/s · {replicas[name]['calls']} calls"
                in (drawn["legend"])
            )
        assert sum(series["calls"] for series in drawn["series"]) == 6
        await page.close()


STATUS_JS = """() => ({cls: document.getElementById('status').className,
  text: document.getElementById('status').innerText, ticks: window.carpoolDashboard.ticks,
  errors: window.carpoolDashboard.errors, lastError: window.carpoolDashboard.lastError})"""


async def test_a_stats_that_never_answers_turns_the_page_stale_then_disconnected(gw, browser):
    """A gateway that stops answering (a stopped process, a blocked loop, a stuck host): the page
    awaited its poll with no deadline and said "● live" for good. It says stale once the last
    answer is a few intervals old, then gives the poll up (an error) and polls again."""
    answer = asyncio.Event()
    held = 0
    refresh_figures = gw.gateway.refresh_figures

    async def never(*args: Any, **kwargs: Any) -> None:  # /stats awaits it before answering
        nonlocal held
        held += 1
        await answer.wait()

    page = await browser.new_page()
    try:
        await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
        await page.wait_for_function("() => window.carpoolDashboard.ticks >= 2", timeout=WAIT_MS)
        assert (await page.evaluate(STATUS_JS))["cls"] == "ok"
        gw.gateway.refresh_figures = never
        await page.wait_for_function(
            "() => document.getElementById('status').innerText.includes('stale')",
            timeout=WAIT_MS,
        )
        stale = await page.evaluate(STATUS_JS)
        assert stale["cls"] == "down" and stale["errors"] == 0 and held >= 1
        # The poll given up (its deadline: 5 s at this interval) goes through the error path,
        # and the page asks again.
        await page.wait_for_function(
            "() => window.carpoolDashboard.errors >= 1", timeout=4 * WAIT_MS
        )
        down = await page.evaluate(STATUS_JS)
        assert down["cls"] == "down" and "disconnected" in down["text"], down
        assert "no answer" in down["lastError"], down
        await eventually(lambda: held >= 2, what="the page polling again")
        gw.gateway.refresh_figures = refresh_figures  # answering again: live again
        answer.set()
        ticks = down["ticks"]
        await page.wait_for_function(
            "n => window.carpoolDashboard.ticks > n && "
            "document.getElementById('status').className === 'ok'",
            arg=ticks,
            timeout=4 * WAIT_MS,
        )
        assert "live" in (await page.evaluate(STATUS_JS))["text"]
    finally:
        answer.set()
        await page.close()


def audited_namespaces(n: int) -> dict[str, dict[str, Any]]:
    """``n`` namespaces serving, audited 1 to n times, and two backed off audited once."""
    audit = {"wrong": 0, "estimate": 0.0, "low": 0.0, "high": 0.3, "state": "serving"}
    namespaces = {f"ns-{i}": {**audit, "audited": 1 + i} for i in range(n)}
    for name in ("troubled-a", "troubled-b"):
        namespaces[name] = {**audit, "audited": 1, "wrong": 1, "state": "backed-off"}
    return namespaces


async def test_thousands_of_namespaces_draw_a_bounded_number_of_tiles_and_the_charts_stay_on_top(
    gw, browser
):
    """Namespaces are the clients' to name: the page drew a tile for each one /stats listed,
    and with thousands the charts were tens of thousands of pixels down. It draws those not
    serving, then the most audited, up to a bound, and one tile counts the rest (with those
    /stats itself left out: ``semantic_audit_more``)."""
    namespaces = audited_namespaces(3000)
    doc = {"requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.33}
    doc |= {"semantic_audit": namespaces, "semantic_audit_more": 500}
    page, thrown = await polling(browser, gw, [doc])
    await page.set_viewport_size({"width": 1280, "height": 900})
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 2", timeout=WAIT_MS)
    shown = await page.evaluate(
        """() => ({ids: [...document.querySelectorAll('.tile[id^="tile-audit-ns-"]')].map(t => t.id),
          more: document.getElementById('tile-audit-more').querySelector('.value').textContent,
          note: document.getElementById('tile-audit-more').querySelector('.note').textContent,
          chart: document.getElementById('chart-outcomes').getBoundingClientRect().top,
          screen: innerHeight})"""
    )
    assert thrown == []
    drawn = [name.removeprefix("tile-audit-ns-") for name in shown["ids"]]
    assert 2 < len(drawn) <= 12
    assert drawn[:2] == ["troubled-a", "troubled-b"]  # not serving first
    assert drawn[2:] == [f"ns-{i}" for i in range(2999, 2999 - len(drawn) + 2, -1)]
    assert shown["more"] == f"+{len(namespaces) - len(drawn) + 500:,}"
    assert "GET /admin/semantic/audit" in shown["note"]
    assert shown["chart"] < shown["screen"], shown  # the charts on the first screen
    await page.close()


async def test_a_long_namespace_is_clipped_on_its_tile_with_its_full_name_in_the_title(gw, browser):
    """Namespaces are the clients' to name, up to 256 characters: the tile's label did not clip,
    and one such name made the page twice as wide as the window."""
    name = "n" * 120 + "-" + "x" * 135  # 256 characters, as long as a namespace may be
    audit = {"audited": 3, "wrong": 0, "estimate": 0.0, "low": 0.0, "high": 0.5}
    doc = {"requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.33}
    doc["semantic_audit"] = {name: {**audit, "state": "serving"}}
    page, thrown = await polling(browser, gw, [doc])
    await page.set_viewport_size({"width": 1280, "height": 900})
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    shown = await page.evaluate(
        """(id) => { const label = document.getElementById(id).querySelector('.label');
          return {page: document.documentElement.scrollWidth, window: innerWidth,
                  title: label.title, clipped: label.scrollWidth > label.clientWidth}; }""",
        f"tile-audit-ns-{name}",
    )
    assert thrown == []
    assert shown["page"] <= shown["window"], shown  # no sideways scrolling
    assert shown["clipped"] and shown["title"].endswith(" " + name), shown
    await page.close()


async def test_namespaces_differing_only_in_case_read_differently_on_their_tiles(gw, browser):
    """Namespaces are case-sensitive (``faq`` and ``FAQ`` share nothing), but the label was set
    in capitals: their two tiles read the same. The fixed words are, the namespace as written."""
    audit = {"audited": 3, "wrong": 0, "estimate": 0.0, "low": 0.0, "high": 0.5}
    doc = {"requests": 3, "hits": 1, "misses": 2, "saved_fraction": 0.33}
    doc["semantic_audit"] = {
        "faq": {**audit, "state": "serving"},
        "FAQ": {**audit, "estimate": 0.5, "state": "backed-off"},
    }
    page, thrown = await polling(browser, gw, [doc])
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    lower = await page.inner_text("#tile-audit-ns-faq .label")  # as rendered, capitals and all
    upper = await page.inner_text("#tile-audit-ns-FAQ .label")
    assert thrown == []
    assert lower != upper, (lower, upper)
    assert lower.endswith(" faq") and upper.endswith(" FAQ"), (lower, upper)
    assert lower.startswith("WRONG HITS") and upper.startswith("WRONG HITS")  # the fixed words
    await page.close()


async def test_no_fixed_tile_label_or_note_is_cut_short_in_a_1280_pixel_window(gw, browser):
    # ("Saved fraction", "Upstream calls" and "Semantic cache" read "SAVED FRACTI…" once labels
    # were clipped; the rate tile's note was twice its tile's width.) Every fixed tile shown:
    # with both cache layers, nine in a row.
    layers = {"exact": {"entries": 2, "bytes": 10}, "semantic": {"entries": 1, "bytes": 5}}
    page, thrown = await polling(browser, gw, [{"requests": 3, "layers": layers}])
    assert page.viewport_size["width"] == 1280
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 1", timeout=WAIT_MS)
    shown = await page.evaluate(
        """() => [...document.querySelectorAll('.tile .label, #tile-rate .note')]
             .map(e => [e.textContent, e.scrollWidth > e.clientWidth])"""
    )
    assert len(shown) == 10 and "semantic cache" in {text.lower() for text, _ in shown}, shown
    assert [text for text, clipped in shown if clipped] == [] and thrown == []
    await page.close()


async def test_requests_per_second_counts_the_requests_the_gateway_refused(gw, browser):
    """The "Requests" tile counts refused (and abandoned) requests; "Requests / s" beside it
    counted only the five outcomes: a flood of refused requests read 0.00/s."""
    page = await browser.new_page()
    await page.goto(f"{gw.url}/dashboard?interval={POLL_MS}")
    await page.wait_for_function("() => window.carpoolDashboard.ticks >= 2", timeout=WAIT_MS)
    # Every value the rate tile takes (one per poll's render), not the one of an instant that
    # may fall in the next interval.
    await page.evaluate(
        """() => { const v = document.querySelector('#tile-rate .value'); window.rates = [];
          new MutationObserver(() => window.rates.push(Number(v.dataset.value)))
            .observe(v, {attributes: true, childList: true, characterData: true}); }"""
    )
    refused = 5
    for _ in range(refused):
        response = await gw.client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400
    await page.wait_for_function(
        "n => window.carpoolDashboard.last.rejected === n", arg=refused, timeout=WAIT_MS
    )
    rates = await page.evaluate("() => window.rates")
    assert any(rate > 0 for rate in rates), rates  # the poll that saw them
    note = await page.inner_text("#tile-rate .note")
    said = await page.get_attribute("#tile-rate .note", "title")
    assert "rejected" in note and said is not None and "abandoned" in said, (note, said)
    await page.close()
