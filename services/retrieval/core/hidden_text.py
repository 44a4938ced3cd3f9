"""Text a reader of a document cannot see, found so that ingestion can leave it out.

A file can hold text that no reader sees but a parser reads: an HTML element styled
``display:none``, white text on a white page, a Word run marked hidden, a PDF string drawn in
white or outside the page. Indexed, such text is retrieved, quoted as an answer and put in front
of a model, which makes it a channel for indirect prompt injection (OWASP LLM01). The parsers
(core/parsing.py) leave it out and count what they left out; a collection created with
``keep_hidden_text`` keeps it.

The unit counted differs by format, each the smallest thing the format hides as one:

- HTML: an element left out with all it holds (``display:none``, ``visibility:hidden`` text,
  ``hidden``, ``aria-hidden="true"``, ``opacity:0``, a zero-size box that clips, ``<noscript>``,
  ``<template>``), an element whose own text is left out (text in its background's colour, in
  zero size, or under ``visibility:hidden``), and a comment.
- PDF: a text-showing operator (``Tj``, ``TJ``, ``'``, ``"``) of a page's content stream.
- DOCX: a run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

RGB = tuple[float, float, float]  # channels in 0..1
RGBA = tuple[float, float, float, float]
Matrix = tuple[float, float, float, float, float, float]
Box = tuple[float, float, float, float]  # x0, y0, x1, y1

WHITE: RGB = (1.0, 1.0, 1.0)
BLACK: RGB = (0.0, 0.0, 0.0)
# Channels this close are one colour to the eye: #fafafa on white cannot be read; #eeeeee
# (17/255 away), faint as it is, can. Per channel rather than by luminance contrast, since two
# hues of equal luminance (red on green) are plainly readable.
SAME_COLOUR = 12 / 255
# PDF text set smaller than this (in points, as drawn on the page) is a dot, not a word.
MIN_PDF_TEXT_PT = 1.0


def same_colour(a: RGB, b: RGB) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= SAME_COLOUR


def _over(top: RGBA, under: RGB) -> RGB:
    """``top`` composited over the opaque colour ``under``."""
    r, g, b, a = top
    return (r * a + under[0] * (1 - a), g * a + under[1] * (1 - a), b * a + under[2] * (1 - a))


# --- HTML --------------------------------------------------------------------------------------

# CSS named colours (CSS Color Module Level 4), as name:rrggbb.
_NAME_TABLE = (
    "aliceblue:f0f8ff antiquewhite:faebd7 aqua:00ffff aquamarine:7fffd4 azure:f0ffff beige:f5f5dc "
    "bisque:ffe4c4 black:000000 blanchedalmond:ffebcd blue:0000ff blueviolet:8a2be2 brown:a52a2a "
    "burlywood:deb887 cadetblue:5f9ea0 chartreuse:7fff00 chocolate:d2691e coral:ff7f50 "
    "cornflowerblue:6495ed cornsilk:fff8dc crimson:dc143c cyan:00ffff darkblue:00008b "
    "darkcyan:008b8b darkgoldenrod:b8860b darkgray:a9a9a9 darkgreen:006400 darkgrey:a9a9a9 "
    "darkkhaki:bdb76b darkmagenta:8b008b darkolivegreen:556b2f darkorange:ff8c00 "
    "darkorchid:9932cc darkred:8b0000 darksalmon:e9967a darkseagreen:8fbc8f darkslateblue:483d8b "
    "darkslategray:2f4f4f darkslategrey:2f4f4f darkturquoise:00ced1 darkviolet:9400d3 "
    "deeppink:ff1493 deepskyblue:00bfff dimgray:696969 dimgrey:696969 dodgerblue:1e90ff "
    "firebrick:b22222 floralwhite:fffaf0 forestgreen:228b22 fuchsia:ff00ff gainsboro:dcdcdc "
    "ghostwhite:f8f8ff gold:ffd700 goldenrod:daa520 gray:808080 green:008000 greenyellow:adff2f "
    "grey:808080 honeydew:f0fff0 hotpink:ff69b4 indianred:cd5c5c indigo:4b0082 ivory:fffff0 "
    "khaki:f0e68c lavender:e6e6fa lavenderblush:fff0f5 lawngreen:7cfc00 lemonchiffon:fffacd "
    "lightblue:add8e6 lightcoral:f08080 lightcyan:e0ffff lightgoldenrodyellow:fafad2 "
    "lightgray:d3d3d3 lightgreen:90ee90 lightgrey:d3d3d3 lightpink:ffb6c1 lightsalmon:ffa07a "
    "lightseagreen:20b2aa lightskyblue:87cefa lightslategray:778899 lightslategrey:778899 "
    "lightsteelblue:b0c4de lightyellow:ffffe0 lime:00ff00 limegreen:32cd32 linen:faf0e6 "
    "magenta:ff00ff maroon:800000 mediumaquamarine:66cdaa mediumblue:0000cd mediumorchid:ba55d3 "
    "mediumpurple:9370db mediumseagreen:3cb371 mediumslateblue:7b68ee mediumspringgreen:00fa9a "
    "mediumturquoise:48d1cc mediumvioletred:c71585 midnightblue:191970 mintcream:f5fffa "
    "mistyrose:ffe4e1 moccasin:ffe4b5 navajowhite:ffdead navy:000080 oldlace:fdf5e6 olive:808000 "
    "olivedrab:6b8e23 orange:ffa500 orangered:ff4500 orchid:da70d6 palegoldenrod:eee8aa "
    "palegreen:98fb98 paleturquoise:afeeee palevioletred:db7093 papayawhip:ffefd5 "
    "peachpuff:ffdab9 peru:cd853f pink:ffc0cb plum:dda0dd powderblue:b0e0e6 purple:800080 "
    "rebeccapurple:663399 red:ff0000 rosybrown:bc8f8f royalblue:4169e1 saddlebrown:8b4513 "
    "salmon:fa8072 sandybrown:f4a460 seagreen:2e8b57 seashell:fff5ee sienna:a0522d silver:c0c0c0 "
    "skyblue:87ceeb slateblue:6a5acd slategray:708090 slategrey:708090 snow:fffafa "
    "springgreen:00ff7f steelblue:4682b4 tan:d2b48c teal:008080 thistle:d8bfd8 tomato:ff6347 "
    "turquoise:40e0d0 violet:ee82ee wheat:f5deb3 white:ffffff whitesmoke:f5f5f5 yellow:ffff00 "
    "yellowgreen:9acd32 "
)
_NAMED = dict(pair.split(":") for pair in _NAME_TABLE.split())


def css_colour(value: str) -> RGBA | None:
    """A CSS colour as RGBA in 0..1; None for what this does not read (``var()``, ``hsl()``,
    system colours): such a colour is never judged to hide text."""
    v = value.strip().lower()
    if v == "transparent":
        return (0.0, 0.0, 0.0, 0.0)
    v = "#" + _NAMED[v] if v in _NAMED else v
    m = re.fullmatch(r"#([0-9a-f]{3,8})", v)
    if m:
        h = m.group(1)
        if len(h) in (3, 4):
            h = "".join(c * 2 for c in h)
        if len(h) not in (6, 8):
            return None
        h = h if len(h) == 8 else h + "ff"
        r, g, b, a = (int(h[i : i + 2], 16) / 255 for i in range(0, 8, 2))
        return (r, g, b, a)
    m = re.fullmatch(r"rgba?\(([^()]*)\)", v)
    if not m:
        return None
    parts = [p for p in re.split(r"[\s,/]+", m.group(1).strip()) if p]
    if len(parts) not in (3, 4):
        return None
    try:
        rgb = [float(p[:-1]) / 100 if p.endswith("%") else float(p) / 255 for p in parts[:3]]
        alpha = 1.0
        if len(parts) == 4:
            alpha = float(parts[3][:-1]) / 100 if parts[3].endswith("%") else float(parts[3])
    except ValueError:
        return None
    r, g, b, a = (min(max(x, 0.0), 1.0) for x in (*rgb, alpha))
    return (r, g, b, a)


# The properties that can hide text; the others are not read.
_PROPS = frozenset(
    {
        *("display", "visibility", "opacity", "font-size", "color", "background"),
        *("background-color", "background-image", "width", "height", "overflow"),
        *("overflow-x", "overflow-y"),
    }
)
# Elements laid out inline unless a style says otherwise: ``width`` and ``height`` do not apply.
_INLINE = frozenset(
    {
        *("a", "abbr", "b", "bdi", "bdo", "cite", "code", "data", "dfn", "em", "font", "i", "kbd"),
        *("label", "mark", "q", "s", "samp", "small", "span", "strong", "sub", "sup", "time"),
        *("u", "var"),
    }
)
_ZERO = re.compile(r"[+-]?0*\.?0+(?:[a-z]+|%)?")
_RELATIVE = re.compile(r"[\d.]+(?:em|ex|ch|%)|smaller|larger")
_IMPORTANT = re.compile(r"!\s*important\s*$", re.I)

Rank = tuple[bool, tuple[int, int, int, int], int]  # !important, specificity, order


def _declarations(text: str) -> dict[str, tuple[str, bool]]:
    """The hiding-relevant declarations of a style attribute or rule body: {property:
    (value, important)}."""
    out: dict[str, tuple[str, bool]] = {}
    for decl in text.split(";"):
        prop, sep, value = decl.partition(":")
        prop = prop.strip().lower()
        if not sep or prop not in _PROPS:
            continue
        m = _IMPORTANT.search(value)
        important = m is not None
        value = (value[: m.start()] if m else value).strip().lower()
        if prop not in out or important or not out[prop][1]:
            out[prop] = (value, important)
    return out


def _rules(css: str) -> Iterator[tuple[str, str]]:
    """(selectors, body) of a style sheet's top-level rules. At-rules are skipped with what they
    hold: a ``@media print`` rule says nothing of what a reader on a screen sees."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    depth = start = body = 0
    prelude = ""
    for i, ch in enumerate(css):
        if ch == "{":
            if depth == 0:
                prelude, body = css[start:i].strip(), i + 1
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                if prelude and not prelude.startswith("@"):
                    yield prelude, css[body:i]
                start = i + 1
        elif ch == ";" and depth == 0:
            start = i + 1  # the end of an @import or @charset


