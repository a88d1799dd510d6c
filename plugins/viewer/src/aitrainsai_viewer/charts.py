"""Line charts as inline SVG, drawn on the server (nothing loads from the network)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from markupsafe import Markup, escape

COLOURS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#d62728", "#8c564b")


def line_chart(title: str, steps: list[int], series: Mapping[str, Sequence[float | None]], *, width: int = 460,
               height: int = 220, chart_id: str = "") -> Markup:
    """One panel: each series a polyline with dots over the outer steps, a legend, y from the data's range (a value
    that is not finite is left out)."""
    left, right, top, bottom = 48, 12, 26, 30
    series = {name: [v if v is not None and math.isfinite(v) else None for v in vs] for name, vs in series.items()}
    values = [v for vs in series.values() for v in vs if v is not None]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    pad = (high - low) * 0.08
    low, high = low - pad, high + pad
    digits = max(2, 1 - math.floor(math.log10((high - low) / 4)))  # enough that the five ticks differ
    first, last = (min(steps), max(steps)) if steps else (0, 1)
    span = max(last - first, 1)

    def x(step: int) -> float:
        return left + (width - left - right) * ((step - first) / span if len(steps) > 1 else 0.5)

    def y(value: float) -> float:
        return top + (height - top - bottom) * (1 - (value - low) / (high - low))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(chart_id)}" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="{left}" y="16" class="title">{escape(title)}</text>']
    for k in range(5):  # y grid and labels
        value = low + (high - low) * k / 4
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" class="grid"/>'
                     f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end" class="tick">'
                     f'{value:.{digits}f}</text>')
    for step in steps:
        parts.append(f'<text x="{x(step):.1f}" y="{height - 12}" text-anchor="middle" class="tick">{step}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 1}" text-anchor="middle" '
                 f'class="tick">outer step</text>')
    for n, (name, vs) in enumerate(series.items()):
        colour = COLOURS[n % len(COLOURS)]
        points = [(x(s), y(v)) for s, v in zip(steps, vs) if v is not None]
        if len(points) > 1:
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                         + " ".join(f"{px:.1f},{py:.1f}" for px, py in points) + '"/>')
        for (px, py), (s, v) in zip(points, [(s, v) for s, v in zip(steps, vs) if v is not None]):
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}" data-step="{s}" '
                         f'data-value="{v:.6f}"><title>{escape(name)} step {s}: {v:.3f}</title></circle>')
        parts.append(f'<rect x="{width - right - 130}" y="{top + 2 + 14 * n}" width="10" height="3" '
                     f'fill="{colour}"/><text x="{width - right - 116}" y="{top + 7 + 14 * n}" '
                     f'class="tick">{escape(name)}</text>')
    if not steps:
        parts.append(f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" class="tick">'
                     'no outer step yet</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
