"""What a filled-in PDF says outside its page content: the values of its form fields and the text of its free-text
annotations, placed in the page's text beside the label each one answers.

A contract's order form or cover page is often a PDF form filled in a viewer. The values (a fee, a term, a party's
name, a ticked box) then live in the form's fields, drawn by the viewer from each field's appearance; they are no
part of the page's content stream, so pypdf's `extract_text` leaves them out, and a loaded contract would lack
exactly the figures its questions ask about. Text typed onto a flat PDF with a viewer's "fill and sign" tool is a
free-text annotation, likewise outside the content.

Each value goes into the extracted text after the text fragment that labels it: a caption in the top of its own box
(a boxed form's cell), else the nearest fragment to its left on the same row ("Monthly fee: USD 7,400"), else the
nearest one just above it. A check box or radio button is "[x]" when on and "[ ]" when off, put before the nearest
fragment to its right (its caption), else after its label. A value with no label found is added at the end of the
page as "field name: value", as is every value of a page whose content has no text (a form filled in on a blank page,
a note typed onto an empty one). Fields without a value add nothing, and neither do fields and notes a viewer does
not show (flagged hidden or no-view). A page whose content has no text but draws images (a scan, perhaps signed with
a note) gets no values: they alone would hide that its text is not read; it is still a page to be OCR'd.

Known limits: pypdf reports text positions per line of a text object, so labels that one text object writes on a
row ("Monthly fee: ____ Start date: ____" in one run) are one fragment, and every value of the row follows it; a
template drawn as a form XObject under a transform reports its text where the template itself lies, so values on
it may go to the wrong label or the page's end.
"""

from __future__ import annotations

import html
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pypdf import PageObject
from pypdf.generic import ArrayObject, DictionaryObject, NameObject

from .pdf_damage import resolved

# A fragment is on a box's row when its baseline lies within the box's height, give or take this (points).
_ROW_TOLERANCE = 3.0
# A label above a box is at most this far above its top edge (points: about two lines of body text).
_ABOVE_REACH = 28.0
# Field flags (PDF 32000-1, table 226): a button that is a push button, not a check box or radio button.
_PUSH_BUTTON = 1 << 16
# Annotation flags (PDF 32000-1, table 165): Hidden and NoView, never shown on screen (a form's working values).
_NOT_SHOWN = (1 << 1) | (1 << 5)
_MARKUP = re.compile(r"<[^>]*>")


@dataclass(frozen=True)
class Fragment:
    """One piece of text as pypdf shows it: its text and the page coordinates (points) where it starts."""

    text: str
    x: float
    y: float


@dataclass(frozen=True)
class Filled:
    """A value the page holds outside its content: its text, its box (x0, y0, x1, y1 in points), the field's
    name, and for a check box or radio button whether it is on (None for text: a button's caption is usually to
    its right, a text's label to its left)."""

    text: str
    box: tuple[float, float, float, float]
    name: str
    checked: bool | None = None

    @property
    def shown(self) -> str:
        if self.checked is None:
            return self.text
        return "[x]" if self.checked else "[ ]"


def page_text(page: PageObject) -> str:
    """The page's text as pypdf extracts it, with its filled-in values placed beside their labels (none on a scan:
    a page whose content has no text but draws images)."""
    values = filled_values(page)
    if not values:
        return page.extract_text()
    drawn: list[tuple[str, float, float, int]] = []  # (text, x, y, quarter turns of its baseline) in user space

    def collect(text: str, matrix: Sequence[float], text_matrix: Sequence[float], *_font: object) -> None:
        if text.strip():
            x, y = text_matrix[4], text_matrix[5]
            along = (
                text_matrix[0] * matrix[0] + text_matrix[1] * matrix[2],
                text_matrix[0] * matrix[1] + text_matrix[1] * matrix[3],
            )
            drawn.append(
                (
                    text,
                    x * matrix[0] + y * matrix[2] + matrix[4],
                    x * matrix[1] + y * matrix[3] + matrix[5],
                    round(math.degrees(math.atan2(along[1], along[0])) / 90) % 4,
                )
            )

    text = page.extract_text(visitor_text=collect)
    if not text.strip() and draws_images(page):
        return text
    turns = _text_turns(drawn) if drawn else _shown_turns(page)
    fragments = [Fragment(piece, *_upright(turns, x, y)) for piece, x, y, _ in drawn]
    values = sorted((replace(value, box=_upright_box(turns, value.box)) for value in values), key=_reading_order)
    return with_filled_values(text, fragments, values)