def _specificity(selector: str) -> tuple[int, int, int, int]:
    """A selector's specificity, counted from its text: ids, then classes, attributes and
    pseudo-classes, then element names."""
    ids = len(re.findall(r"#[\w-]+", selector))
    classes = len(re.findall(r"\.[\w-]+|\[[^\]]*\]|(?<!:):[\w-]+", selector))
    types = len(re.findall(r"(?:^|[\s>+~(])[a-zA-Z][\w-]*", selector))
    return (0, ids, classes, types)


def _styles(soup: Any) -> dict[int, dict[str, str]]:
    """{id(element): {property: value}}: the winning declaration of each hiding-relevant
    property, from the page's ``<style>`` rules (matched by soupsieve), ``style`` attributes
    and the ``color``/``bgcolor`` attributes of old HTML. The cascade is the usual one:
    ``!important``, then specificity (inline first), then the later rule."""
    from soupsieve import SelectorSyntaxError

    won: dict[int, dict[str, tuple[Rank, str]]] = {}

    def put(el: Any, decls: dict[str, tuple[str, bool]], spec: tuple[int, int, int, int], order: int) -> None:
        mine = won.setdefault(id(el), {})
        for prop, (value, important) in decls.items():
            rank = (important, spec, order)
            if prop not in mine or mine[prop][0] <= rank:
                mine[prop] = (rank, value)

    order = 0
    for sheet in soup.find_all("style"):
        media = str(sheet.get("media") or "all").lower()
        if not re.search(r"\b(?:all|screen)\b", media):
            continue
        for prelude, body in _rules(sheet.get_text()):
            decls = _declarations(body)
            if not decls:
                continue
            for selector in prelude.split(","):
                order += 1
                try:
                    matched = soup.select(selector.strip())
                except (SelectorSyntaxError, NotImplementedError):
                    continue  # pseudo-elements, and selectors soupsieve does not know
                for el in matched:
                    put(el, decls, _specificity(selector), order)
    for el in soup.find_all(attrs={"bgcolor": True}):
        put(el, {"background-color": (str(el["bgcolor"]).lower(), False)}, (0, 0, 0, 0), -1)
    for el in soup.find_all("font", attrs={"color": True}):
        put(el, {"color": (str(el["color"]).lower(), False)}, (0, 0, 0, 0), -1)
    for el in soup.find_all(attrs={"style": True}):
        put(el, _declarations(str(el["style"])), (1, 0, 0, 0), order + 1)
    return {k: {p: v for p, (_, v) in props.items()} for k, props in won.items()}


