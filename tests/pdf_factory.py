"""Build small PDFs for the document-loading tests: good, encrypted, scanned, damaged."""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from pypdf import PdfReader, PdfWriter
from pypdf.annotations import FreeText
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject
from reportlab.lib.pagesizes import A4
from reportlab.lib.utils import ImageReader
from reportlab.pdfgen import canvas


def text_pdf_bytes(pages: Sequence[str], in_forms: bool = False) -> bytes:
    """A PDF with one page per string; newlines in a string start new lines. `in_forms`: each page's text is
    drawn in a form XObject of its own that the page draws (as some producers do), not in the page's content."""
    buf = io.BytesIO()
    # invariant=1 drops the creation date and random ID, so equal input gives equal bytes.
    pdf = canvas.Canvas(buf, pagesize=A4, invariant=1)
    for number, page_text in enumerate(pages, 1):
        if in_forms:
            pdf.beginForm(f"text{number}")
            _draw_lines(pdf, page_text)
            pdf.endForm()
            pdf.doForm(f"text{number}")
        else:
            _draw_lines(pdf, page_text)
        pdf.showPage()
    pdf.save()
    return buf.getvalue()


def _draw_lines(pdf: canvas.Canvas, page_text: str) -> None:
    y = A4[1] - 72
    for line in page_text.split("\n"):
        pdf.drawString(72, y, line)
        y -= 14


def text_pdf(path: Path, pages: Sequence[str]) -> Path:
    """Write a text PDF with the given page texts."""
    path.write_bytes(text_pdf_bytes(pages))
    return path


def indirect_resources_pdf(path: Path, pages: Sequence[str]) -> Path:
    """A text PDF whose pages name their /Resources, and those their /Font, by reference (as LaTeX writes them)."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(pages))))
    for page in writer.pages:
        resources = cast(DictionaryObject, page["/Resources"].get_object())
        resources[NameObject("/Font")] = writer._add_object(cast(DictionaryObject, resources["/Font"].get_object()))
        page[NameObject("/Resources")] = writer._add_object(resources)
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def encrypted_pdf(path: Path, pages: Sequence[str], user_password: str, owner_password: str | None = None) -> Path:
    """A text PDF encrypted with AES-256; `user_password=""` makes an owner-only encrypted file."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(pages))))
    writer.encrypt(user_password, owner_password=owner_password, algorithm="AES-256")
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def image_only_pdf(path: Path, n_pages: int = 2) -> Path:
    """A 'scanned' PDF: each page holds only an image, no text layer."""
    return mixed_pdf(path, [None] * n_pages)


