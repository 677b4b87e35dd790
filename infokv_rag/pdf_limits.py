"""How much content a PDF makes text extraction parse, bounded per document.

pypdf parses a page's content streams for every page that draws them, and a form's stream for every time a page draws
the form. Its own limits bound one stream's inflation (75 MB) and the forms drawn per page (5,000), not the
product of the two or the sum over pages: a file of 32 KB whose 200 pages share one stream of 1 MB of spaces took
52 seconds to read, one of 71 KB with 20 pages over 70 MB took 338, and a thousand pages would take hours, holding
a service's upload slot all the while. `ContentMeter` counts the decoded bytes extraction will parse, page by page,
before each page is read, and refuses the document once they pass `CONTENT_LIMIT`.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from pypdf import PageObject
from pypdf.errors import LimitReachedError
from pypdf.generic import ArrayObject, DictionaryObject, IndirectObject, StreamObject

from .errors import PDFContentLimitError
from .pdf_damage import resolved

CONTENT_LIMIT = 16 * 2**20
"""Decoded content bytes that extraction may parse per document. pypdf extracts text at about 4.5 us per byte of
typeset content (a pdfTeX manual of 36 pages, 278 KB: 1.3 s), 0.2 us per byte of padding, and a page that reads as
blank is parsed twice more (about 6 us per byte of line drawing), so the limit is a minute or two at worst. Real
documents draw far less: 8 KB a page in that manual, 4-5 KB in the real-document benchmark's PDFs (52 KB at most, 12
pages), so the limit is some 2,000 pages of such text, far beyond what a model's context holds; a document of many
large vector drawings is what it refuses first (their pages are parsed too)."""

_FORM_DEPTH = 64
"""Forms drawing forms deeper than this are refused: pypdf follows every level (it stops only at a cycle), and no
producer nests forms a tenth as deep."""

_DELIMITER = rb"\x00\t\n\x0c\r ()<>\[\]{}/%"
_FORM_DRAWN = re.compile(rb"/([^" + _DELIMITER + rb"]+)[\x00\t\n\x0c\r ]*Do(?![^" + _DELIMITER + rb"])")
_NAME_ESCAPE = re.compile(rb"#([0-9A-Fa-f]{2})")


class ContentMeter:
    """The decoded content bytes read so far (`parsed`) against `limit`, for one document.

    `charge(page, number)` adds what reading the page parses: its content streams, and each form drawn, once per
    draw (a form's bytes and the forms it draws in turn). Every stream counts, a figure's without text too: a page
    that reads as blank is parsed again to tell a scan or a failed extraction from an empty page. A stream is decoded
    and scanned once per document however many pages draw it."""

    def __init__(self, name: str, limit: int = CONTENT_LIMIT) -> None:
        self.name = name
        self.limit = limit
        self.parsed = 0
        self._costs: dict[tuple[int, int], int] = {}

    def charge(self, page: PageObject, number: int) -> None:
        """Counts page `number`'s content; `PDFContentLimitError` once the document's passes the limit, when one of
        its streams inflates past pypdf's own limit, or when its forms nest deeper than `_FORM_DEPTH`. A stream that
        cannot be decoded counts nothing: damage is judged elsewhere (`pdf_damage.page_problem`)."""
        resources = page.get("/Resources")
        contents = page.raw_get("/Contents") if "/Contents" in page else None
        target = resolved(contents)
        streams = list(target) if isinstance(target, ArrayObject) else [contents]
        try:
            for stream in streams:
                self.parsed += self._cost(stream, resources, depth=0, number=number)
        except LimitReachedError as exc:
            raise PDFContentLimitError(
                f"{self.name}: the content of page {number} inflates past pypdf's limit on one stream ({exc}); "
                "a page that large is refused, not damaged: split the PDF, or print it to a new one"
            ) from exc
        if self.parsed > self.limit:
            raise PDFContentLimitError(
                f"{self.name}: reading its text would parse more than {_size(self.limit)} of page content "
                f"(page {number} passed it): pages or forms that draw the same large content many times, or very "
                "large drawings. A PDF that heavy is refused rather than read for minutes: split the PDF, or print "
                "it to a new one (a trusted one may be read with a higher limit: load_document's content_limit, the "
                "service's INFOKV_MAX_PDF_CONTENT_BYTES)"
            )

    def _cost(self, reference: Any, resources: Any, depth: int, number: int) -> int:
        """Bytes parsed to read the stream `reference` names (with the forms it draws)."""
        if depth > _FORM_DEPTH:
            raise PDFContentLimitError(
                f"{self.name}: page {number} draws forms nested more than {_FORM_DEPTH} deep; such a PDF is refused "
                "rather than followed down: print it to a new PDF"
            )
        key = (reference.idnum, reference.generation) if isinstance(reference, IndirectObject) else None
        if key is not None and key in self._costs:
            return self._costs[key]
        if key is not None:
            self._costs[key] = 0  # a form that draws itself: pypdf skips the second draw
        stream = resolved(reference)
        cost = 0
        if isinstance(stream, StreamObject):
            try:
                data = stream.get_data()
            except LimitReachedError:
                raise
            except Exception:  # noqa: BLE001 - damage: pdf_damage names it
                data = b""
            if isinstance(data, bytes):
                cost = len(data) + self._forms_cost(data, resources, depth, number)
        if key is not None:
            self._costs[key] = cost
        return cost

    def _forms_cost(self, data: bytes, resources: Any, depth: int, number: int) -> int:
        resources = resolved(resources)
        xobjects = resolved(resources.get("/XObject")) if isinstance(resources, DictionaryObject) else None
        if not isinstance(xobjects, DictionaryObject):
            return 0
        cost = 0
        for name, draws in Counter(_FORM_DRAWN.findall(data)).items():
            key = "/" + _NAME_ESCAPE.sub(lambda m: bytes.fromhex(m[1].decode()), name).decode("latin-1")
            reference = xobjects.raw_get(key) if key in xobjects else None
            form = reference.get_object() if isinstance(reference, IndirectObject) else None
            if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form":
                own = form.get("/Resources")
                cost += draws * self._cost(reference, resources if own is None else own, depth + 1, number)
        return cost


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit:,} bytes"