@dataclass(frozen=True)
class _Inherited:
    """What an element passes on to its content: whether its text is invisible or of zero size,
    its text colour and the colour behind it (None: not known, never judged)."""

    invisible: bool = False
    zero_size: bool = False
    colour: RGBA | None = (0.0, 0.0, 0.0, 1.0)
    background: RGB | None = WHITE

    def unseen(self) -> bool:
        if self.invisible or self.zero_size:
            return True
        if self.colour is None:
            return False
        if self.colour[3] == 0:
            return True
        return self.background is not None and same_colour(
            _over(self.colour, self.background), self.background
        )


def _zero(value: str | None) -> bool:
    return value is not None and _ZERO.fullmatch(value) is not None


def _gone(el: Any, style: dict[str, str]) -> bool:
    """Whether a reader sees nothing of the element, nor of anything in it."""
    if el.name == "noscript" or el.has_attr("hidden"):
        return True
    if str(el.get("aria-hidden") or "").strip().lower() == "true":
        return True
    if style.get("display") == "none":
        return True
    try:
        if float(style.get("opacity", "1").rstrip("%")) == 0:
            return True
    except ValueError:
        pass
    overflow = " ".join(style.get(p, "") for p in ("overflow", "overflow-x", "overflow-y"))
    clips = bool(re.search(r"\b(?:hidden|clip)\b", overflow))
    sized = el.name not in _INLINE or style.get("display", "inline") != "inline"
    return clips and sized and (_zero(style.get("width")) or _zero(style.get("height")))


