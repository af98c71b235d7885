"""The plots' own colours and layout: a figure paints an opaque background and its text reads on it (WCAG contrast)
whatever the page around it is (the Prefect UI follows the reader's dark or light scheme; test_deployment_e2e.py
looks at the plots there, in a browser), and its panels go two to a row, so that the UI's column does not shrink them
past reading."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator

from legibility import TEXT_MINIMUM, contrast, hex_rgb

from eagle3.plots import HEIGHT, WIDTH, bars, figure, lines

SVG = "{http://www.w3.org/2000/svg}"


def one_of_each_panel() -> ET.Element:
    """A figure with a panel of bars, one of lines with a mark, and one with a single bar: every piece plots.py
    draws."""
    return ET.fromstring(figure([
        bars("output tokens/s", ["no draft", "s3/k1/n4"],
             {"1 concurrent": [60.0, 150.0], "4 concurrent": [180.0, None]}),
        lines("accept length", "step", {"train": [(1, 1.2), (20, 2.4)], "eval": [(10, 2.0)]},
              marks=[(12, "promoted v2")]),
        bars("accept length per suite", ["mtbench"], {"served": [2.5]})]))


def drawn_text(element: ET.Element, fill: str = "#000") -> Iterator[tuple[str, str]]:
    """(text, the colour it is painted in) of every text element: its own fill, else the nearest ancestor's, else SVG's
    initial black."""
    fill = element.get("fill", fill)
    if element.tag == f"{SVG}text":
        yield "".join(element.itertext()), fill
    for child in element:
        yield from drawn_text(child, fill)


def test_a_figure_paints_an_opaque_background_of_its_own_under_everything():
    root = one_of_each_panel()
    background = root[0]
    assert background.tag == f"{SVG}rect", f"the figure starts with {background.tag}, not a background rect"
    assert (background.get("x", "0"), background.get("y", "0"), background.get("width"), background.get("height")) \
        == ("0", "0", "100%", "100%")
    hex_rgb(background.get("fill"))  # a colour, not none or a gradient
    assert not {"opacity", "fill-opacity"} & set(background.keys()), background.attrib


def test_every_text_of_a_figure_contrasts_with_its_background_as_wcag_asks():
    root = one_of_each_panel()
    background = hex_rgb(root[0].get("fill"))
    texts = list(drawn_text(root))
    shown = {text for text, _ in texts}
    assert {"output tokens/s", "accept length", "step", "promoted v2", "no draft", "1 concurrent"} <= shown
    faint = [(text, fill, round(float(contrast(hex_rgb(fill), background)), 2)) for text, fill in texts
             if contrast(hex_rgb(fill), background) < TEXT_MINIMUM]
    assert not faint, f"text under {TEXT_MINIMUM}:1 on the figure's {root[0].get('fill')}: {faint}"


def test_panels_go_two_to_a_row():
    sizes = {n: ET.fromstring(figure([lines("loss", "step", {"train": [(1, 2.0), (2, 1.0)]})] * n)).attrib
             for n in (1, 2, 3)}
    assert [(int(sizes[n]["width"]), int(sizes[n]["height"])) for n in (1, 2, 3)] == \
        [(WIDTH, HEIGHT), (2 * WIDTH, HEIGHT), (2 * WIDTH, 2 * HEIGHT)]
