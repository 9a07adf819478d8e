"""Charts for people (matplotlib, Agg: no display needed): PNG files, and HTML pages that embed the same charts
as inline SVG. Used by `chipledger report`; the statements (#6) reuse the same functions.

The functions take plain data (lists, not query results) and return a matplotlib Figure, so they can be
tested and reused without a lake. Figures are built with `matplotlib.figure.Figure` directly (no pyplot, no
global state), so concurrent use is safe.
"""

from __future__ import annotations

import html
import io
from datetime import datetime, timedelta
from pathlib import Path
from typing import Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # before anything draws: never a GUI backend, whatever the environment says

from matplotlib.dates import AutoDateLocator, ConciseDateFormatter  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")

# stacking order and colours of the journal's accounts (bottom to top: what runs, then what does not)
ACCOUNT_COLOURS = {
    "in_quota": "#2b8a3e", "burst": "#e67700", "borrowed": "#1971c2", "overcommitted": "#c92a2a",
    "idle": "#ced4da", "unavailable": "#495057",
}


def capacity_chart(hours: Sequence[datetime], chips_by_account: Mapping[str, Sequence[float]],
                   title: str = "Capacity by account") -> Figure:
    """Stacked areas of chips (mean per hour) in each account over time, for one pool."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    _capacity_axes(fig.add_subplot(), hours, chips_by_account, title, legend=True)
    return fig


MAX_POOL_PANELS = 8


def capacity_charts(hours: Sequence[datetime], by_pool: Mapping[str, Mapping[str, Sequence[float]]],
                    title: str = "Capacity by account", max_panels: int = MAX_POOL_PANELS) -> Figure:
    """One panel per pool (chips of different pools are different chips, H100s and TPU cores: never summed on
    one axis), sharing the time axis; the `max_panels` pools with the most capacity, the rest named below."""
    def size(pool):
        return sum(sum(v) for a, v in by_pool[pool].items() if a not in ("overcommitted",))

    pools = sorted(by_pool, key=lambda p: (-size(p), p))
    shown, rest = pools[:max_panels], pools[max_panels:]
    n = max(1, len(shown))
    fig = Figure(figsize=(10, 1.2 + 2.6 * n), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    if not shown:
        _capacity_axes(axes[0], hours, {}, title, legend=True)
        return fig
    for i, (ax, pool) in enumerate(zip(axes, shown)):
        _capacity_axes(ax, hours, by_pool[pool], pool, legend=i == 0)
    fig.suptitle(title)
    if rest:
        fig.supxlabel(f"{len(rest)} more pool(s) not drawn: {', '.join(rest[:6])}{' …' if len(rest) > 6 else ''} "
                      "(chipledger report --pool POOL)", fontsize=8)
    return fig


def _capacity_axes(ax, hours, chips_by_account, title: str, legend: bool) -> None:
    names = [a for a in ACCOUNT_COLOURS if a in chips_by_account] + \
            sorted(a for a in chips_by_account if a not in ACCOUNT_COLOURS)
    if hours and names:
        # each value is the mean over [hour, hour + 1h): draw steps, closed by one more point after the last
        xs = list(hours) + [hours[-1] + timedelta(hours=1)]
        ax.stackplot(xs, *[list(chips_by_account[a]) + [chips_by_account[a][-1]] for a in names], labels=names,
                     colors=[ACCOUNT_COLOURS.get(a, "#868e96") for a in names], step="post")
        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))
        if legend:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        _no_data(ax)
    ax.set_ylabel("chips (hourly mean)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0)


def latency_chart(labels: Sequence[str], p50: Sequence[float], p90: Sequence[float], p99: Sequence[float],
                  threshold_s: Optional[float] = None, title: str = "Scheduling latency") -> Figure:
    """Grouped horizontal bars of the p50/p90/p99 waits (seconds) per group, with the SLO threshold."""
    fig = Figure(figsize=(9, max(2.5, 0.55 * len(labels) + 1.4)), layout="constrained")
    ax = fig.add_subplot()
    if labels:
        height = 0.26
        ys = range(len(labels))
        for i, (name, values, colour) in enumerate((("p50", p50, "#74c0fc"), ("p90", p90, "#1c7ed6"),
                                                    ("p99", p99, "#0b3d91"))):
            ax.barh([y + (i - 1) * height for y in ys], [v or 0 for v in values], height, label=name, color=colour)
        ax.set_yticks(list(ys), list(labels))
        ax.invert_yaxis()
        # waits span seconds to days: a log axis keeps the SLO threshold (600 s) visible beside a 70,000 s p99
        ax.set_xscale("symlog", linthresh=10)
        if threshold_s is not None:
            ax.axvline(threshold_s, color="#c92a2a", linestyle="--", label=f"SLO {threshold_s:g} s")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # beside the bars, never over them
    else:
        _no_data(ax)
    ax.set_xlabel("seconds waited (first start − submit, restart − preemption)")
    ax.set_title(title)
    return fig


def heatmap_chart(matrix: Sequence[Sequence[Optional[float]]], title: str = "Demand by hour of week",
                  unit: str = "chips") -> Figure:
    """A 7 × 24 heat map (rows Monday..Sunday, columns UTC hours); None for hours never observed."""
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    if data.size and not np.all(np.isnan(data)):
        # the colour scale starts at zero demand, so a colour says how busy, not how far above the quietest hour
        im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap="viridis", interpolation="nearest",
                       vmin=0)
        fig.colorbar(im, ax=ax, label=unit)
    else:
        _no_data(ax)
    ax.set_yticks(range(7), DAYS)
    ax.set_xticks(range(0, 24, 3), [f"{h:02d}" for h in range(0, 24, 3)])
    ax.set_xlabel("hour (UTC)")
    ax.set_title(title)
    return fig


def heatmap_charts(matrices: dict, unit: str = "chips") -> Figure:
    """One 7 × 24 heat map per pool, one above the other, each with its own colour scale: demand in chips of
    unlike pools (flavors) is never added up."""
    import numpy as np

    pools = list(matrices) or [None]
    fig = Figure(figsize=(10, 1.2 + 2.6 * len(pools)), layout="constrained")
    axes = fig.subplots(len(pools), 1, squeeze=False)[:, 0]
    for ax, pool in zip(axes, pools):
        matrix = matrices.get(pool) if pool is not None else None
        data = np.array([[np.nan if v is None else v for v in row] for row in matrix or []], dtype=float)
        if data.size and not np.all(np.isnan(data)):
            im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap="viridis", interpolation="nearest", vmin=0)
            fig.colorbar(im, ax=ax, label=unit)
        else:
            _no_data(ax)
        ax.set_yticks(range(7), DAYS)
        ax.set_xticks(range(0, 24, 3), [f"{h:02d}" for h in range(0, 24, 3)])
        ax.set_title(pool or "Demand by hour of week")
    axes[-1].set_xlabel("hour (UTC)")
    return fig


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="#868e96")


def save_png(fig: Figure, path: Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    return path


def svg_text(fig: Figure) -> str:
    """The figure as an inline SVG element (the XML prolog and DOCTYPE left out)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


