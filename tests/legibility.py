"""How legible a picture's text is, by WCAG 2's contrast ratio: (L1 + 0.05) / (L2 + 0.05), L1 and L2 the relative
luminances of the lighter and the darker colour, from 1 (none) to 21 (black on white); text needs 4.5 (level AA).
From colours an SVG names, or from the pixels of a screenshot."""

from __future__ import annotations

import numpy as np

TEXT_MINIMUM = 4.5


def hex_rgb(color: str) -> tuple[int, int, int]:
    """"#rgb" or "#rrggbb" as (r, g, b) in 0..255."""
    digits = color.lstrip("#")
    if len(digits) == 3:
        digits = "".join(d * 2 for d in digits)
    if len(digits) != 6:
        raise ValueError(f"{color!r} is not a #rgb or #rrggbb colour")
    return tuple(int(digits[i:i + 2], 16) for i in (0, 2, 4))


def luminance(rgb) -> np.ndarray:
    """Relative luminance of sRGB colours (..., 3) in 0..255."""
    c = np.asarray(rgb, np.float64) / 255
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    return linear @ np.array([0.2126, 0.7152, 0.0722])


def contrast(a, b) -> np.ndarray:
    la, lb = luminance(a), luminance(b)
    return (np.maximum(la, lb) + 0.05) / (np.minimum(la, lb) + 0.05)


def most_common(pixels: np.ndarray) -> np.ndarray:
    colors, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    return colors[counts.argmax()]


def text_contrast(region: np.ndarray) -> tuple[float, np.ndarray]:
    """(contrast, background) of the text in a region of a screenshot that holds text and what it is drawn on: the
    background is the region's most common colour (text covers little of it), the text its pixel of most contrast to
    that (a glyph's core; anti-aliased edges lie between the two)."""
    background = most_common(region)
    return float(contrast(region.reshape(-1, 3), background).max()), background