def draws_images(page: PageObject) -> bool:
    """Whether a page draws images, as a scan does; a blank page draws none."""
    try:
        return len(page.images) > 0
    except MemoryError:
        raise
    except Exception:  # images pypdf cannot even list: not known to be a scan
        return False


_PAINTING = frozenset(
    {b"Tj", b"TJ", b"'", b'"', b"S", b"s", b"f", b"F", b"f*", b"B", b"B*", b"b", b"b*", b"sh", b"Do", b"BI"}
)
"""Content operators that put marks on a page: text shown, paths stroked or filled, shadings, images and forms."""


def draws_nothing(page: PageObject) -> bool:
    """Whether a page is blank: its content paints nothing and it carries no annotations. A page that paints what
    reads as no text (text drawn as outlines, a font without a text mapping) is not blank: it needs OCR."""
    try:
        if page.get("/Annots"):
            return False
        contents = page.get_contents()
        return contents is None or not any(operator in _PAINTING for _, operator in contents.operations)
    except MemoryError:
        raise
    except Exception:  # content pypdf cannot parse: not known to be blank
        return False


def filled_values(page: PageObject) -> list[Filled]:
    """The form field values and free-text annotations that `page` shows, top to bottom, left to right."""
    found = []
    for annotation in _annotations(page):
        subtype = annotation.get("/Subtype")
        box = _box(annotation.get("/Rect"))
        flags = resolved(annotation.get("/F"))
        if box is None or (isinstance(flags, int) and flags & _NOT_SHOWN):
            continue
        if subtype == "/FreeText":
            text = _text(annotation.get("/Contents")) or _rich_text(annotation.get("/RC"))
            if text:
                found.append(Filled(text, box, "note"))
        elif subtype == "/Widget":
            filled = _field_value(annotation, box)
            if filled is not None:
                found.append(filled)
    return sorted(found, key=_reading_order)


def _reading_order(filled: Filled) -> tuple[float, float]:
    return -filled.box[3], filled.box[0]


def _text_turns(drawn: Sequence[tuple[str, float, float, int]]) -> int:
    """Quarter turns (counter-clockwise) of the page's text: the direction most of its characters run in. A landscape
    page made as a portrait one with its content turned (printer drivers, scanners; shown upright by its /Rotate)
    runs its rows up the page, so rows, "left of" and "above" are the text's own, whatever /Rotate says."""
    characters = Counter[int]()
    for text, _x, _y, turns in drawn:
        characters[turns] += len(text.strip())
    return characters.most_common(1)[0][0] if characters else 0