def _inherit(up: _Inherited, style: dict[str, str]) -> _Inherited:
    if not style:
        return up
    vis = style.get("visibility")
    invisible = vis in ("hidden", "collapse") if vis in ("hidden", "collapse", "visible") else up.invisible
    size = style.get("font-size")
    if size is None or size == "inherit":
        zero_size = up.zero_size
    else:
        zero_size = _zero(size) or (up.zero_size and _RELATIVE.fullmatch(size) is not None)
    colour = up.colour
    if style.get("color") not in (None, "inherit", "currentcolor"):
        colour = css_colour(style["color"])
    background = up.background
    shorthand = style.get("background", "")
    image = style.get("background-image", "none")
    if "url(" in shorthand or "gradient" in shorthand or image not in ("none", "initial"):
        background = None  # a picture: its colours are not known here
    else:
        paint: RGBA | None = None
        known = True
        if "background-color" in style:
            paint = css_colour(style["background-color"])
            known = paint is not None or style["background-color"] in ("inherit", "initial", "none")
        elif shorthand:
            found = [c for c in (css_colour(w) for w in shorthand.split()) if c is not None]
            paint = found[0] if found else None
        if not known:
            background = None
        elif paint is not None and paint[3] > 0 and up.background is not None:
            background = _over(paint, up.background)
        elif paint is not None and paint[3] == 1:
            background = paint[:3]
    return _Inherited(invisible, zero_size, colour, background)


def drop_hidden_html(soup: Any, keep: bool = False) -> int:
    """Take out of ``soup`` the text a reader of the page cannot see; the count of what was
    taken out (elements and comments, as the module says).

    Comments and ``<template>`` go whatever ``keep`` says: they are markup a browser never
    draws, and no reader can reveal them. ``<noscript>`` is hidden text: a reader sees it only
    with scripts turned off, and what it holds is mostly a plea to turn them on or a tracking
    pixel; with ``keep`` it stays. Style sheets linked from the page are not fetched: only
    ``<style>`` elements and ``style`` attributes are read."""
    from bs4 import CData, Comment, NavigableString, Tag

    removed = 0
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment)):
        removed += bool(comment.strip())
        comment.extract()
    for template in soup.find_all("template"):
        removed += bool(template.get_text(strip=True))
        template.decompose()
    if keep:
        return removed
    styles = _styles(soup)
    elements: list[Any] = []
    texts: list[Any] = []
    owners: set[int] = set()
    stack: list[tuple[Any, _Inherited]] = [(soup, _Inherited())]
    while stack:  # not recursive: a hostile page nests as deep as it likes
        tag, up = stack.pop()
        hidden_text = up.unseen()
        for child in tag.children:
            if isinstance(child, Tag):
                if child.name in ("script", "style", "head"):
                    continue
                style = styles.get(id(child), {})
                if _gone(child, style):
                    removed += bool(child.get_text(strip=True))
                    elements.append(child)
                else:
                    stack.append((child, _inherit(up, style)))
            elif type(child) in (NavigableString, CData) and hidden_text and child.strip():
                texts.append(child)
                owners.add(id(tag))
    for el in elements:
        el.decompose()
    for text in texts:
        text.replace_with(" ")  # invisible text still holds its place between the words around it
    return removed + len(owners)


