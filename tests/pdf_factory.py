"""Build small PDFs for the document-loading tests: good, encrypted, scanned, damaged."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from pypdf import PdfReader, PdfWriter
from pypdf.generic import DecodedStreamObject, NameObject
from reportlab.lib.pagesizes import A4
from reportlab.lib.utils import ImageReader
from reportlab.pdfgen import canvas


def text_pdf_bytes(pages: Sequence[str]) -> bytes:
    """A PDF with one page per string; newlines in a string start new lines."""
    buf = io.BytesIO()
    # invariant=1 drops the creation date and random ID, so equal input gives equal bytes.
    pdf = canvas.Canvas(buf, pagesize=A4, invariant=1)
    for page_text in pages:
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