COLLAPSE_ROWS = 15  # a longer table is folded away (<details>), its row count shown


def html_table(columns: Sequence[str], rows: Sequence[Sequence[str]],
               classes: Optional[Mapping[tuple[int, int], str]] = None, collapse: int = COLLAPSE_ROWS) -> str:
    """A table; `classes` marks cells by (row, column) (`bad`: a missed SLO, a negative budget; `warn`); a table
    of more than `collapse` rows comes folded, the summary line saying how many."""
    classes = classes or {}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)

    def cell(i, j, v):
        cls = classes.get((i, j))
        return f"<td class='{cls}'>" if cls else "<td>"

    body = "".join("<tr>" + "".join(f"{cell(i, j, v)}{html.escape(str(v))}</td>" for j, v in enumerate(r)) + "</tr>"
                   for i, r in enumerate(rows))
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    if len(rows) > collapse:
        bad = sum(1 for c in classes.values() if c == "bad")
        note = f", {bad} missed" if bad else ""
        table = f"<details><summary>{len(rows)} rows{note} (show)</summary>{table}</details>"
    return table


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#212529}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #dee2e6;padding:.25em .6em;text-align:right}
th{background:#f1f3f5}td:first-child,th:first-child{text-align:left}svg{max-width:100%;height:auto}
td.bad{background:#ffe3e3;color:#c92a2a;font-weight:600}td.warn{background:#fff3bf;color:#e67700}
details{margin:.5em 0 1.5em}summary{cursor:pointer;color:#1971c2}"""


def html_page(title: str, blocks: Sequence[tuple[str, str]], subtitle: str = "") -> str:
    """A self-contained HTML page: a heading per block, then its HTML (an inline SVG, a table…)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if subtitle:
        parts.append(f"<p>{html.escape(subtitle)}</p>")
    for heading, content in blocks:
        parts.append(f"<h2>{html.escape(heading)}</h2>{content}")
    parts.append("</body></html>")
    return "\n".join(parts)