def mixed_pdf(path: Path, pages: Sequence[str | None]) -> Path:
    """A PDF with one page per item: a string is a text page (newlines start new lines), None a page holding only
    an image of text (a scan with no text layer)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (200, 80), "white")
    # Draw something text-like into the pixels: it must not be extractable as text.
    ImageDraw.Draw(image).text((10, 30), "SCANNED TEXT", fill="black")
    buf = io.BytesIO()
    pdf = canvas.Canvas(buf, pagesize=A4, invariant=1)
    for page_text in pages:
        if page_text is None:
            pdf.drawImage(ImageReader(image), 72, 600, width=400, height=160)
        else:
            _draw_lines(pdf, page_text)
        pdf.showPage()
    pdf.save()
    path.write_bytes(buf.getvalue())
    return path


def page_labelled_pdf(path: Path, pages: Sequence[str | None], page_labels: DictionaryObject) -> Path:
    """`mixed_pdf`'s pages with `page_labels` as the catalog's /PageLabels, the number tree that gives pages their
    printed labels ("i", "ii", "1")."""
    writer = PdfWriter(clone_from=mixed_pdf(path, pages))
    writer._root_object[NameObject("/PageLabels")] = page_labels
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def truncated_pdf(path: Path, pages: Sequence[str], keep: float = 0.6) -> Path:
    """A text PDF cut after `keep` of its bytes, as an interrupted download leaves it."""
    data = text_pdf_bytes(pages)
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def corrupt_pdf(path: Path, size: int = 4096) -> Path:
    """A valid PDF header followed by garbage, ending in %%EOF so only parsing can fail."""
    garbage = bytes((i * 37 + 11) % 256 for i in range(size))
    path.write_bytes(b"%PDF-1.7\n" + garbage + b"\n%%EOF\n")
    return path


def broken_page_pdf(path: Path, pages: Sequence[str], broken: Sequence[int], kind: str = "hex") -> Path:
    """A text PDF whose pages in `broken` (1-based) get a content stream pypdf raises on.

    kind "hex": an /ASCIIHexDecode stream with non-hex bytes (pypdf raises PdfStreamError);
    kind "filter": a stream with an unknown filter (pypdf raises NotImplementedError).
    The other pages stay intact, so only the broken ones fail extraction.
    """
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(pages))))
    for number in broken:
        if kind == "hex":
            data, filter_name = b"BT /F1 12 Tf 72 700 Td (lost) Tj ET not hex at all>", "/ASCIIHexDecode"
        elif kind == "filter":
            data, filter_name = b"BT /F1 12 Tf 72 700 Td (lost) Tj ET", "/NoSuchDecode"
        else:
            raise ValueError(f"unknown kind {kind!r}")
        # A decoded stream is written out byte for byte; the /Filter entry then claims an
        # encoding those bytes do not have.
        stream = DecodedStreamObject()
        stream.set_data(data)
        stream[NameObject("/Filter")] = NameObject(filter_name)
        writer.pages[number - 1][NameObject("/Contents")] = writer._add_object(stream)
    with path.open("wb") as fh:
        writer.write(fh)
    return path


# --- byte surgery: damage as a failing disk or an interrupted transfer leaves it --------------------------------


def _object_span(data: bytes, idnum: int) -> tuple[int, int]:
    """Where indirect object `idnum` lies in `data`: from its "N 0 obj" line to just after its "endobj"."""
    match = re.search(rb"(?<![0-9])%d 0 obj\b" % idnum, data)
    assert match is not None, f"object {idnum} not found"
    end = data.index(b"endobj", match.start()) + len(b"endobj\n")
    return match.start(), end


def _page_objects(data: bytes, numbers: Sequence[int], part: str) -> list[int]:
    """The object numbers of the pages `numbers` (1-based): their page objects (`part` "page"), their content
    streams ("content"), or the form XObjects they draw ("form")."""
    reader = PdfReader(io.BytesIO(data))
    ids = []
    for number in numbers:
        page = reader.pages[number - 1]
        obj: Any
        if part == "page":
            obj = page
        elif part == "content":
            obj = page["/Contents"]
        elif part == "form":
            resources: Any = page["/Resources"]
            [obj] = resources["/XObject"].values()
            obj = obj.get_object()
        else:
            raise ValueError(f"unknown part {part!r}")
        assert obj.indirect_reference is not None
        ids.append(obj.indirect_reference.idnum)
    return ids


def damaged_content_pdf(
    path: Path, pages: Sequence[str], damaged: Sequence[int], in_forms: bool = False, fill: bytes = b"\x00"
) -> Path:
    """A text PDF whose pages in `damaged` (1-based) have the middle half of their content stream (or, with
    `in_forms`, of the form XObject holding their text) overwritten with `fill` bytes, the file keeping its
    length: its cross-reference table stays right and pypdf reads the rest as it would read an intact file.

    The streams are ASCII85-encoded Flate data. NUL (the default: a block of zeros, as a failing disk or a
    preallocated download leaves it) is white space to ASCII85, so the Flate data loses that stretch; `b"!"`
    (ASCII85 for zero bytes) zeroes that stretch of the Flate data itself; `b"v"` is no ASCII85 digit at all."""
    data = bytearray(text_pdf_bytes(pages, in_forms=in_forms))
    for idnum in _page_objects(bytes(data), damaged, "form" if in_forms else "content"):
        start, end = _object_span(bytes(data), idnum)
        body = data.index(b"stream\n", start) + len(b"stream\n")
        stop = data.rindex(b"endstream", start, end)
        quarter = (stop - body) // 4
        data[body + quarter : stop - quarter] = fill * (stop - body - 2 * quarter)
    path.write_bytes(bytes(data))
    return path


def pdf_missing_objects(path: Path, pages: Sequence[str], lost: Sequence[int], part: str = "page") -> Path:
    """A text PDF with the objects of the pages in `lost` (1-based) cut out of the file, everything else kept (its
    end too, so it is no truncation), as a transfer that dropped a chunk leaves it: `part` "page" cuts their page
    objects, "content" their content streams. The offsets in the cross-reference table are then wrong, and pypdf
    rebuilds it by scanning the file."""
    data = text_pdf_bytes(pages)
    spans = sorted(_object_span(data, idnum) for idnum in _page_objects(data, lost, part))
    for start, end in reversed(spans):
        data = data[:start] + data[end:]
    path.write_bytes(data)
    return path


def wrong_startxref_pdf(path: Path, pages: Sequence[str], off_by: int = -7) -> Path:
    """An intact text PDF whose startxref offset is off by `off_by` bytes (as files edited by careless tools
    are): pypdf has to find or rebuild the cross-reference table, and every object is still there."""
    data = text_pdf_bytes(pages)
    match = re.search(rb"startxref\s+(\d+)", data)
    assert match is not None
    offset = int(match.group(1)) + off_by
    path.write_bytes(data[: match.start(1)] + str(offset).encode() + data[match.end(1) :])
    return path


def filled_form_pdf(path: Path, turned: int = 0) -> Path:
    """A one-page order form filled in a viewer: its values are in form fields and a free-text annotation, none in
    the page's content. Labels sit left of, above, or (check boxes, radio buttons) right of their boxes; one value
    is also drawn under a caption in its box, word by word. `turned` (degrees clockwise): the page is shown turned
    (/Rotate), everything drawn turned the other way, so that it shows as the upright form (printer drivers make
    landscape pages so)."""
    shown_width, shown_height = A4
    width, height = (shown_height, shown_width) if turned % 180 else (shown_width, shown_height)

    def user(x: float, y: float) -> tuple[float, float]:  # a point of the page as shown, in the page's user space
        return {0: (x, y), 90: (width - y, x), 180: (width - x, height - y), 270: (y, height - x)}[turned % 360]

    def box(x: float, y: float, w: float, h: float) -> dict[str, float]:
        (ax, ay), (bx, by) = user(x, y), user(x + w, y + h)
        return {"x": min(ax, bx), "y": min(ay, by), "width": abs(bx - ax), "height": abs(by - ay)}

    def square(x: float, y: float, size: float) -> dict[str, float]:
        corner = box(x, y, size, size)
        return {"x": corner["x"], "y": corner["y"], "size": size}

    buf = io.BytesIO()
    pdf = canvas.Canvas(buf, pagesize=(width, height), invariant=1)
    pdf.setPageRotation(turned)
    pdf.setFont("Helvetica", 11)

    def draw(x: float, y: float, text: str) -> None:
        pdf.saveState()
        pdf.translate(*user(x, y))
        pdf.rotate(turned)
        pdf.drawString(0, 0, text)
        pdf.restoreState()

    form = pdf.acroForm
    draw(72, 760, "ORDER FORM")
    draw(72, 730, "Monthly fee:")
    form.textfield(name="fee", value="USD 7,400", **box(160, 725, 150, 18))
    draw(330, 730, "Start date:")
    form.textfield(name="start", value="1 March 2026", **box(400, 725, 120, 18))
    draw(72, 700, "Governing law")
    form.textfield(name="law", value="Delaware", **box(72, 675, 150, 18))
    form.checkbox(name="renewal", checked=True, **square(72, 640, 12))
    draw(90, 642, "Automatic renewal")
    form.checkbox(name="audit", checked=False, **square(72, 620, 12))
    draw(90, 622, "Annual audit")
    draw(72, 590, "Billing:")
    form.radio(name="billing", value="annual", selected=True, **square(130, 588, 12))
    draw(148, 590, "annual")
    form.radio(name="billing", value="monthly", selected=False, **square(210, 588, 12))
    draw(228, 590, "monthly")
    draw(72, 560, "Plan:")
    form.choice(name="plan", value="Gold", options=["Silver", "Gold"], **box(130, 555, 100, 18))
    draw(72, 530, "Reference:")
    form.textfield(name="blank", value="", **box(160, 525, 150, 18))
    form.textfield(name="terms", tooltip="Special terms", value="Net 45", **box(300, 300, 150, 18))
    draw(72, 470, "Signed:")
    draw(72, 440, "Date:")
    form.textfield(name="date1", value="2 Feb 2026", **box(120, 435, 100, 18))
    draw(300, 440, "Date:")
    form.textfield(name="date2", value="3 Feb 2026", **box(350, 435, 100, 18))
    draw(72, 410, "Seal no.:")
    draw(162, 410, "SN-4471")  # a value the producer also drew into the page
    form.textfield(name="seal", value="SN-4471", **box(160, 405, 150, 18))
    draw(76, 378, "Deposit")  # a boxed cell: its caption in the top, the value drawn below it word by word
    draw(80, 362, "EUR")
    draw(110, 362, "2,500")
    form.textfield(name="deposit", value="EUR 2,500", **box(72, 355, 200, 36))
    pdf.showPage()
    pdf.save()
    path.write_bytes(buf.getvalue())
    (x0, y0), (x1, y1) = user(130, 465), user(300, 482)
    return add_free_text(path, "Dana Whitcombe", (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)))


def form_only_pdf(path: Path) -> Path:
    """A form filled in on pages without any content text: page 1 holds a filled field and a hidden one (a form's
    working value, never shown), page 2 nothing; add a note to it with `add_free_text(..., page=1)`."""
    buf = io.BytesIO()
    pdf = canvas.Canvas(buf, pagesize=A4, invariant=1)
    pdf.acroForm.textfield(name="rent", tooltip="Monthly rent", value="EUR 1,900", x=160, y=725, width=150, height=18)
    pdf.acroForm.textfield(
        name="internal", value="USD 99999", x=160, y=700, width=150, height=18, annotationFlags="hidden"
    )
    pdf.showPage()
    pdf.showPage()
    pdf.save()
    path.write_bytes(buf.getvalue())
    return path


def add_free_text(
    path: Path, text: str, rect: tuple[float, float, float, float] = (72, 72, 300, 90), page: int = 0
) -> Path:
    """Type `text` onto the PDF's `page` (0-based) as a viewer's "fill and sign" does: a free-text annotation."""
    writer = PdfWriter(clone_from=PdfReader(path))
    writer.add_annotation(page, FreeText(text=text, rect=rect))
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def heavy_content_pdf(path: Path, pages: int, padding: int, *, form_draws: int = 0) -> Path:
    """A PDF of `pages` pages whose text is followed by `padding` bytes of spaces in one compressed stream that every
    page shares as its content (a bomb of a few kilobytes: each page parses it again); with `form_draws`, the stream
    is a form that one page draws that many times instead."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(["The notice period is thirty days."]))))
    template = writer.pages[0]
    text = cast(Any, template.get_contents()).get_data()
    heavy = DecodedStreamObject()
    heavy.set_data(text + b" " * padding)
    if form_draws:
        heavy.update({NameObject("/Type"): NameObject("/XObject"), NameObject("/Subtype"): NameObject("/Form")})
        heavy[NameObject("/BBox")] = cast(Any, template.mediabox)
        heavy[NameObject("/Resources")] = template["/Resources"]
        resources = cast(DictionaryObject, template["/Resources"].get_object())
        resources[NameObject("/XObject")] = DictionaryObject({NameObject("/Heavy"): writer._add_object(heavy)})
        drawing = DecodedStreamObject()
        drawing.set_data(b"/Heavy Do\n" * form_draws)
        template[NameObject("/Contents")] = writer._add_object(drawing)
    else:
        template[NameObject("/Contents")] = writer._add_object(heavy)
        for _ in range(pages - 1):
            writer.add_page(template)
    for page in writer.pages:
        page.compress_content_streams()
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def figure_pages_pdf(path: Path, pages: int, size: int) -> Path:
    """A text page, then `pages` pages sharing one compressed stream of `size` bytes of line drawing (no text)."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(["The notice period is thirty days."]))))
    line = b"10 10 m 20 20 l S\n"
    drawing = DecodedStreamObject()
    drawing.set_data(line * (size // len(line)))
    shared = writer._add_object(drawing)
    for _ in range(pages):
        writer.add_blank_page(612, 792)[NameObject("/Contents")] = shared
    for page in writer.pages:
        page.compress_content_streams()
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def nested_forms_pdf(path: Path, depth: int, padding: int, direct_draws: int) -> Path:
    """One page drawing form C1, which draws C2, ... C`depth`, which draws /Heavy (text and `padding` spaces); the
    page also draws /Heavy itself `direct_draws` times."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf_bytes(["The notice period is thirty days."]))))
    page = writer.pages[0]
    resources = cast(DictionaryObject, page["/Resources"].get_object())
    xobjects = DictionaryObject()
    resources[NameObject("/XObject")] = xobjects

    def form(data: bytes) -> Any:
        stream = DecodedStreamObject()
        stream.set_data(data)
        stream.update({NameObject("/Type"): NameObject("/XObject"), NameObject("/Subtype"): NameObject("/Form")})
        stream[NameObject("/BBox")] = cast(Any, page.mediabox)
        stream[NameObject("/Resources")] = page.raw_get("/Resources")
        return writer._add_object(stream)

    xobjects[NameObject("/Heavy")] = form(cast(Any, page.get_contents()).get_data() + b" " * padding)
    for level in range(depth, 0, -1):
        drawn = "/Heavy" if level == depth else f"/C{level + 1}"
        xobjects[NameObject(f"/C{level}")] = form(drawn.encode() + b" Do\n")
    drawing = DecodedStreamObject()
    drawing.set_data(b"/C1 Do\n" + b"/Heavy Do\n" * direct_draws)
    page[NameObject("/Contents")] = writer._add_object(drawing)
    with path.open("wb") as fh:
        writer.write(fh)
    return path
