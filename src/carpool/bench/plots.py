"""The plots of a ``carpool bench`` report (PNG, matplotlib's Agg backend, no display needed).

Contract:
- ``draw(run, needs_call, out_dir)`` writes three PNGs and returns their file names; outcomes
  are filed as the report files them (``report.outcome_of``: a failed request is ``error``, a
  semantic hit known wrong is ``wrong_semantic_hit``):
  * ``outcomes_over_time.png``: requests per second by outcome (stacked), by send time
    (``outcome_rates``: each bin's count over its own duration; the last bin runs to the last
    send, so a steady rate reads steady to the end);
  * ``latency_cdf.png``: the latency CDF per outcome (log x), and beside it the time to first
    byte of the streaming requests per outcome, of the requests answered without error; each
    legend's p50 is ``stats.percentile``'s, as in ``report.json``;
  * ``upstream_vs_oracle.png``: cumulative upstream calls over the run, from the gateway's
    ``/stats`` (polled), against the oracle's calls and the requests sent.
- ``audit(graded, out_dir)`` (the ``audit`` workload, ``meanings.grade``) writes ``audit.png``:
  the semantic hits served and the wrong ones among them, cumulative over the requests in send
  order, with a line where the namespace's state changed.
- matplotlib is the optional ``bench`` extra: ``available()`` says whether it can be imported, and
  ``MISSING`` is the sentence the report prints when it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..extras import install_hint
from . import stats
from .replay import Result, Run

# The files ``draw`` and ``audit`` write.
DRAWN = ("outcomes_over_time.png", "latency_cdf.png", "upstream_vs_oracle.png")
AUDIT = "audit.png"

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

OutcomeOf = Callable[[Result], str]

MISSING = (
    f"Plots need matplotlib, which is not installed: {install_hint('bench')}, then "
    "run the benchmark again."
)
COLORS = {
    "hit": "#2ca02c",
    "semantic_hit": "#17becf",
    "wrong_semantic_hit": "#9467bd",
    "coalesced": "#1f77b4",
    "miss": "#ff7f0e",
    "bypass": "#7f7f7f",
    "error": "#d62728",
}
ORDER = ("hit", "semantic_hit", "wrong_semantic_hit", "coalesced", "miss", "bypass", "error")


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(run: Run, needs_call: Sequence[bool], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from .report import outcome_of

    out.mkdir(parents=True, exist_ok=True)
    names = []
    figures = (
        _outcomes(plt, run, outcome_of),
        _latency(plt, run, outcome_of),
        _calls(plt, run, needs_call),
    )
    for name, figure in zip(DRAWN, figures, strict=True):
        figure.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
        names.append(name)
    return names


def outcome_rates(
    results: Sequence[Result], outcome_of: OutcomeOf
) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """``outcomes_over_time.png``'s series: the bins' starts and durations (seconds since the
    start, by send time) and, per outcome (``ORDER``), its requests per second in each bin."""
    span = max((r.sent for r in results), default=0.0)
    width = max(1.0, span / 60)  # at most ~60 bars
    # Whole bins, the last one stretched to the last send (less than two widths): a partial
    # bin divided by a full width drew a steady rate as a collapse at the end of every run,
    # and a sliver of one divided by its own would be noise.
    bins = max(1, int(span / width))
    counts = {name: [0] * bins for name in ORDER}
    for r in results:
        counts[outcome_of(r)][min(int(r.sent / width), bins - 1)] += 1
    starts = [i * width for i in range(bins)]
    last = span - starts[-1]
    # (All sent at one instant: no duration to divide by; a bin's nominal width stands in.)
    durations = [width] * (bins - 1) + [last if last > 0 else width]
    rates = {name: [c / d for c, d in zip(counts[name], durations, strict=True)] for name in ORDER}
    return starts, durations, rates


def _outcomes(plt: Any, run: Run, outcome_of: OutcomeOf) -> Figure:
    starts, durations, rates = outcome_rates(run.results, outcome_of)
    totals = {name: 0 for name in ORDER}
    for r in run.results:
        totals[outcome_of(r)] += 1
    figure, ax = plt.subplots(figsize=(9, 4.2))
    bottom = [0.0] * len(starts)
    for name in ORDER:
        series = rates[name]
        if not any(series):
            continue
        ax.bar(
            starts,
            series,
            width=[d * 0.95 for d in durations],
            bottom=bottom,
            align="edge",
            color=COLORS[name],
            label=f"{name} ({totals[name]:,})",
        )
        bottom = [b + s for b, s in zip(bottom, series, strict=True)]
    ax.set_xlabel("seconds since start (send time)")
    ax.set_ylabel("requests / s")
    ax.set_title("Outcome mix over time (x-carpool header)")
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    ax.set_xlim(0, starts[-1] + durations[-1])
    ax.grid(axis="y", alpha=0.3)
    return cast("Figure", figure)


def _cdf(ax: Axes, values_ms: list[float], name: str, style: str = "-") -> None:
    data = sorted(max(v, 1e-3) for v in values_ms)  # (> 0 for the log scale)
    n = len(data)
    ys = [(i + 1) / n for i in range(n)]
    median = stats.percentile(values_ms, 50)  # the report's p50
    ax.step(
        data,
        ys,
        style,
        where="post",
        color=COLORS[name],
        label=f"{name} (n={n:,}, p50 {median:,.1f} ms)",
    )


def _latency(plt: Any, run: Run, outcome_of: OutcomeOf) -> Figure:
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, attr, results, title in (
        (left, "latency", run.results, "Latency to the last byte, per outcome"),
        (
            right,
            "ttfb",
            [r for r in run.results if r.stream],
            "Streams: time to first byte, per outcome",
        ),
    ):
        drawn = False
        for name in ORDER:
            values = [
                getattr(r, attr) * 1000
                for r in results
                if outcome_of(r) == name and r.ok and getattr(r, attr) is not None
            ]
            if values:
                _cdf(ax, values, name)
                drawn = True
        ax.set_xscale("log")
        ax.set_xlabel("milliseconds (log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(which="both", alpha=0.3)
        if drawn:
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no streaming requests", ha="center", transform=ax.transAxes)
    left.set_ylabel("share of requests at or below")
    left.set_ylim(0, 1.01)
    return cast("Figure", figure)


def _calls(plt: Any, run: Run, needs_call: Sequence[bool]) -> Figure:
    figure, ax = plt.subplots(figsize=(9, 4.5))
    base = run.stats_before.get("upstream_calls", 0)
    xs = [t for t, _ in run.stats_series]
    ys = [s.get("upstream_calls", base) - base for _, s in run.stats_series]
    order = sorted(range(len(run.results)), key=lambda i: run.results[i].sent)
    sent = [run.results[i].sent for i in order]
    oracle, total = [], 0
    for i in order:
        total += bool(needs_call[i])
        oracle.append(total)
    ax.plot(
        sent,
        range(1, len(sent) + 1),
        color="#bbbbbb",
        lw=1.5,
        label=f"requests sent ({len(sent):,})",
    )
    ax.step(
        xs,
        ys,
        where="post",
        color=COLORS["miss"],
        lw=2,
        label=f"upstream calls, gateway /stats ({ys[-1] if ys else 0:,})",
    )
    ax.step(
        sent,
        oracle,
        "--",
        where="post",
        color="black",
        lw=1.5,
        label=f"oracle: fewest possible ({total:,})",
    )
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("cumulative count")
    ax.set_title("Upstream calls vs the oracle")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return cast("Figure", figure)


def audit(graded: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    ax.plot(graded["series"]["served"], color=COLORS["semantic_hit"], label="semantic hits served")
    ax.plot(graded["series"]["wrong"], color=COLORS["error"], label="wrong ones among them")
    state_lines(ax, graded["state_changes"])
    ax.set_xlabel("requests (send order)")
    ax.set_ylabel("cumulative")
    ax.legend()
    figure.savefig(out / AUDIT, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return AUDIT


def state_lines(ax: Axes, changes: Sequence[dict[str, Any]]) -> None:
    """A vertical line where a namespace's audit state changed (``meanings.grade``)."""
    styles = {"backed-off": ":", "mark": "--", "serving": "-."}
    for change in changes:
        style = styles.get(change["state"], ":")
        ax.axvline(change["at_request"], linestyle=style, color="grey", label=change["state"])
