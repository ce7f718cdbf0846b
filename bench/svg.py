"""Plots as inline SVG text: what `specrt report` draws, so the page needs no library and no network to open.

Two kinds, enough for latency profiles, tuner curves and bench comparisons: `line_chart` (series of
points, optional log2 x axis, horizontal reference lines such as a roofline) and `bar_chart` (grouped
bars over categories, optional reference line). Every point and bar carries a <title>, which browsers
show on hover. The root <svg> has class "plot", each series is a <g class="series">, each bar a rect of class "bar": the
report's browser test checks that every plot drew something through them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
WIDTH, HEIGHT = 720, 340
LEFT, RIGHT, TOP, BOTTOM = 64, 200, 34, 48  # margins; the legend sits in the right one


@dataclass(frozen=True)
class Series:
    name: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    dashed: bool = False
    marker: bool = True
    color: str | None = None  # default: the palette, by the series' place


@dataclass(frozen=True)
class Rule:
    """A horizontal reference line across the plot (a roofline, an autoregressive baseline)."""

    y: float
    label: str
    color: str = "#555555"


@dataclass
class _Frame:
    x0: float
    x1: float
    y0: float
    y1: float
    log_x: bool = False
    parts: list[str] = field(default_factory=list)

    def px(self, x: float) -> float:
        if self.log_x:
            x, lo, hi = math.log2(x), math.log2(self.x0), math.log2(self.x1)
        else:
            lo, hi = self.x0, self.x1
        return LEFT + (x - lo) / ((hi - lo) or 1.0) * (WIDTH - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return HEIGHT - BOTTOM - (y - self.y0) / ((self.y1 - self.y0) or 1.0) * (HEIGHT - TOP - BOTTOM)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((hi - first) / step)) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:.0f}"
    if abs(v) < 0.01:
        return f"{v:.3g}"
    return f"{v:.4g}"


def _open(title: str, xlabel: str, ylabel: str, kind: str) -> list[str]:
    return [f'<svg class="plot" data-kind="{kind}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}" '
            'font-family="sans-serif" font-size="11">',
            f"<title>{escape(title)}</title>",
            f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
            f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
            f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 10}" text-anchor="middle">{escape(xlabel)}</text>',
            f'<text transform="translate(14 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
            f"{escape(ylabel)}</text>"]


def _y_axis(f: _Frame, ticks: list[float]) -> list[str]:
    out = []
    for t in ticks:
        y = f.py(t)
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>')
    return out


def _legend(entries: list[tuple[str, str, bool]]) -> list[str]:
    out = []
    for i, (name, color, dashed) in enumerate(entries):
        y = TOP + 8 + 16 * i
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{y}" y2="{y}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{WIDTH - RIGHT + 37}" y="{y + 4}">{escape(name[:28])}</text>')
    return out


def _rules(f: _Frame, rules: list[Rule]) -> tuple[list[str], list[tuple[str, str, bool]]]:
    out, legend = [], []
    for r in rules:
        y = f.py(r.y)
        out.append(f'<line class="rule" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="{r.color}" '
                   f'stroke-width="1.5" stroke-dasharray="2 3"><title>{escape(r.label)}: {_fmt(r.y)}</title></line>')
        legend.append((r.label, r.color, True))
    return out, legend


def line_chart(title: str, xlabel: str, ylabel: str, series: list[Series], rules: list[Rule] = (),
               log_x: bool = False, y_from_zero: bool = True) -> str:
    """An SVG line chart; raises ValueError when there is nothing to draw (no series with a point)."""
    drawn = [s for s in series if s.xs]
    if not drawn:
        raise ValueError(f"plot {title!r}: no series with points")
    xs = [x for s in drawn for x in s.xs]
    ys = [y for s in drawn for y in s.ys] + [r.y for r in rules]
    if log_x and min(xs) <= 0:
        raise ValueError(f"plot {title!r}: a log x axis needs positive x")
    y_lo = 0.0 if y_from_zero else min(ys)
    y_ticks = nice_ticks(y_lo, max(ys) * 1.05 if max(ys) > 0 else 1.0)
    f = _Frame(min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1, y_ticks[0], y_ticks[-1], log_x)
    parts = _open(title, xlabel, ylabel, "line") + _y_axis(f, y_ticks)
    if log_x:
        x_ticks = [2 ** k for k in range(math.floor(math.log2(f.x0)), math.ceil(math.log2(f.x1)) + 1)]
    else:
        x_ticks = nice_ticks(f.x0, f.x1, 6)
    for t in x_ticks:
        if f.x0 - 1e-9 <= t <= f.x1 + 1e-9:
            parts.append(f'<text x="{f.px(t):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_fmt(t)}</text>')
    rule_parts, legend = _rules(f, list(rules))
    parts += rule_parts
    for i, s in enumerate(drawn):
        color = s.color or COLORS[i % len(COLORS)]
        pts = sorted(zip(s.xs, s.ys))
        d = " ".join(f"{'M' if j == 0 else 'L'}{f.px(x):.1f},{f.py(y):.1f}" for j, (x, y) in enumerate(pts))
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        parts.append(f'<g class="series"><path d="{d}" fill="none" stroke="{color}" stroke-width="2"{dash}>'
                     f"<title>{escape(s.name)}</title></path>")
        if s.marker or len(pts) == 1:  # a series of one point is its marker
            for x, y in pts:
                parts.append(f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="3" fill="{color}">'
                             f"<title>{escape(s.name)}: x={_fmt(x)}, y={_fmt(y)}</title></circle>")
        parts.append("</g>")
        legend.append((s.name, color, s.dashed))
    parts += _legend(legend)
    return "\n".join(parts + ["</svg>"])


def bar_chart(title: str, ylabel: str, categories: list[str], groups: dict[str, list[float | None]],
              rules: list[Rule] = ()) -> str:
    """Grouped bars: one group per category, one bar per entry of `groups` (None: no bar)."""
    values = [v for vs in groups.values() for v in vs if v is not None]
    if not categories or not values:
        raise ValueError(f"plot {title!r}: no bars")
    y_ticks = nice_ticks(0.0, max(values + [r.y for r in rules]) * 1.08)
    f = _Frame(0, len(categories), y_ticks[0], y_ticks[-1])
    parts = _open(title, "", ylabel, "bar") + _y_axis(f, y_ticks)
    slot = (WIDTH - LEFT - RIGHT) / len(categories)
    bar = slot * 0.8 / max(1, len(groups))
    for c, name in enumerate(categories):
        label = name if len(name) <= 18 else name[:17] + "…"
        parts.append(f'<text x="{LEFT + slot * (c + 0.5):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
                     f"{escape(label)}</text>")
    legend = []
    for g, (gname, vs) in enumerate(groups.items()):
        color = COLORS[g % len(COLORS)]
        legend.append((gname, color, False))
        for c, v in enumerate(vs):
            if v is None:
                continue
            x = LEFT + slot * c + slot * 0.1 + bar * g
            top = f.py(v)
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{top:.1f}" width="{bar:.1f}" '
                         f'height="{max(HEIGHT - BOTTOM - top, 0.5):.1f}" fill="{color}">'
                         f"<title>{escape(categories[c])}, {escape(gname)}: {_fmt(v)}</title></rect>")
    rule_parts, rule_legend = _rules(f, list(rules))
    parts += rule_parts
    parts += _legend(legend + rule_legend)
    return "\n".join(parts + ["</svg>"])