# --- DOCX --------------------------------------------------------------------------------------


def docx_run_hidden(run: Any) -> bool:
    """Whether Word hides a run (``w:vanish``): set on the run, else on its character style or
    the styles it is based on, else on its paragraph's style or theirs."""
    if run.font.hidden is not None:
        return bool(run.font.hidden)
    for style in (run.style, getattr(run._parent, "style", None)):
        seen = 0
        while style is not None and seen < 32:  # a loop of based-on styles ends somewhere
            hidden = style.font.hidden
            if hidden is not None:
                return bool(hidden)
            style, seen = style.base_style, seen + 1
    return False


# --- PDF ---------------------------------------------------------------------------------------

IDENTITY: Matrix = (1.0, 0.0, 0.0, 1.0, 0.0, 0.0)


def _mul(m: Matrix, n: Matrix) -> Matrix:
    """The product ``m n`` of two PDF matrices (``[a b c d e f]``, row vectors)."""
    a, b, c, d, e, f = m
    return (
        a * n[0] + b * n[2],
        a * n[1] + b * n[3],
        c * n[0] + d * n[2],
        c * n[1] + d * n[3],
        e * n[0] + f * n[2] + n[4],
        e * n[1] + f * n[3] + n[5],
    )


def _apply(m: Matrix, x: float, y: float) -> tuple[float, float]:
    return (x * m[0] + y * m[2] + m[4], x * m[1] + y * m[3] + m[5])


def _bbox(points: list[tuple[float, float]]) -> Box:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return (min(xs), min(ys), max(xs), max(ys))


def _inside(p: tuple[float, float], box: Box) -> bool:
    return box[0] <= p[0] <= box[2] and box[1] <= p[1] <= box[3]


@dataclass(frozen=True)
class _Graphics:
    """The part of a PDF graphics state that decides whether text shows (saved by ``q``)."""

    ctm: Matrix = IDENTITY
    fill: RGB | None = BLACK  # None: a pattern, or a colour space not read here
    space: str = "gray"  # how ``sc``/``scn`` operands read: gray, rgb, cmyk, or "" (not known)
    size: float = 0.0
    leading: float = 0.0
    mode: int = 0


def _nums(operands: list[Any]) -> list[float] | None:
    try:
        return [float(o) for o in operands]
    except (TypeError, ValueError):
        return None


def _device_colour(space: str, operands: list[Any]) -> RGB | None:
    v = _nums(operands)
    if v is None:
        return None
    if space == "gray" and len(v) == 1:
        return (v[0], v[0], v[0])
    if space == "rgb" and len(v) == 3:
        return (v[0], v[1], v[2])
    if space == "cmyk" and len(v) == 4:
        c, m, y, k = v
        return ((1 - c) * (1 - k), (1 - m) * (1 - k), (1 - y) * (1 - k))
    return None


def _colour_space(name: Any, resources: Any) -> str:
    """gray, rgb or cmyk for a colour space whose components read as a device's; "" for the
    others (Separation, DeviceN, Indexed, Lab, Pattern), whose components say nothing of
    white."""
    family = {"/DeviceGray": "gray", "/DeviceRGB": "rgb", "/DeviceCMYK": "cmyk"}
    family.update({"/G": "gray", "/RGB": "rgb", "/CMYK": "cmyk", "/CalGray": "gray", "/CalRGB": "rgb"})
    if str(name) in family:
        return family[str(name)]
    try:
        spaces = resources["/ColorSpace"].get_object()
        cs = spaces[name].get_object()
        if not isinstance(cs, list) or not cs:
            return family.get(str(cs), "")
        if str(cs[0]) == "/ICCBased":
            return {1: "gray", 3: "rgb", 4: "cmyk"}.get(int(cs[1].get_object()["/N"]), "")
        return family.get(str(cs[0]), "")
    except Exception:  # no such resource, or a broken one: not known
        return ""


def _string_length(operands: list[Any]) -> int:
    n = 0
    for o in operands:
        if isinstance(o, list):
            n += _string_length(o)
        elif isinstance(o, str | bytes):
            n += len(getattr(o, "original_bytes", o))
    return n