def _shown_turns(page: PageObject) -> int:
    """Quarter turns (counter-clockwise) that undo the page's /Rotate: the frame its values are read in where it has
    no text of its own to take a direction from (a form filled in on a page made as a portrait one, shown turned).
    A /Rotate that is no multiple of 90, or no number, is none (viewers ignore it)."""
    rotation = resolved(page.get("/Rotate", 0))
    if isinstance(rotation, bool) or not isinstance(rotation, int) or rotation % 90:
        return 0
    return (rotation // 90) % 4


def _upright(turns: int, x: float, y: float) -> tuple[float, float]:
    """A point of user space in the frame where text turned by `turns` quarter turns runs left to right."""
    for _ in range(turns):
        x, y = y, -x  # a quarter turn clockwise undoes one counter-clockwise
    return x, y


def _upright_box(turns: int, box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    (ax, ay), (bx, by) = _upright(turns, box[0], box[1]), _upright(turns, box[2], box[3])
    return min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)


def with_filled_values(text: str, fragments: Sequence[Fragment], values: Sequence[Filled]) -> str:
    """`text` (the page's extracted text, whose pieces `fragments` are, in order) with each of `values` placed
    beside its label (module docstring)."""
    located = _locate(text, fragments)
    inserts: list[tuple[int, int, str]] = []  # (offset in text, order, what to insert there)
    unlabelled = []
    for order, value in enumerate(values):
        if _already_drawn(value, fragments):
            continue
        placed = _place(value, located, values)
        if placed is None:
            unlabelled.append(f"{value.name}: {value.shown}")
        else:
            offset, before = placed
            inserts.append((offset, order, f"{value.shown} " if before else f" {value.shown}"))
    for offset, _order, insert in sorted(inserts, reverse=True):
        text = text[:offset] + insert + text[offset:]
    if unlabelled:
        text = "\n".join([text.rstrip("\n"), *unlabelled] if text.strip() else unlabelled)
    return text


@dataclass(frozen=True)
class _Located:
    """A fragment and where it lies in the page's extracted text."""

    fragment: Fragment
    start: int
    end: int


def _locate(text: str, fragments: Sequence[Fragment]) -> list[_Located]:
    """The fragments found in `text`, in order (pypdf writes them in the order it met them); one that cannot be
    found there is left out."""
    located = []
    cursor = 0
    for fragment in fragments:
        piece = fragment.text.strip()
        found = text.find(piece, cursor)
        if found >= 0:
            cursor = found + len(piece)
            located.append(_Located(fragment, found, cursor))
    return located


def _place(value: Filled, located: Sequence[_Located], values: Sequence[Filled]) -> tuple[int, bool] | None:
    """Where `value` goes in the text: (offset, whether it goes before the text at that offset), or None. Text to
    its left labels it only when no other field's box (of `values`) stands between: that text is the other
    field's label, and this one's may be above its box."""
    x0, y0, x1, y1 = value.box
    row = [item for item in located if y0 - _ROW_TOLERANCE <= item.fragment.y <= y1 + _ROW_TOLERANCE]
    caption = [item for item in row if x0 - _ROW_TOLERANCE <= item.fragment.x < x1]
    if value.checked is None and caption:
        # A boxed form's cell: its caption starts in (or just on) the box, ahead of the previous cell's caption.
        return min(caption, key=lambda item: (-item.fragment.y, item.fragment.x)).end, False
    if value.checked is not None:
        right = [item for item in row if item.fragment.x >= x1 - _ROW_TOLERANCE]
        if right:
            return min(right, key=lambda item: item.fragment.x).start, True
    in_row = [other.box for other in values if other is not value and other.box[1] <= y1 and y0 <= other.box[3]]
    # In a right-to-left form (Hebrew, Arabic) a label stands to the right of its box: the nearest text there, when
    # it is written right to left and no other box stands between.
    right = [
        item
        for item in row
        if item.fragment.x >= x1 - _ROW_TOLERANCE and not any(x1 <= box[0] < item.fragment.x for box in in_row)
    ]
    if right:
        nearest = min(right, key=lambda item: item.fragment.x)
        if _right_to_left(nearest.fragment.text):
            return nearest.end, False
    between = [box for box in in_row if box[2] <= x0]
    left = [item for item in row if item.fragment.x < x0 and not any(item.fragment.x < box[0] for box in between)]
    if left:
        return max(left, key=lambda item: item.fragment.x).end, False
    above = [
        item
        for item in located
        if y1 < item.fragment.y <= y1 + _ABOVE_REACH and x0 - _ABOVE_REACH <= item.fragment.x < x1
    ]
    if above:
        # The nearest line above, and on it the last fragment, so that the value follows the whole label.
        return min(above, key=lambda item: (item.fragment.y, -item.fragment.x)).end, False
    return None


def _right_to_left(text: str) -> bool:
    """Whether most of the letters of `text` are of a right-to-left script (Unicode's bidirectional classes R, AL)."""
    classes = [unicodedata.bidirectional(char) for char in text]
    strong = sum(kind in ("L", "R", "AL") for kind in classes)
    return strong > 0 and 2 * sum(kind in ("R", "AL") for kind in classes) > strong


def _already_drawn(value: Filled, fragments: Sequence[Fragment]) -> bool:
    """Whether the page's content itself shows the value inside its box (a form flattened but kept): the text
    drawn there, or below a caption on the box's top line, joined, is the value but for whitespace (a value drawn
    line by line, word by word or wrapped otherwise than its own lines), or each of the value's lines is drawn
    there."""
    if value.checked is not None:
        return False
    x0, y0, x1, y1 = value.box
    inside = [
        fragment
        for fragment in fragments
        if x0 - _ROW_TOLERANCE <= fragment.x <= x1 and y0 - _ROW_TOLERANCE <= fragment.y <= y1 + _ROW_TOLERANCE
    ]
    if not inside:
        return False
    top = max(fragment.y for fragment in inside)
    below_caption = [fragment.text for fragment in inside if fragment.y < top - _ROW_TOLERANCE]
    wanted = _without_whitespace(value.text)
    if any(_without_whitespace("".join(texts)) == wanted for texts in ([f.text for f in inside], below_caption)):
        return True
    drawn = {_single_spaced(fragment.text) for fragment in inside}
    lines = [_single_spaced(line) for line in value.text.splitlines() if line.strip()]
    return bool(lines) and all(line in drawn for line in lines)


def _single_spaced(text: str) -> str:
    return " ".join(text.split())


def _without_whitespace(text: str) -> str:
    return "".join(text.split())


def _annotations(page: PageObject) -> Iterator[DictionaryObject]:
    annotations = resolved(page.get("/Annots"))
    if not isinstance(annotations, ArrayObject):
        return
    for item in annotations:
        annotation = resolved(item)
        if isinstance(annotation, DictionaryObject):
            yield annotation


def _field_value(widget: DictionaryObject, box: tuple[float, float, float, float]) -> Filled | None:
    """The value a widget shows, read from it or the field it belongs to (a field's entries are inherited)."""
    kind = _inherited(widget, "/FT")
    name = _field_name(widget)
    if kind == "/Btn":
        flags = _inherited(widget, "/Ff")
        if isinstance(flags, int) and flags & _PUSH_BUTTON:
            return None
        state = resolved(widget.get("/AS"))
        if state is None:  # no state of its own (which the format requires): on if the field's value is its on-state
            value = _inherited(widget, "/V")
            on_states = _on_states(widget)
            state = value if not on_states or value in on_states else NameObject("/Off")
        checked = isinstance(state, NameObject) and state != "/Off"
        return Filled("", box, name, checked)
    if kind not in ("/Tx", "/Ch"):
        return None  # signatures, and fields of no known kind
    value = _inherited(widget, "/V")
    if isinstance(value, ArrayObject):  # a list box with several choices made
        text = ", ".join(_choice_text(widget, item) for item in value)
    else:
        text = _choice_text(widget, value) if kind == "/Ch" else _text(value)
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    return Filled(text, box, name) if text else None


def _on_states(widget: DictionaryObject) -> set[str]:
    """The names a button's normal appearances give its "on" states (a radio button's own value among them)."""
    appearances = resolved(widget.get("/AP"))
    normal = resolved(appearances.get("/N")) if isinstance(appearances, DictionaryObject) else None
    return {str(key) for key in normal if key != "/Off"} if isinstance(normal, DictionaryObject) else set()


def _choice_text(widget: DictionaryObject, value: Any) -> str:
    """A choice's shown text: /Opt pairs an export value with the text a viewer shows for it."""
    chosen = _text(value)
    options = _inherited(widget, "/Opt")
    if isinstance(options, ArrayObject):
        for option in options:
            pair = resolved(option)
            if isinstance(pair, ArrayObject) and len(pair) == 2 and _text(pair[0]) == chosen:
                return _text(pair[1])
    return chosen


def _field_name(widget: DictionaryObject) -> str:
    """The field's tooltip name (/TU), else its full name ("parent.child"), else "field"."""
    tooltip = _text(_inherited(widget, "/TU"))
    if tooltip:
        return tooltip
    parts = [part for part in (_text(node.get("/T")) for node in _lineage(widget)) if part]
    return ".".join(reversed(parts)) or "field"


def _inherited(widget: DictionaryObject, key: str) -> Any:
    """`key` of a widget or of the nearest field above it that has it."""
    return next((resolved(node[key]) for node in _lineage(widget) if key in node), None)


def _lineage(widget: DictionaryObject) -> Iterator[DictionaryObject]:
    """The widget, then each field above it (/Parent), nearest first."""
    node: Any = widget
    for _ in range(32):  # a cycle of /Parent references in a damaged file ends here
        if not isinstance(node, DictionaryObject):
            return
        yield node
        node = resolved(node.get("/Parent"))


def _box(rect: Any) -> tuple[float, float, float, float] | None:
    rect = resolved(rect)
    if not isinstance(rect, ArrayObject) or len(rect) != 4:
        return None
    try:
        x0, y0, x1, y1 = (float(resolved(number)) for number in rect)
    except (TypeError, ValueError):
        return None
    return min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)


def _text(value: Any) -> str:
    value = resolved(value)
    if isinstance(value, NameObject):
        return str(value)[1:]
    if isinstance(value, bytes):  # a string pypdf could not decode as a PDF text string: UTF-8 from many fillers
        try:
            return value.decode("utf-8").strip()
        except UnicodeDecodeError:
            return value.decode("latin-1").strip()
    return str(value).strip() if isinstance(value, str) else ""


def _rich_text(value: Any) -> str:
    """The words of a rich-text string (/RC: XHTML), without its markup."""
    return " ".join(html.unescape(_MARKUP.sub(" ", _text(value))).split())
