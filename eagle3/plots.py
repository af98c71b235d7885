"""Small SVG charts for the run's Markdown reports: the Prefect UI shows a Markdown image whose source is a data
URI, so a report carries its pictures with it (no file server, no plotting dependency). A figure paints its own
opaque background and its text in INK on it: an image without one shows through to the page, and Prefect's UI follows
the reader's colour scheme, so black text on a transparent image is all but invisible on its dark theme."""

from __future__ import annotations

import base64
import math
from html import escape

WIDTH, HEIGHT, MARGIN, FONT_PX = 360, 220, 44, 10  # one panel, in px; the margin holds the axes' labels
# The UI fits a picture to its column (~580 px wide in a 1280 px window): three panels side by side would shrink
# their text to ~5 px.
PER_ROW = 2
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
BACKGROUND, INK = "#ffffff", "#222222"  # the figure's own, whatever the page's theme


def markdown_image(svg: str, alt: str) -> str:
    return f"![{escape(alt)}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def figure(panels: list[str]) -> str:
    """Panels in rows of PER_ROW, in one SVG on its own background."""
    columns, rows = min(len(panels), PER_ROW), math.ceil(len(panels) / PER_ROW)
    body = "".join(f'<g transform="translate({i % PER_ROW * WIDTH},{i // PER_ROW * HEIGHT})">{panel}</g>'
                   for i, panel in enumerate(panels))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * columns}" height="{HEIGHT * rows}" '
            f'font-family="sans-serif" font-size="{FONT_PX}" fill="{INK}">'
            f'<rect width="100%" height="100%" fill="{BACKGROUND}"/>{body}</svg>')


def scale(values: list[float]) -> tuple[float, float]:
    """(low, high) of an axis holding `values`, from 0 unless they are all far above it."""
    low, high = min(values + [0.0]), max(values + [0.0])
    if high == low:
        high = low + 1.0
    return low, high + (high - low) * 0.05


def frame(title: str, low: float, high: float) -> str:
    """Title, the y axis with three ticks, and the x axis."""
    bottom, top = HEIGHT - MARGIN, MARGIN / 2
    ticks = "".join(
        f'<text x="{MARGIN - 4}" y="{y_at(v, low, high) + 3:.1f}" text-anchor="end">{v:.3g}</text>'
        f'<line x1="{MARGIN}" x2="{WIDTH - 8}" y1="{y_at(v, low, high):.1f}" y2="{y_at(v, low, high):.1f}" '
        f'stroke="#ddd"/>' for v in (low, (low + high) / 2, high))
    return (f'<text x="{WIDTH / 2}" y="12" text-anchor="middle" font-weight="bold">{escape(title)}</text>{ticks}'
            f'<line x1="{MARGIN}" x2="{MARGIN}" y1="{top}" y2="{bottom}" stroke="#333"/>'
            f'<line x1="{MARGIN}" x2="{WIDTH - 8}" y1="{bottom}" y2="{bottom}" stroke="#333"/>')


def y_at(value: float, low: float, high: float) -> float:
    bottom, top = HEIGHT - MARGIN, MARGIN / 2
    return bottom - (value - low) / (high - low) * (bottom - top)


def legend(names: list[str]) -> str:
    return "".join(f'<rect x="{MARGIN + 4}" y="{MARGIN / 2 + 4 + 12 * i}" width="8" height="8" fill="{COLORS[i % 6]}"/>'
                   f'<text x="{MARGIN + 16}" y="{MARGIN / 2 + 11 + 12 * i}">{escape(name)}</text>'
                   for i, name in enumerate(names))


def bars(title: str, groups: list[str], series: dict[str, list[float | None]]) -> str:
    """One panel of grouped bars: a group per x label, a bar per series (None: no bar)."""
    values = [v for column in series.values() for v in column if v is not None]
    low, high = scale(values or [0.0])
    slot = (WIDTH - MARGIN - 8) / max(len(groups), 1)
    width = slot * 0.8 / max(len(series), 1)
    shapes = []
    for s, column in enumerate(series.values()):
        for g, value in enumerate(column):
            if value is None:
                continue
            x, y = MARGIN + g * slot + slot * 0.1 + s * width, y_at(value, low, high)
            shapes.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{y_at(low, low, high) - y:.1f}" '
                          f'fill="{COLORS[s % 6]}"><title>{escape(groups[g])}: {value:.3g}</title></rect>')
    labels = "".join(f'<text x="{MARGIN + (g + 0.5) * slot:.1f}" y="{HEIGHT - MARGIN + 12}" text-anchor="middle">'
                     f'{escape(name)}</text>' for g, name in enumerate(groups))
    return frame(title, low, high) + "".join(shapes) + labels + legend(list(series))


def lines(title: str, x_label: str, series: dict[str, list[tuple[float, float]]],
          marks: list[tuple[float, str]] = ()) -> str:
    """One panel of lines over a shared x axis (points: (x, y)); each mark (x, label) is a dashed vertical line."""
    points = [p for line in series.values() for p in line]
    low, high = scale([y for _, y in points] or [0.0])
    xs = [x for x, _ in points] + [x for x, _ in marks]
    x_low, x_high = min(xs), max(xs)
    x_at = lambda x: MARGIN + (x - x_low) / ((x_high - x_low) or 1) * (WIDTH - MARGIN - 8)  # noqa: E731
    paths = "".join(f'<polyline fill="none" stroke="{COLORS[i % 6]}" stroke-width="1.5" points="'
                    + " ".join(f"{x_at(x):.1f},{y_at(y, low, high):.1f}" for x, y in line) + '"/>'
                    for i, line in enumerate(series.values()))
    # a single point draws no line: a dot shows it
    paths += "".join(f'<circle cx="{x_at(x):.1f}" cy="{y_at(y, low, high):.1f}" r="2" fill="{COLORS[i % 6]}"/>'
                     for i, line in enumerate(series.values()) for x, y in line if len(line) == 1)
    paths += "".join(f'<line x1="{x_at(x):.1f}" x2="{x_at(x):.1f}" y1="{MARGIN / 2}" y2="{HEIGHT - MARGIN}" '
                     f'stroke="#888" stroke-dasharray="3,3"/><text x="{x_at(x) + 2:.1f}" y="{HEIGHT - MARGIN - 4}" '
                     f'fill="#555">{escape(label)}</text>' for x, label in marks)
    axis = (f'<text x="{MARGIN}" y="{HEIGHT - MARGIN + 12}">{x_low:g}</text>'
            f'<text x="{WIDTH - 8}" y="{HEIGHT - MARGIN + 12}" text-anchor="end">{x_high:g}</text>'
            f'<text x="{WIDTH / 2}" y="{HEIGHT - MARGIN + 24}" text-anchor="middle">{escape(x_label)}</text>')
    return frame(title, low, high) + paths + axis + legend(list(series))