def _page_box(page: Any) -> Box:
    """The part of the page a reader sees: its crop box within its media box."""

    def norm(r: Any) -> Box:
        x0, y0, x1, y1 = (float(v) for v in r)
        return (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))

    media, crop = norm(page.mediabox), norm(page.cropbox)
    return (max(media[0], crop[0]), max(media[1], crop[1]), min(media[2], crop[2]), min(media[3], crop[3]))


def drop_hidden_pdf_text(page: Any) -> int:
    """Take out of a pypdf page's content stream the text a reader cannot see; the number of
    text-showing operators taken out. Hidden are: text wholly outside the page's crop box, text
    drawn smaller than ``MIN_PDF_TEXT_PT``, and filled text in the colour of what lies under it
    (the white page, or the last shape filled there; an image or a form drawn there is taken as
    showing the text).

    Invisible text (render mode 3) is not hidden by its mode: OCR writes a scanned page's words
    that way over the page's image, where the reader sees them. Text in the page's form
    XObjects is not looked into."""
    from pypdf.generic import ContentStream, NameObject

    contents = page.get_contents()
    if contents is None:
        return 0
    resources = page.get("/Resources")
    scan = _PageScan(_page_box(page), resources.get_object() if resources is not None else {})
    kept: list[tuple[list[Any], bytes]] = []
    removed = 0
    for operands, op in contents.operations:
        if op in _SHOW_TEXT:
            if op in (b"'", b'"'):
                scan.next_line()
            if scan.hidden(_string_length(operands)):
                removed += 1
                kept += _line_moves_of(operands, op)
                continue
        else:
            scan.read(operands, op)
        kept.append((operands, op))
    if removed:
        contents.operations = kept
        page[NameObject("/Contents")] = ContentStream(contents, page.pdf)
    return removed


_SHOW_TEXT = (b"Tj", b"TJ", b"'", b'"')


def _line_moves_of(operands: list[Any], op: bytes) -> list[tuple[list[Any], bytes]]:
    """What stays of a text-showing operator taken out: the spacing and the line move of ``"``
    and the line move of ``'`` (later lines depend on them)."""
    if op == b'"':
        return [([operands[0]], b"Tw"), ([operands[1]], b"Tc"), ([], b"T*")]
    if op == b"'":
        return [([], b"T*")]
    return []


class _PageScan:
    """What a page's content stream has set up so far, as far as it decides whether text shows:
    the graphics state (and those ``q`` saved), the text matrices, the path being built, and the
    areas filled with their colours."""

    def __init__(self, box: Box, resources: Any) -> None:
        self.box, self.resources = box, resources
        self.gs = _Graphics()
        self.saved: list[_Graphics] = []
        self.tm = self.tlm = IDENTITY
        self.path: list[tuple[float, float]] = []
        self.painted: list[tuple[Box, RGB | None]] = []
        self.colours: set[RGB] = {WHITE}  # what text could be lost against: the page and what was painted

    def hidden(self, n: int) -> bool:
        """Whether ``n`` characters shown now, at the text matrix, would not be seen."""
        gs = self.gs
        trm = _mul((gs.size, 0.0, 0.0, gs.size, 0.0, 0.0), _mul(self.tm, gs.ctm))
        width = max(n, 1) * 0.6  # about a glyph's width, in text space: an estimate on the wide side
        x0, y0, x1, y1 = _bbox([_apply(trm, x, y) for x in (0.0, width) for y in (-0.25, 1.0)])
        box = self.box
        if x1 < box[0] or x0 > box[2] or y1 < box[1] or y0 > box[3]:
            return True
        if gs.mode == 3:
            return False
        if math.hypot(trm[2], trm[3]) < MIN_PDF_TEXT_PT:
            return True
        fill = gs.fill
        if gs.mode not in (0, 4) or fill is None or not any(same_colour(fill, c) for c in self.colours):
            return False
        at = _apply(trm, 0.25, 0.3)  # inside the first glyph
        under: RGB | None = WHITE
        for area, colour in reversed(self.painted):
            if _inside(at, area):
                under = colour
                break
        return under is not None and same_colour(fill, under)

    def next_line(self) -> None:
        self.tm = self.tlm = _mul((1.0, 0.0, 0.0, 1.0, 0.0, -self.gs.leading), self.tlm)

    def read(self, operands: list[Any], op: bytes) -> None:
        """Follow any operator but one that shows text (one that changes nothing here is passed over)."""
        for step in (self._graphics_state, self._text_position, self._painting):
            if step(operands, op):
                return

    def _graphics_state(self, operands: list[Any], op: bytes) -> bool:
        gs = self.gs
        if op == b"q":
            self.saved.append(gs)
        elif op == b"Q":
            self.gs = self.saved.pop() if self.saved else gs
        elif op == b"cm" and (m := _nums(operands)) and len(m) == 6:
            self.gs = replace(gs, ctm=_mul((m[0], m[1], m[2], m[3], m[4], m[5]), gs.ctm))
        elif op in (b"g", b"rg", b"k"):
            space = {b"g": "gray", b"rg": "rgb", b"k": "cmyk"}[op]
            self.gs = replace(gs, space=space, fill=_device_colour(space, operands))
        elif op == b"cs" and operands:
            space = _colour_space(operands[0], self.resources)
            self.gs = replace(gs, space=space, fill=BLACK if space else None)
        elif op in (b"sc", b"scn"):
            self.gs = replace(gs, fill=_device_colour(gs.space, operands))
        elif op == b"TL" and (m := _nums(operands)):
            self.gs = replace(gs, leading=m[0])
        elif op == b"Tf" and len(operands) == 2 and (m := _nums(operands[1:])):
            self.gs = replace(gs, size=m[0])
        elif op == b"Tr" and (m := _nums(operands)):
            self.gs = replace(gs, mode=int(m[0]))
        else:
            return False
        return True

    def _text_position(self, operands: list[Any], op: bytes) -> bool:
        if op == b"BT":
            self.tm = self.tlm = IDENTITY
        elif op == b"Tm" and (m := _nums(operands)) and len(m) == 6:
            self.tm = self.tlm = (m[0], m[1], m[2], m[3], m[4], m[5])
        elif op in (b"Td", b"TD") and (m := _nums(operands)) and len(m) == 2:
            if op == b"TD":
                self.gs = replace(self.gs, leading=-m[1])
            self.tm = self.tlm = _mul((1.0, 0.0, 0.0, 1.0, m[0], m[1]), self.tlm)
        elif op == b"T*":
            self.next_line()
        else:
            return False
        return True

    def _painting(self, operands: list[Any], op: bytes) -> bool:
        if op == b"re" and (m := _nums(operands)) and len(m) == 4:
            x, y, w, h = m
            self.path += [(x, y), (x + w, y), (x, y + h), (x + w, y + h)]
        elif op in (b"m", b"l", b"c", b"v", b"y") and (m := _nums(operands)):
            self.path += list(zip(m[0::2], m[1::2], strict=False))
        elif op in (b"f", b"F", b"f*", b"B", b"B*", b"b", b"b*"):
            self._paint(self.path, self.gs.fill)
            self.path = []
        elif op in (b"S", b"s", b"n"):
            self.path = []
        elif op == b"sh":
            self.painted.append((self.box, None))
        elif op == b"INLINE IMAGE":
            self._paint([(0.0, 0.0), (1.0, 1.0)], None)
        elif op == b"Do" and operands:
            self._paint(_xobject_outline(operands[0], self.resources), None)
        else:
            return False
        return True

    def _paint(self, points: list[tuple[float, float]], colour: RGB | None) -> None:
        if points:
            self.painted.append((_bbox([_apply(self.gs.ctm, x, y) for x, y in points]), colour))
            if colour is not None:
                self.colours.add(colour)


def _xobject_outline(name: Any, resources: Any) -> list[tuple[float, float]]:
    """Corners, in the space where it is drawn, of an image (the unit square) or a form (its
    ``/BBox`` through its ``/Matrix``)."""
    try:
        xobj = resources["/XObject"].get_object()[name].get_object()
    except Exception:  # a missing resource draws nothing
        return []
    if str(xobj.get("/Subtype")) != "/Form":
        return [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)]
    try:
        x0, y0, x1, y1 = (float(v) for v in xobj["/BBox"])
        raw = xobj.get("/Matrix")
        matrix = tuple(float(v) for v in raw) if raw is not None else IDENTITY
    except Exception:
        return []
    if len(matrix) != 6:
        return []
    m = (matrix[0], matrix[1], matrix[2], matrix[3], matrix[4], matrix[5])
    return [_apply(m, x, y) for x in (x0, x1) for y in (y0, y1)]
