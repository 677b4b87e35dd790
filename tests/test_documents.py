"""Document loading: page map, text decoding, and a typed, actionable error for each bad input."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pypdf
import pytest
from pypdf.errors import DependencyError
from pypdf.generic import ArrayObject, DictionaryObject, NameObject, NumberObject, TextStringObject

from infokv_rag.citations import supporting_pages
from infokv_rag.documents import (
    PAGE_SEPARATOR,
    Document,
    GarbledTextWarning,
    Page,
    PageExtractionWarning,
    StrayBytesWarning,
    document_from_pages,
    document_from_text,
    is_blank,
    join_broken_words,
    load_document,
)
from infokv_rag.errors import (
    ConfigError,
    CorruptPDFError,
    DocumentError,
    EmptyDocumentError,
    EncryptedPDFError,
    NoExtractableTextError,
    PDFContentLimitError,
    UnsupportedFormatError,
)
from infokv_rag.pdf_limits import ContentMeter

from . import pdf_factory as pdfs

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DIR = ROOT / "examples" / "sample"

PAGES = ["Alpha page one.\nThe notice period is   thirty   days.", "Beta page two.", "Gamma page three."]


def _refusal(error: type[DocumentError], path: Path, **kwargs: object) -> str:
    """The message of the `error` that loading `path` must raise."""
    with pytest.raises(error) as info:
        load_document(path, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def _load_quietly(path: Path, **kwargs: object) -> Document:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unexpected warning fails the test
        return load_document(path, **kwargs)  # type: ignore[arg-type]


# --- good PDFs ---------------------------------------------------------------------------------


def test_pdf_pages_numbers_and_page_of(tmp_path: Path) -> None:
    path = pdfs.text_pdf(tmp_path / "contract.pdf", PAGES)
    doc = _load_quietly(path)
    assert [p.number for p in doc.pages] == [1, 2, 3]
    assert doc.skipped_pages == ()
    assert doc.source == str(path)
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert doc.text == PAGE_SEPARATOR.join(p.text for p in doc.pages)
    # Runs of spaces collapse, line breaks stay.
    assert doc.pages[0].text == "Alpha page one.\nThe notice period is thirty days."
    for page, (start, end) in zip(doc.pages, doc.page_spans, strict=True):
        assert doc.text[start:end] == page.text
        assert doc.page_of(start) == page.number
        assert doc.page_of(end - 1) == page.number
    assert doc.page_of(doc.text.index("thirty")) == 1
    assert doc.page_of(doc.text.index("Beta")) == 2
    assert doc.page_of(doc.text.index("Gamma")) == 3
    # The separator after a page belongs to that page; len(text) maps to the last page.
    assert doc.page_of(doc.page_spans[0][1]) == 1
    assert doc.page_of(len(doc.text)) == 3
    with pytest.raises(IndexError):
        doc.page_of(len(doc.text) + 1)
    with pytest.raises(IndexError):
        doc.page_of(-1)


def test_blank_pdf_page_keeps_real_page_numbers(tmp_path: Path) -> None:
    doc = _load_quietly(pdfs.text_pdf(tmp_path / "gap.pdf", ["first", "", "third"]))
    assert [p.number for p in doc.pages] == [1, 3]
    assert doc.page_of(doc.text.index("third")) == 3
    assert doc.skipped_pages == ()


def test_pdf_is_sniffed_whatever_its_suffix(tmp_path: Path) -> None:
    path = tmp_path / "download.bin"
    path.write_bytes(pdfs.text_pdf_bytes(["Sniffed as a PDF."]))
    assert _load_quietly(path).text == "Sniffed as a PDF."


@pytest.mark.parametrize("padding", [b"\r\n", b"\n\n \t", b"\x00\x00", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n"])
@pytest.mark.parametrize("name", ["download", "download.txt"])
def test_a_pdf_header_after_whitespace_nuls_or_a_bom_is_sniffed_whatever_its_suffix(
    tmp_path: Path, padding: bytes, name: str
) -> None:
    path = tmp_path / name
    path.write_bytes(padding + pdfs.text_pdf_bytes(["Sniffed as a PDF."]))
    doc = _load_quietly(path)
    assert doc.text == "Sniffed as a PDF."
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_pdf_header_after_junk_only_counts_for_pdf_suffix(tmp_path: Path) -> None:
    data = b"junk from a mail gateway\n" + pdfs.text_pdf_bytes(["Behind junk."])
    (tmp_path / "mail.pdf").write_bytes(data)
    assert _load_quietly(tmp_path / "mail.pdf").text == "Behind junk."
    note = tmp_path / "note.md"
    note.write_text("# PDF internals\n\nEvery PDF starts with `%PDF-1.7`.\n", encoding="utf-8")
    assert "%PDF-1.7" in _load_quietly(note).text


def test_sample_pdf_holds_the_whole_license() -> None:
    pdf, txt = SAMPLE_DIR / "apache-license-2.0.pdf", SAMPLE_DIR / "apache-license-2.0.txt"
    if not pdf.exists():
        pytest.skip("sample PDF not generated")
    assert pdf.stat().st_size < 200_000
    doc = _load_quietly(pdf)
    assert len(doc.pages) >= 3
    # Same words in the same order as the unmodified license text.
    assert doc.text.split() == txt.read_text(encoding="utf-8").split()
    for heading in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional Liability."):
        assert heading in doc.text
    assert doc.page_of(doc.text.index("January 2004")) == 1


# --- encrypted PDFs ----------------------------------------------------------------------------


def test_encrypted_pdf_without_password(tmp_path: Path) -> None:
    path = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, user_password="s3cret")
    message = _refusal(EncryptedPDFError, path)
    assert "locked.pdf" in message and "password=" in message and "--password" in message


def test_encrypted_pdf_wrong_password(tmp_path: Path) -> None:
    path = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, user_password="s3cret")
    message = _refusal(EncryptedPDFError, path, password="guess")
    assert "Wrong password" in message and "locked.pdf" in message and "--password" in message


def test_aes256_pdf_opens_with_password(tmp_path: Path) -> None:
    path = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, user_password="s3cret", owner_password="owner")
    assert "/AESV3" in str(pypdf.PdfReader(path).trailer["/Encrypt"].get_object())  # really AES-256
    doc = _load_quietly(path, password="s3cret")
    assert [p.number for p in doc.pages] == [1, 2, 3] and "Beta page two." in doc.text
    assert _load_quietly(path, password="owner").text == doc.text  # the owner password opens it too


def test_owner_only_encryption_opens_without_password(tmp_path: Path) -> None:
    path = pdfs.encrypted_pdf(tmp_path / "restricted.pdf", ["Readable."], user_password="", owner_password="o")
    assert _load_quietly(path).text == "Readable."
    # Whatever password a batch passes to every file: one that needs none opens as it would without it.
    assert _load_quietly(path, password="batch-password").text == "Readable."


def test_password_is_ignored_for_unencrypted_pdf_and_text(tmp_path: Path) -> None:
    assert _load_quietly(pdfs.text_pdf(tmp_path / "a.pdf", ["open"]), password="x").text == "open"
    (tmp_path / "a.txt").write_text("plain", encoding="utf-8")
    assert _load_quietly(tmp_path / "a.txt", password="x").text == "plain"


def test_missing_crypto_dependency_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, user_password="s3cret")

    def no_crypto(*args: object, **kwargs: object) -> None:
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf._encryption.Encryption, "verify", no_crypto)
    message = _refusal(EncryptedPDFError, path, password="s3cret")
    assert "pypdf[crypto]" in message and "locked.pdf" in message


# --- scanned, damaged and partly broken PDFs ----------------------------------------------------


def test_pages_holding_only_filled_in_values_are_read(tmp_path: Path) -> None:
    """A form filled in on a blank page and a note typed onto an empty one are the pages' text (not a scan to refuse
    or a blank page to drop); a hidden field's value, which no viewer shows, is not."""
    path = pdfs.add_free_text(pdfs.form_only_pdf(tmp_path / "form.pdf"), "Addendum: rent from 1 May 2026", page=1)
    document = load_document(path)
    assert [(page.number, page.text) for page in document.pages] == [
        (1, "Monthly rent: EUR 1,900"),
        (2, "note: Addendum: rent from 1 May 2026"),
    ]
    assert document.skipped_pages == ()


@pytest.mark.parametrize("signed", [False, True])
def test_image_only_pdf_needs_ocr(tmp_path: Path, signed: bool) -> None:
    path = pdfs.image_only_pdf(tmp_path / "scan.pdf", n_pages=2)
    if signed:  # a scan typed on with a viewer's "fill and sign": its notes are no text layer
        pdfs.add_free_text(path, "Dana Whitcombe")
    message = _refusal(NoExtractableTextError, path)
    assert "scan.pdf" in message and "OCR" in message and "ocrmypdf" in message and "2 page" in message


def test_a_command_a_refusal_suggests_names_the_file_as_one_word_of_a_shell(tmp_path: Path) -> None:
    """A path pasted into a suggested command as it is named split at its spaces ("Vertrag 2024.pdf" named two other
    files), and a name holding a ";" ran what followed it."""
    data = pdfs.text_pdf_bytes(PAGES)
    five = [f"Page {n}: the notice period in clause {n} is {n * 10} days." for n in range(1, 6)]
    for name in ("Vertrag 2024.pdf", "a;id;.pdf"):
        cut = tmp_path / name
        cut.write_bytes(data[: len(data) * 2 // 3])
        scan = pdfs.image_only_pdf(tmp_path / f"Scan {name}")
        damaged = pdfs.damaged_content_pdf(tmp_path / f"Damaged {name}", five, damaged=[2, 4], fill=b"\x00")
        missing = pdfs.pdf_missing_objects(tmp_path / f"Missing {name}", five, lost=[2, 3], part="page")
        refused = ((CorruptPDFError, cut), (NoExtractableTextError, scan), (CorruptPDFError, damaged))
        for error, path in (*refused, (CorruptPDFError, missing)):
            commands = re.findall(r"`([^`]+)`", _refusal(error, path))
            assert commands, path
            for command in commands:
                assert str(path) in shlex.split(command), command


def test_a_pdf_cut_inside_an_appended_update_is_truncated_not_its_older_revision(tmp_path: Path) -> None:
    """A page added, a form filled or a signature is saved as an update after the file's first %%EOF: cut short
    inside it, the file still ends near that %%EOF, and was read silently as the revision before the update."""
    original = pdfs.text_pdf_bytes(["Original page one."])
    writer = pypdf.PdfWriter(io.BytesIO(original), incremental=True)
    added = pypdf.PdfReader(io.BytesIO(pdfs.text_pdf_bytes(["Added page two: the fee is USD 9,900."])))
    writer.add_page(added.pages[0])
    updated = io.BytesIO()
    writer.write(updated)
    whole = tmp_path / "updated.pdf"
    whole.write_bytes(updated.getvalue())
    assert "USD 9,900" in _load_quietly(whole).text
    for kept in (100, 400, 800):
        cut = tmp_path / f"cut-{kept}.pdf"
        cut.write_bytes(updated.getvalue()[: len(original) + kept])
        assert "truncated" in _refusal(CorruptPDFError, cut)
    # Junk after the last %%EOF that is no update (a server's error page, a comment) is read past, as viewers do.
    for junk in (b"\n<html>Upload stream interrupted; see xref</html>\n", b"\n%startxref is above\n"):
        whole.write_bytes(original + junk)
        assert _load_quietly(whole).text == "Original page one."


def test_a_glyph_mapped_to_half_a_surrogate_pair_is_no_text_that_cannot_be_encoded(tmp_path: Path) -> None:
    """A font's ToUnicode map may send a glyph to half of a UTF-16 surrogate pair: the page reads as unreadable
    text, never as a lone surrogate in `Document.text` (which no tokenizer or UTF-8 writer takes)."""
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdfs.text_pdf_bytes(["ABC rent is 500"]))))
    cmap = pypdf.generic.DecodedStreamObject()
    cmap.set_data(
        b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /Broken def\n"
        b"1 begincodespacerange <00> <FF> endcodespacerange\n2 beginbfchar\n<41> <D835>\n<42> <D835DC00>\n"
        b"endbfchar\nendcmap CMapName currentdict /CMap defineresource pop end end"
    )
    fonts: Any = writer.pages[0]["/Resources"]["/Font"]  # type: ignore[index]
    for key in fonts:
        fonts[key].get_object()[NameObject("/ToUnicode")] = writer._add_object(cmap)
    path = tmp_path / "broken-cmap.pdf"
    writer.write(path)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        text = load_document(path).text
    assert "rent is 500" in text and "\ufffd" in text and text.encode("utf-8"), text


def test_a_pdf_of_blank_pages_is_empty_not_scanned(tmp_path: Path) -> None:
    """Pages that draw nothing are blank, not a scan to OCR; pages that draw what reads as no text (text as
    outlines) still need OCR."""
    writer = pypdf.PdfWriter()
    for _ in range(2):
        writer.add_blank_page(612, 792)
    writer.write(tmp_path / "blank.pdf")
    message = _refusal(EmptyDocumentError, tmp_path / "blank.pdf")
    assert "2 page(s) are blank" in message and "OCR" not in message, message
    outlined = pypdf.PdfWriter()
    page = outlined.add_blank_page(612, 792)
    strokes = pypdf.generic.DecodedStreamObject()
    strokes.set_data(b"10 10 m 100 100 l 100 10 l h f")  # a glyph drawn as a filled path
    page[NameObject("/Contents")] = outlined._add_object(strokes)
    outlined.write(tmp_path / "outlined.pdf")
    assert "OCR" in _refusal(NoExtractableTextError, tmp_path / "outlined.pdf")


def test_truncated_pdf(tmp_path: Path) -> None:
    path = pdfs.truncated_pdf(tmp_path / "cut.pdf", PAGES, keep=0.6)
    message = _refusal(CorruptPDFError, path)
    assert "cut.pdf" in message and "truncated" in message and "again" in message


def test_a_whole_pdf_followed_by_padding_is_read(tmp_path: Path) -> None:
    """NULs or whitespace after a whole PDF (a transfer's or a disk image's padding) hide no truncation: the %%EOF is
    looked for before them. A file cut short and then padded is still refused."""
    data = pdfs.text_pdf_bytes(PAGES)
    expected = load_document(pdfs.text_pdf(tmp_path / "plain.pdf", PAGES)).text
    path = tmp_path / "padded.pdf"
    for padding in (b"\x00" * 5000, b"\n" * 3000, b"\x00" * 70_000):
        path.write_bytes(data + padding)
        assert _load_quietly(path).text == expected
    path.write_bytes(data[: len(data) // 2] + b"\x00" * 5000)
    assert "truncated" in _refusal(CorruptPDFError, path)


def test_bytes_appended_after_a_whole_pdf_are_named_not_called_a_cut(tmp_path: Path) -> None:
    """Viewers read past 1 KB after %%EOF, and so does the loader; more (a mail gateway's 2 KB banner) is refused,
    saying what follows the marker and how to trim it, where it said the download was cut short."""
    data = pdfs.text_pdf_bytes(PAGES)
    path = tmp_path / "mailed.pdf"
    path.write_bytes(data + b"<html>scanned by a gateway</html>\n" * 10)
    assert _load_quietly(path).text == load_document(pdfs.text_pdf(tmp_path / "plain.pdf", PAGES)).text
    banner = b"<html>scanned by a gateway</html>\n" * 60
    path.write_bytes(data + banner)
    message = _refusal(CorruptPDFError, path)
    assert f"{len(banner)} bytes that are no part of a PDF follow its last %%EOF" in message
    assert f"head -c {len(data)} " in message and "truncated" not in message


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.9, 0.99])
def test_pdf_cut_anywhere_is_refused(tmp_path: Path, keep: float) -> None:
    with pytest.raises(CorruptPDFError):
        load_document(pdfs.truncated_pdf(tmp_path / "cut.pdf", PAGES, keep=keep))


def test_truncated_pdf_with_eof_marker_appended_still_fails_in_pypdf(tmp_path: Path) -> None:
    # The %%EOF check cannot see this one: pypdf's own parse has to catch it.
    data = pdfs.text_pdf_bytes(PAGES)
    path = tmp_path / "patched.pdf"
    path.write_bytes(data[: len(data) // 2] + b"\n%%EOF\n")
    message = _refusal(CorruptPDFError, path)
    assert "patched.pdf" in message and "repair" in message


def test_corrupt_pdf(tmp_path: Path) -> None:
    path = pdfs.corrupt_pdf(tmp_path / "garbage.pdf")
    message = _refusal(CorruptPDFError, path)
    assert "garbage.pdf" in message and "damaged" in message and "qpdf" in message


@pytest.mark.parametrize(
    ("pages", "padding", "form_draws", "where"),
    [(20, 1_000_000, 0, "page 17"), (1, 100_000, 200, "page 1"), (1, 80_000_000, 0, "pypdf's limit on one stream")],
)
def test_content_drawn_past_the_limit_is_refused_before_it_is_parsed(
    tmp_path: Path, pages: int, padding: int, form_draws: int, where: str
) -> None:
    """A few kilobytes of PDF whose pages share one stream of a megabyte (each page parses it again), or one page
    drawing a form of 100 KB 200 times, came to 20 MB of content to parse: read for seconds here, for hours at a
    thousand pages of 70 MB. Refused once the pages read pass 16 MiB, before the page that passes it is parsed; a
    stream inflating past pypdf's own limit is refused as too large, where it was called damaged."""
    path = pdfs.heavy_content_pdf(tmp_path / "heavy.pdf", pages, padding, form_draws=form_draws)
    assert path.stat().st_size < 200_000
    message = _refusal(PDFContentLimitError, path)
    assert "heavy.pdf" in message and where in message and "split the PDF" in message


def test_the_content_limit_is_the_callers_to_set(tmp_path: Path) -> None:
    """A trusted manual of many large drawings can be read past the default limit, and a service can lower it; a
    limit that is not a positive count of bytes is refused before the file is read."""
    path = pdfs.heavy_content_pdf(tmp_path / "heavy.pdf", 3, 1_000_000)  # 3 MB of content to parse
    assert len(load_document(path).pages) == 3
    message = _refusal(PDFContentLimitError, path, content_limit=1_500_000)
    assert "1,500,000 bytes" in message and "page 2 passed it" in message and "content_limit" in message
    assert len(load_document(path, content_limit=3_100_000).pages) == 3
    for wrong in (0, -5, 2.5, True, "16"):
        with pytest.raises(ConfigError, match="content_limit must be a positive number of bytes"):
            load_document(path, content_limit=wrong)  # type: ignore[arg-type]


def test_the_meter_counts_figures_and_forms_drawn_at_any_depth(tmp_path: Path) -> None:
    """A page without text is parsed too (twice: a page that reads as blank is checked for images and for a failed
    extraction), and a form reached first below the depth the meter once followed (8) was then counted as nothing
    wherever else it was drawn: both let a few kilobytes parse for minutes uncounted."""
    figures = pdfs.figure_pages_pdf(tmp_path / "figures.pdf", 2, 2**20)
    meter = ContentMeter("figures.pdf", limit=3 * 2**19)
    reader = pypdf.PdfReader(figures)
    meter.charge(reader.pages[0], 1)
    meter.charge(reader.pages[1], 2)
    assert meter.parsed > 2**20
    with pytest.raises(PDFContentLimitError, match="page 3 passed it"):
        meter.charge(reader.pages[2], 3)
    nested = pypdf.PdfReader(pdfs.nested_forms_pdf(tmp_path / "nested.pdf", 9, 100_000, 20))
    meter = ContentMeter("nested.pdf")
    meter.charge(nested.pages[0], 1)
    assert meter.parsed > 21 * 100_000  # /Heavy once through the chain and 20 times directly
    deep = pdfs.nested_forms_pdf(tmp_path / "deep.pdf", 70, 10, 0)
    assert "forms nested more than 64 deep" in _refusal(PDFContentLimitError, deep)


def test_pdf_without_pages_is_empty(tmp_path: Path) -> None:
    buf = io.BytesIO()
    pypdf.PdfWriter().write(buf)
    path = tmp_path / "nopages.pdf"
    path.write_bytes(buf.getvalue())
    with pytest.raises(EmptyDocumentError, match="nopages.pdf is a PDF with no pages"):
        load_document(path)


@pytest.mark.parametrize("kind", ["hex", "filter"])
def test_page_that_fails_alone_is_skipped_with_warning(tmp_path: Path, kind: str) -> None:
    path = pdfs.broken_page_pdf(tmp_path / "partly.pdf", PAGES + ["Delta page four."], broken=[2, 4], kind=kind)
    with pytest.warns(PageExtractionWarning) as record:
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [1, 3]
    assert doc.skipped_pages == (2, 4)
    assert "Beta" not in doc.text and "Gamma page three." in doc.text
    assert doc.page_of(doc.text.index("Gamma")) == 3
    [warning] = record.list
    assert warning.filename == __file__  # points at the caller, not at documents.py
    assert isinstance(warning.message, PageExtractionWarning) and warning.message.pages == (2, 4)
    assert "partly.pdf" in str(warning.message) and "pages 2, 4 of 4" in str(warning.message)


def test_an_image_only_page_among_text_pages_is_reported(tmp_path: Path) -> None:
    # A scanned page (an image, no text layer) in a PDF that otherwise has text: skipped, listed and warned about.
    path = pdfs.mixed_pdf(tmp_path / "signed.pdf", [PAGES[0], None, PAGES[2], None])
    with pytest.warns(PageExtractionWarning) as record:
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [1, 3] and doc.skipped_pages == (2, 4)
    [warning] = record.list
    assert warning.filename == __file__
    assert isinstance(warning.message, PageExtractionWarning) and warning.message.pages == (2, 4)
    message = str(warning.message)
    assert "signed.pdf" in message and "pages 2, 4 of 4" in message and "OCR" in message and "ocrmypdf" in message
    assert doc.load_warnings == (message,)


def _page_labels(*ranges: tuple[int, dict[str, Any]]) -> DictionaryObject:
    """A /PageLabels number tree: each range's first page index and its label dictionary (/S style, /P prefix,
    /St start)."""
    nums: list[Any] = []
    for first, spec in ranges:
        nums += [NumberObject(first), DictionaryObject({NameObject(key): value for key, value in spec.items()})]
    return DictionaryObject({NameObject("/Nums"): ArrayObject(nums)})


def test_a_pdfs_page_labels_name_its_pages_in_citations(tmp_path: Path) -> None:
    # Front matter i-iii (ii scanned, iii blank), then 1, then an annex A-1, then a page whose label is its number.
    labels = _page_labels(
        (0, {"/S": NameObject("/r")}),
        (3, {"/S": NameObject("/D")}),
        (4, {"/S": NameObject("/D"), "/P": TextStringObject("A-")}),
        (5, {"/S": NameObject("/D"), "/St": NumberObject(6)}),
    )
    texts = ["Preface.", None, "", "The notice period is ninety days.", "Annex one.", "Last page."]
    path = pdfs.page_labelled_pdf(tmp_path / "labelled.pdf", texts, labels)
    with pytest.warns(PageExtractionWarning):
        doc = load_document(path)
    assert [(p.number, p.label, p.cited_as) for p in doc.pages] == [
        (1, "i", "i"),
        (4, "1", "1"),
        (5, "A-1", "A-1"),
        (6, None, "6"),
    ]
    assert doc.skipped_pages == (2,)  # skipped and blank pages are numbers in the file; the labels after them hold
    assert Document.from_layout(doc.text, doc.layout()) == doc
    [(index, _)] = supporting_pages(doc, "ninety days")
    assert doc.pages[index].cited_as == "1"


def test_pages_that_would_be_cited_alike_are_told_apart(tmp_path: Path) -> None:
    """An unlabelled cover (an empty label: cited by its number, 1) before a body labelled from 1, and a second
    chapter labelled from 1 again: two pages each were cited as "1" (and "2"), so an answer from the cover cited the
    body's first page."""
    labels = _page_labels(
        (0, {"/P": TextStringObject("")}), (1, {"/S": NameObject("/D")}), (3, {"/S": NameObject("/D")})
    )
    texts = ["Cover: a five-year term.", "Disconnect power first.", "Then wait.", "Chapter two.", "The end."]
    doc = _load_quietly(pdfs.page_labelled_pdf(tmp_path / "manual.pdf", texts, labels))
    assert [p.cited_as for p in doc.pages] == [
        "1 (file page 1)",
        "1 (file page 2)",
        "2 (file page 3)",
        "1 (file page 4)",
        "2 (file page 5)",
    ]
    [(index, _)] = supporting_pages(doc, "five-year term")
    assert doc.pages[index].cited_as == "1 (file page 1)"


def test_a_malformed_page_label_tree_costs_only_the_labels(tmp_path: Path) -> None:
    labels = _page_labels((0, {"/P": ArrayObject([NumberObject(1)])}))
    path = pdfs.page_labelled_pdf(tmp_path / "badlabels.pdf", PAGES, labels)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the premise: pypdf cannot read this label tree
        pypdf.PdfReader(path).page_labels  # noqa: B018
    doc = _load_quietly(path)
    assert [(p.number, p.label) for p in doc.pages] == [(1, None), (2, None), (3, None)]


def test_resources_named_by_reference_hold_their_fonts(tmp_path: Path) -> None:
    """A page that shows only a space reads as blank, not as text in a font the page lacks, also where /Resources
    and /Font are references (pypdf's `get` does not follow them)."""
    path = pdfs.indirect_resources_pdf(tmp_path / "latex.pdf", [" ", PAGES[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [2] and doc.skipped_pages == () and doc.load_warnings == ()
    blank = pdfs.indirect_resources_pdf(tmp_path / "blank.pdf", [" "])
    _refusal(NoExtractableTextError, blank)  # not "damaged"


def test_every_page_failing_is_a_corrupt_pdf(tmp_path: Path) -> None:
    path = pdfs.broken_page_pdf(tmp_path / "allbad.pdf", ["one", "two"], broken=[1, 2])
    message = _refusal(CorruptPDFError, path)
    assert "allbad.pdf" in message and "pages 1-2" in message


def test_pypdf_log_noise_is_not_printed(tmp_path: Path) -> None:
    # pypdf logs what it works around (here a wrong startxref offset, and a Flate stream that is garbage). Without
    # a handler, Python would print those records to stderr; loading, or refusing, must stay silent.
    from pypdf.generic import DecodedStreamObject, NameObject

    pdfs.wrong_startxref_pdf(tmp_path / "offset.pdf", ["ok"])
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdfs.text_pdf_bytes(["ok", "x"]))))
    stream = DecodedStreamObject()
    stream.set_data(b"not zlib at all " * 4)
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    writer.pages[1][NameObject("/Contents")] = writer._add_object(stream)
    path = tmp_path / "noisy.pdf"
    with path.open("wb") as fh:
        writer.write(fh)
    code = (
        "import sys, warnings; warnings.simplefilter('error');"
        "from infokv_rag.documents import load_document;"
        "from infokv_rag.errors import CorruptPDFError;"
        f"print(load_document({str(tmp_path / 'offset.pdf')!r}).text)\n"
        f"try: load_document({str(path)!r})\n"
        "except CorruptPDFError as exc: print(type(exc).__name__, 'page 2' in str(exc))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["ok", "CorruptPDFError True"]
    assert result.stderr == ""


# --- damaged copies: pages whose text is lost are named, never loaded as a shorter document ------------------

FIVE = [f"Page {n}: the notice period in clause {n} is {n * 10} days." for n in range(1, 6)]


@pytest.mark.parametrize("fill", [b"\x00", b"!"], ids=["stretch-lost", "stretch-zeroed"])
def test_a_page_whose_compressed_content_is_damaged_refuses_the_file(tmp_path: Path, fill: bytes) -> None:
    # Same length, cross-reference table intact: pypdf would read pages 2 and 4 as blank (or their text up to the
    # damage) without raising, and the document would load as pages 1, 3, 5.
    path = pdfs.damaged_content_pdf(tmp_path / "contract.pdf", FIVE, damaged=[2, 4], fill=fill)
    message = _refusal(CorruptPDFError, path)
    assert message.startswith(f"{path} is damaged: the content of page")
    assert "does not decode (Error -3 while decompressing data: " in message
    assert "not in this copy" in message and "Download or export it again" in message
    # A way to go on knowingly: a copy without the damaged pages (so both were found).
    assert f"qpdf {path} --pages . 1,3,5 -- {tmp_path / 'contract-rest.pdf'}" in message


def test_a_form_drawn_by_a_page_is_checked_too(tmp_path: Path) -> None:
    # Its compressed data damaged: the file is refused, as for the page's own content.
    path = pdfs.damaged_content_pdf(tmp_path / "forms.pdf", FIVE, damaged=[3], in_forms=True, fill=b"!")
    message = _refusal(CorruptPDFError, path)
    assert "the content of page 3 draws a form that does not decode (Error -3 " in message
    # A form pypdf cannot decode otherwise (here its ASCII85 layer): pypdf drops the form's text and logs it only;
    # the page is skipped and reported, as a page whose own content fails to extract is.
    path = pdfs.damaged_content_pdf(tmp_path / "ascii85.pdf", FIVE, damaged=[3], in_forms=True, fill=b"v")
    with pytest.warns(PageExtractionWarning, match="skipped page 3 of 5: text extraction failed") as record:
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [1, 2, 4, 5] and doc.skipped_pages == (3,)
    assert "draws a form that cannot be decoded" in str(record.list[0].message)


def test_a_pdf_whose_page_objects_are_missing_is_refused_naming_them(tmp_path: Path) -> None:
    # A chunk of the file lost with pages 2 and 3 in it, its end kept (so no truncation): pypdf rebuilds the
    # cross-reference table, drops the two pages from its page list and numbers the rest 1-3.
    path = pdfs.pdf_missing_objects(tmp_path / "lease.pdf", FIVE, lost=[2, 3], part="page")
    message = _refusal(CorruptPDFError, path)
    assert "lease.pdf is damaged: its page tree lists 5 pages but pages 2-3 cannot be found." in message
    assert "Download or export it again" in message and f"qpdf {path} repaired.pdf" in message


def test_a_pdf_whose_page_content_objects_are_missing_is_refused(tmp_path: Path) -> None:
    # The pages are there but the streams holding their text are not: pypdf reads them as blank pages.
    path = pdfs.pdf_missing_objects(tmp_path / "lease.pdf", FIVE, lost=[2, 3], part="content")
    message = _refusal(CorruptPDFError, path)
    assert "the content of pages 2-3 cannot be found (the object holding it is missing or damaged)" in message
    assert "--pages . 1,4-5 --" in message


def test_the_reported_damaged_copies_are_refused(tmp_path: Path) -> None:
    # The two files of the report: one page's compressed content zeroed in place (same length), and a chunk cut
    # from the middle of the file with its end kept. Both loaded silently as 4 and 3 pages of 5.
    data = pdfs.text_pdf_bytes([f"Page {n}: the notice period on page {n} is {n * 10} days. " * 5 for n in range(1, 6)])
    third = [i for i in range(len(data)) if data.startswith(b"stream\n", i)][2] + len(b"stream\n")
    (tmp_path / "zeroed.pdf").write_bytes(data[: third + 10] + b"\x00" * 100 + data[third + 110 :])
    (tmp_path / "cut.pdf").write_bytes(data[: len(data) // 2] + data[-1500:])
    assert "the content of page 2 does not decode" in _refusal(CorruptPDFError, tmp_path / "zeroed.pdf")
    assert "the content of pages 1-2 cannot be found" in _refusal(CorruptPDFError, tmp_path / "cut.pdf")


def test_a_page_tree_promising_more_pages_than_it_holds_is_refused(tmp_path: Path) -> None:
    data = pdfs.text_pdf_bytes(PAGES)
    assert data.count(b"/Count 3") == 1
    (tmp_path / "count.pdf").write_bytes(data.replace(b"/Count 3", b"/Count 9"))
    message = _refusal(CorruptPDFError, tmp_path / "count.pdf")
    assert "count.pdf is damaged: its page tree lists 9 pages but only 3 can be found." in message


def test_a_rebuilt_cross_reference_table_alone_is_no_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Many real PDFs have a slightly wrong startxref offset: pypdf finds or rebuilds the table, every page is
    # there and decodes, and the file loads as the intact one does, without a warning.
    intact = _load_quietly(pdfs.text_pdf(tmp_path / "intact.pdf", FIVE))
    for off_by in (-7, 40):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pypdf"):
            doc = _load_quietly(pdfs.wrong_startxref_pdf(tmp_path / f"offset{off_by}.pdf", FIVE, off_by=off_by))
        assert "incorrect startxref pointer" in caplog.text  # pypdf did have to repair it
        assert doc.text == intact.text and doc.pages == intact.pages and doc.skipped_pages == ()
    # The same repair in a file that lost a page is no excuse: that one is refused.
    lost = pdfs.pdf_missing_objects(tmp_path / "lost.pdf", FIVE, lost=[4])
    assert "its page tree lists 5 pages but page 4 cannot be found" in _refusal(CorruptPDFError, lost)


def _with_page_two(path: Path, change: Callable[[pypdf.PageObject], None]) -> Path:
    """`path`: a three-page PDF of `PAGES` whose second page `change` altered."""
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdfs.text_pdf_bytes(PAGES))))
    change(writer.pages[1])
    with path.open("wb") as fh:
        writer.write(fh)
    return path


def _lose_resources(page: pypdf.PageObject) -> None:
    del page[NameObject("/Resources")]


def _lose_fonts(page: pypdf.PageObject) -> None:
    resources = page["/Resources"].get_object()
    assert isinstance(resources, DictionaryObject)
    del resources[NameObject("/Font")]


def _cut_content(page: pypdf.PageObject) -> None:
    content = page.get_contents()
    assert content is not None
    data = content.get_data()
    content.set_data(data[: data.index(PAGES[1].split()[1].encode())])  # ends inside the string it shows
    page.replace_contents(content)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_lose_resources, "drawn in font /F1, which it does not hold"),  # pypdf reads it as nothing
        (_lose_fonts, "drawn in font /F1, which it does not hold"),  # pypdf reads it as U+FFFD
        (_cut_content, "its content cannot be parsed"),  # pypdf reads it as nothing, without a word
    ],
    ids=["resources lost", "fonts lost", "content cut short"],
)
def test_a_page_whose_text_fails_to_extract_quietly_is_reported_not_read(
    tmp_path: Path, change: Callable[[pypdf.PageObject], None], why: str
) -> None:
    """pypdf reads such a page as blank or as replacement characters and says nothing: the page is skipped and
    named, never taken for a blank page or loaded as U+FFFD."""
    path = _with_page_two(tmp_path / "page2.pdf", change)
    with pytest.warns(PageExtractionWarning) as record:
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [1, 3] and doc.skipped_pages == (2,) and "\ufffd" not in doc.text
    assert "skipped page 2 of 3" in str(record.list[0].message) and why in str(record.list[0].message)


def _deflated(content: bytes, damage: str) -> bytes:
    """`content` as zlib data in stored blocks (its bytes readable inside), changed as `damage` says."""
    data = zlib.compress(content, level=0)
    if damage == "a changed letter":
        at = data.index(b"Beta")
        return data[:at] + b"Bfta" + data[at + 4 :]  # inflates whole, to other text: only the checksum tells
    if damage == "checksum cut short":
        return data[:-1]  # as Acrobat writes a checksum whose last byte is zero
    if damage == "no checksum":
        return data[:-4]
    return data


@pytest.mark.parametrize(
    ("damage", "told"),
    [("a changed letter", True), ("checksum cut short", False), ("no checksum", False), ("none", False)],
)
def test_compressed_content_that_fails_its_checksum_is_loaded_with_a_warning(
    tmp_path: Path, damage: str, told: bool
) -> None:
    """One changed byte of compressed content can still inflate, to other text: a complete checksum that fails is
    told (the page is loaded: producers have written wrong checksums); a checksum cut short or left out is not."""
    from pypdf.generic import DecodedStreamObject

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdfs.text_pdf_bytes(PAGES))))
    content = writer.pages[1].get_contents()
    assert content is not None
    stream = DecodedStreamObject()
    stream.set_data(_deflated(content.get_data(), damage))
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    writer.pages[1][NameObject("/Contents")] = writer._add_object(stream)
    path = tmp_path / "checksum.pdf"
    with path.open("wb") as fh:
        writer.write(fh)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        doc = load_document(path)
    assert [p.number for p in doc.pages] == [1, 2, 3] and doc.skipped_pages == ()
    assert doc.pages[1].text == ("Bfta page two." if damage == "a changed letter" else PAGES[1])
    garbled = [w.message for w in record if isinstance(w.message, GarbledTextWarning)]
    assert [w.pages for w in garbled] == ([(2,)] if told else [])
    assert len(record) == len(garbled) and doc.load_warnings == tuple(str(w) for w in garbled)
    if told:
        assert "checksum.pdf: the compressed content of page 2 fails its checksum" in str(garbled[0])


# --- text files --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".txt", ".md", ".markdown", ".rst", ""])
def test_text_and_markdown_files(tmp_path: Path, suffix: str) -> None:
    body = "# Title\n\nThe fee is   EUR 40.\n\n    indented code stays\n"
    path = tmp_path / f"notes{suffix}"
    path.write_text(body, encoding="utf-8")
    doc = _load_quietly(path)
    assert doc.text == body  # text is not re-spaced: markdown indentation matters
    assert doc.pages == (Page(1, body),)
    assert doc.page_of(0) == 1 and doc.page_of(len(body)) == 1
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_text_of_characters_shown_as_nothing_is_blank() -> None:
    """Hangul fillers, variation selectors, the combining grapheme joiner and the blank Braille pattern show nothing,
    as a zero-width space does: a document or question of them only is empty."""
    for invisible in ("\u3164", "\u115f\u1160", "\uffa0", "\u034f", "\ufe0f", "\u180b", "\u2800", "\U000e0100"):
        assert is_blank(invisible * 3 + " \u200b"), ascii(invisible)
    assert not is_blank("\u3164a") and not is_blank("\u2801")


def test_utf8_bom_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "windows.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst line\r\nSecond line \xe2\x82\xac\r\n\r\nOld Mac\rend")
    doc = _load_quietly(path)
    assert doc.text == "First line\nSecond line \u20ac\n\nOld Mac\nend"
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # of the raw bytes


def test_utf16_with_bom(tmp_path: Path) -> None:
    path = tmp_path / "unicode.txt"
    path.write_bytes("\ufeffNotice: 30 days\r\n".encode("utf-16-le"))
    assert _load_quietly(path).text == "Notice: 30 days\n"


def test_latin1_fallback(tmp_path: Path) -> None:
    path = tmp_path / "legacy.txt"
    path.write_bytes("Caf\u00e9 cr\u00e8me \u00e0 2 \u00a3, \u201cquoted\u201d".encode("cp1252"))
    assert _load_quietly(path).text == "Caf\u00e9 cr\u00e8me \u00e0 2 \u00a3, \u201cquoted\u201d"


def test_document_from_text() -> None:
    doc = document_from_text("\ufeffa\r\nb", source="memo")
    assert doc.text == "a\nb" and doc.pages == (Page(1, "a\nb"),) and doc.source == "memo"
    assert doc.sha256 == hashlib.sha256("\ufeffa\r\nb".encode()).hexdigest()
    assert doc.page_of(1) == 1 and doc.page_spans == ((0, 3),)
    for blank in (" \n\t", "\u200b\u200b", "\ufeff\u2060\n"):
        with pytest.raises(EmptyDocumentError, match="memo is empty"):
            document_from_text(blank, source="memo")


def test_document_from_pages_checks_each_page_as_text() -> None:
    doc = document_from_pages([(3, "a\r\nb "), (4, " \n"), (5, "c")], source="scan")
    assert doc.pages == (Page(3, "a\nb"), Page(5, "c")) and doc.text == f"a\nb{PAGE_SEPARATOR}c"
    assert doc.page_of(doc.text.index("c")) == 5 and doc.source == "scan"
    with pytest.raises(DocumentError, match="page 4 of scan holds a lone surrogate"):
        document_from_pages([(3, "fine"), (4, "bad \ud800 text")], source="scan")
    with pytest.raises(TypeError, match="page 1 of the documents must be str"):
        document_from_pages([(1, b"bytes")])  # type: ignore[list-item]
    with pytest.raises(EmptyDocumentError, match="scan hold no text"):
        document_from_pages([(1, " "), (2, ""), (3, "\u200b\u200c")], source="scan")


def test_document_from_pages_repairs_what_pdf_readers_leave() -> None:
    # Ligatures, soft hyphens and NULs as a framework's PDF reader passes them on: cleaned as load_document does.
    doc = document_from_pages([(1, "the \ufb01nal notice\u00ad period\x00 is   sixty days\r\n")])
    assert doc.text == "the final notice period is   sixty days"


def test_a_pdfs_words_broken_at_line_ends_are_read_whole(tmp_path: Path) -> None:
    """Justified text breaks words at line ends with a hyphen it adds; the model should read the words."""
    pages = [
        "Either party may seek termi-\nnation of this Agree-\nment within sixty (60) days.",
        "This Agreement ends on termination. The non-\ndisclosure duty survives.",
    ]
    doc = _load_quietly(pdfs.text_pdf(tmp_path / "justified.pdf", pages))
    assert doc.pages == (
        Page(1, "Either party may seek termination\nof this Agreement\nwithin sixty (60) days."),
        Page(2, "This Agreement ends on termination. The non-disclosure\nduty survives."),
    )
    assert doc.page_of(doc.text.index("termination")) == 1


def test_a_broken_word_goes_whole_only_where_the_document_writes_it_whole() -> None:
    # Otherwise it keeps its hyphen: a compound's own, or a typesetter's that loses nothing.
    assert join_broken_words(["a self-\nemployed agent", "pre-\nmises and the premises; follow-\nup, co-\nowner"]) == [
        "a self-employed\nagent",
        "premises\nand the premises; follow-up,\nco-owner",
    ]
    assert join_broken_words(["my mother-in-\nlaw's car; state-of-the-\nart; mother in law"]) == [
        "my mother-in-law's\ncar; state-of-the-art;\nmother in law"
    ]
    assert join_broken_words(["see www.acme-\ncorp.com or /etc/my-\nservice.conf; run git --no-\npager log"]) == [
        "see www.acme-corp.com\nor /etc/my-service.conf;\nrun git --no-pager\nlog"
    ]
    # A word broken twice is read across both breaks; one in capitals throughout too.
    assert join_broken_words(["Gewähr-\nleistungs-\nfrist", "LIMITATION OF LIA-\nBILITY", "liability"]) == [
        "Gewähr-leistungs-frist",
        "LIMITATION OF LIABILITY",
        "liability",
    ]
    # Where the document writes it whole, it goes whole across every break, however many.
    assert join_broken_words(["Die Gewähr-\nleistungs-\nfrist gilt.", "Gewährleistungsfrist"])[0] == (
        "Die Gewährleistungsfrist\ngilt."
    )
    assert join_broken_words(["the in-\ndemni-\nfi-\ncation clause", "indemnification"])[0] == (
        "the indemnification\nclause"
    )
    assert join_broken_words(["Gewähr-\nLeistungs-\nfrist", "gewährleistungsfrist"])[0] == "Gewähr-\nLeistungs-\nfrist"
    # Left alone: a capital, digit or dash after the break (something new), and a hyphen left hanging for the word
    # after a conjunction.
    kept = ["Items:\nfirst-\nSecond", "USD 7,-\n400", "pre-\n- post", "end-\n", "short-\nand long-term", "A-\nB"]
    assert join_broken_words(kept) == kept


def test_joining_broken_words_takes_linear_time() -> None:
    """A long run without spaces (a CJK paragraph, a sequence, text that lost its spaces) once took minutes."""
    started = time.perf_counter()
    for text in ("a-" * 100_000 + "\nb", "x" * 100_000 + "-\nx", "x" * 100_000, "a-\n" * 100_000 + "b"):
        join_broken_words([text])
    assert time.perf_counter() - started < 5


def test_document_from_pages_reads_broken_words_whole() -> None:
    # A framework's reader may leave a space before the line break, or mark the break with a soft hyphen.
    doc = document_from_pages(
        [(1, "the termi- \nnation"), (2, "of the Agree-\nment is fi\u00ad\nnal; termination of the Agreement")]
    )
    assert doc.pages == (
        Page(1, "the termination"),
        Page(2, "of the Agreement\nis final; termination of the Agreement"),
    )


@pytest.mark.parametrize(("turned", "rotate"), [(0, 0), (90, 0), (180, 0), (270, 0), (0, 90), (0, 270), (0, -45)])
def test_a_filled_in_forms_values_are_read_beside_their_labels(tmp_path: Path, turned: int, rotate: int) -> None:
    """An order form filled in a viewer keeps its values in form fields, outside the page's content; the fee and
    dates are what its questions ask about. Rows, "left of" and "above" are the text's own: a page whose content is
    drawn turned (and shown upright by its /Rotate), and an upright page a viewer saved turned (/Rotate alone, or an
    angle viewers ignore), read alike."""
    path = pdfs.filled_form_pdf(tmp_path / "order.pdf", turned)
    if rotate:
        writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(path))
        writer.pages[0][NameObject("/Rotate")] = NumberObject(rotate)
        writer.write(path)
    text = _load_quietly(path).text
    for line in (
        "Monthly fee: USD 7,400",
        "Start date: 1 March 2026",  # the second field on a row follows its own label
        "Governing law Delaware",  # a label above its box
        "[x] Automatic renewal",
        "[ ] Annual audit",
        "[x] annual",
        "[ ] monthly",
        "Plan: Gold",
        "Signed: Dana Whitcombe",  # a free-text annotation
        "Reference:",  # an empty field adds nothing
    ):
        assert line in text.split("\n"), (line, text)
    assert text.index("Date: 2 Feb 2026") < text.index("Date: 3 Feb 2026")  # two labels alike, each its own value
    assert text.count("SN-4471") == 1  # drawn in the page as well: not repeated
    assert text.count("2,500") == 1  # drawn word by word under its caption in its box: not repeated
    assert text.endswith("\nSpecial terms: Net 45")  # no label near it: named by its tooltip, at the end


def test_a_form_filled_in_on_a_turned_blank_page_reads_in_the_order_shown(tmp_path: Path) -> None:
    """No text to take a direction from: the page's /Rotate gives the frame its values end the page in."""
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    buffer = io.BytesIO()
    width = A4[0]  # user space portrait, shown landscape: a shown point (x, y) is (width - y, x)
    pdf = canvas.Canvas(buffer, pagesize=A4, invariant=1)
    pdf.setPageRotation(90)
    for name, value, (x, y) in (("first", "one", (72, 500)), ("second", "two", (500, 500)), ("third", "3", (72, 400))):
        pdf.acroForm.textfield(name=name, value=value, x=width - y - 18, y=x, width=18, height=150)
    pdf.showPage()
    pdf.save()
    path = tmp_path / "blank.pdf"
    path.write_bytes(buffer.getvalue())
    assert _load_quietly(path).text == "first: one\nsecond: two\nthird: 3"


def test_a_broken_words_line_ending_in_spaces_is_no_paragraph_break() -> None:
    # pypdf's extraction (a framework's PDF reader) leaves a line's trailing spaces.
    doc = document_from_pages([(1, "request termi-\nnation \nof this Agreement; termination")])
    assert doc.pages == (Page(1, "request termination\nof this Agreement; termination"),)


def test_invisible_breaks_inside_words_and_amounts_are_dropped() -> None:
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # spelt with a zero-width non-joiner: kept
    doc = document_from_pages([(1, f"\ufeffEUR 3\u200b150, pay\u2060able; {persian}")])
    assert doc.pages == (Page(1, f"EUR 3150, payable; {persian}"),)


def test_a_fenced_code_blocks_line_breaks_are_the_codes_own() -> None:
    code = "````sh\ngit --no-\npager log\n```\nstill-\ncode\n````\n"  # a shorter fence does not close it
    tilde = "~~~\nx = a-\nb\n"  # never closed: code to the end of the page
    page = f"the termi-\nnation clause\n{code}and the termi-\nnation date\n{tilde}"
    whole = "termination, still, code, nopager"
    assert join_broken_words([page, whole]) == [
        f"the termination\nclause\n{code}and the termination\ndate\n{tilde}",
        whole,
    ]
    # A markdown page from a framework's reader: prose joined, code as written.
    doc = document_from_pages([(1, page), (2, whole)])
    assert "git --no-\npager log" in doc.text and "x = a-\nb" in doc.text and "the termination\nclause" in doc.text


def test_document_rejects_text_that_is_not_the_joined_pages() -> None:
    with pytest.raises(ValueError):
        Document(text="x", pages=(Page(1, "y"),), source=None, sha256="0" * 64)


# --- not documents -----------------------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    for name in ("empty.txt", "empty.pdf"):
        (tmp_path / name).write_bytes(b"")
        message = _refusal(EmptyDocumentError, tmp_path / name)
        assert name in message and "0 bytes" in message


@pytest.mark.parametrize(
    "blank", [" \n\r\n\t  \n", "\u200b\u200b\u200b\n", "\ufeff\ufeff\n"], ids=["whitespace", "zero-width", "two BOMs"]
)
def test_whitespace_only_text(tmp_path: Path, blank: str) -> None:
    """Invisible characters are no text to answer from, as they are no question (`prompt.question_turns`)."""
    path = tmp_path / "blank.md"
    path.write_text(blank, encoding="utf-8")
    message = _refusal(EmptyDocumentError, path)
    assert "blank.md" in message and "whitespace" in message


def test_binary_with_unknown_suffix(tmp_path: Path) -> None:
    path = tmp_path / "blob.dat"
    path.write_bytes(bytes(range(256)) * 8)
    message = _refusal(UnsupportedFormatError, path)
    assert "blob.dat" in message and "PDF" in message and "plain text" in message


def test_zero_bytes_file_is_binary_not_text(tmp_path: Path) -> None:
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"\x00" * 1000)  # valid UTF-8, but not text
    with pytest.raises(UnsupportedFormatError, match="zeros.txt is named .txt but is not a supported"):
        load_document(path)


def test_office_file_says_export_first(tmp_path: Path) -> None:
    path = tmp_path / "contract.docx"
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    message = _refusal(UnsupportedFormatError, path)
    assert "contract.docx" in message and "ZIP" in message and "export" in message


def test_html_saved_as_pdf(tmp_path: Path) -> None:
    path = tmp_path / "report.pdf"
    path.write_text("<!DOCTYPE html><html><body>Access denied</body></html>", encoding="utf-8")
    message = _refusal(UnsupportedFormatError, path)
    assert "report.pdf" in message and "not a PDF" in message and "HTML" in message


def test_image_file_suggests_ocr(tmp_path: Path) -> None:
    path = tmp_path / "scan.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(UnsupportedFormatError, match="OCR"):
        load_document(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.pdf"):
        load_document(tmp_path / "nope.pdf")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_document(tmp_path)
    with pytest.raises(FileNotFoundError, match="the document's path is empty"):
        load_document("")  # not " is a directory": Path("") is the working directory
    (tmp_path / "loop.pdf").symlink_to(tmp_path / "loop.pdf")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):  # not "No such file"
        load_document(tmp_path / "loop.pdf")


def test_special_files_are_refused_by_kind(tmp_path: Path) -> None:
    fifo = tmp_path / "contract.txt"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            load_document(fifo)
        except BaseException as exc:  # noqa: BLE001 - whatever it raises is checked below
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)  # a FIFO without a writer would block it for good
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "load_document blocked on a FIFO"
    [error] = outcome
    assert isinstance(error, UnsupportedFormatError) and "contract.txt is a named pipe (FIFO)" in str(error)
    device = tmp_path / "device.txt"
    device.symlink_to("/dev/null")  # as /dev/zero, which would read without end, but harmless if it is read
    message = _refusal(UnsupportedFormatError, device)
    assert "device.txt is a character device" in message


def test_nul_bytes_in_text_are_named(tmp_path: Path) -> None:
    path = tmp_path / "lease.txt"
    path.write_bytes(b"The notice period is ninety days. " * 50 + b"\x00End.")
    message = _refusal(UnsupportedFormatError, path)
    assert "1 NUL byte" in message and "offset 1700" in message and "binary" not in message
    path.write_bytes("Notice: the notice period is ninety days.".encode("utf-16-le"))
    message = _refusal(UnsupportedFormatError, path)
    assert "UTF-16 without a byte-order mark" in message and "UTF-8" in message
    # With a byte-order mark the NULs are UTF-16's own: deleting them, as for text, would destroy the file.
    marked = "\ufeffNotice: the notice\x00 period is ninety days.".encode("utf-16-le")
    for data, told in (
        (marked, "UTF-16 text holding 1 NUL character(s) (the first at character 18)"),
        (marked[:-1], "UTF-16 text (its byte-order mark says so) cut short"),
        ("Notice: ninety days.".encode("utf-32"), "UTF-32 text"),
        ("\ufeffNotice: ninety days.".encode("utf-32-be"), "UTF-32 text"),
    ):
        path.write_bytes(data)
        message = _refusal(UnsupportedFormatError, path)
        assert told in message and "tr -d" not in message, message


def test_a_loaded_document_instead_of_a_path_names_the_call_to_use() -> None:
    document = document_from_text("The notice period is 30 days.")
    with pytest.raises(TypeError, match="got Document.*ingest_document"):
        load_document(document)  # type: ignore[arg-type]


def test_every_document_error_is_a_document_error() -> None:
    for cls in (UnsupportedFormatError, EmptyDocumentError, EncryptedPDFError, NoExtractableTextError, CorruptPDFError):
        assert issubclass(cls, DocumentError)


_LEGACY_TEXTS = {
    "gb18030": "本合同的通知期限为九十天。如果供应商延迟交货，每天罚款五百欧元。合同经理是爱丽丝。",
    "big5": "本合約的通知期限為九十天。如果供應商延遲交貨，每天罰款五百歐元。",
    "shift_jis": "この契約の通知期間は九十日です。供給者が納品を遅らせた場合、一日五百ユーロの罰金。",
    "cp1251": "Срок уведомления по настоящему договору составляет девяносто дней. Штраф пятьсот евро.",
    "koi8_r": "Срок уведомления составляет тридцать дней. " * 4,
    "cp1253": "Η περίοδος ειδοποίησης είναι τριάντα ημέρες. " * 4,
    "cp1250": "Okres wypowiedzenia wynosi trzydzieści dni. Zażółć gęślą jaźń. " * 3,
    # Turkish: cp1254's letters where cp1252 has Icelandic ones (Ş as Þ, ı as ý) must not be read as cp1252.
    "cp1254": "Bildirim süresi otuz gündür. Şirket ığdır çalışanları. " * 4,
}


@pytest.mark.parametrize(
    ("encoding", "text"), [("iso2022_jp", "通知期間は45日です。"), ("iso2022_kr", "통지 기간은 45일입니다.")]
)
def test_iso_2022_text_is_read_in_its_character_set(tmp_path: Path, encoding: str, text: str) -> None:
    """7-bit bytes that switch character sets with escapes (e-mail's Japanese and Korean) are valid ASCII: read
    as such they would keep the escapes and lose every character."""
    path = tmp_path / "notice.txt"
    path.write_bytes(f"Notice: {text}\n".encode(encoding))
    assert _load_quietly(path).text == f"Notice: {text}\n"


def test_utf8_text_holding_an_escape_is_utf8_not_iso_2022(tmp_path: Path) -> None:
    """ISO-2022 is 7-bit: a UTF-8 file beyond ASCII that holds ESC $ (a terminal colour code pasted in) is UTF-8."""
    path = tmp_path / "log.txt"
    path.write_bytes("Fee: 5 € per day \x1b$B, payable monthly.".encode())
    assert _load_quietly(path).text == "Fee: 5 € per day \x1b$B, payable monthly."


@pytest.mark.parametrize("encoding", sorted(_LEGACY_TEXTS))
def test_legacy_encodings_are_detected_not_garbled(tmp_path: Path, encoding: str) -> None:
    """Any byte string decodes as cp1252; a CJK or Cyrillic file must not be stored as its mojibake."""
    text = "Contract 7: " + _LEGACY_TEXTS[encoding]
    path = tmp_path / "contract.txt"
    path.write_bytes(text.encode(encoding))
    assert load_document(path).text == text


@pytest.mark.parametrize(
    "text",
    [
        "Le délai de préavis est de quatre-vingt-dix jours; as condições não são negociáveis. Größe: 5 €.",
        "Größe: 5 m",  # short, and two accented letters in a row: still Western
        "Kündigungsfrist: drei Monate. Größe: 500 m.",
        # Characters beyond ASCII inside Western words: an apostrophe, a middle dot, marks, a figure's symbols.
        "The Supplier\u2019s col\u00b7legi fee: \u00bfQu\u00e9? 5 m\u00b2, \u00a3400, E=mc\u00b2, \u00bd hour.",
    ],
)
def test_western_legacy_text_stays_cp1252(tmp_path: Path, text: str) -> None:
    path = tmp_path / "avis.txt"
    path.write_bytes(text.encode("cp1252"))
    assert load_document(path).text == text


def test_text_of_an_undeterminable_encoding_is_refused(tmp_path: Path) -> None:
    # Runs of high bytes (not Western) that no encoding reads as coherent text: refused, never guessed.
    path = tmp_path / "mystery.txt"
    path.write_bytes(b"Notice: " + bytes([0xC3, 0x80, 0xFE, 0xA1, 0x81, 0x30, 0xE9, 0xFF]) * 3 + b" end.")
    message = _refusal(UnsupportedFormatError, path)
    assert "UTF-8" in message


@pytest.mark.parametrize(
    ("encoding", "text"),
    [
        ("cp1251", "Срок: 30 дней.\n"),
        ("cp1251", "Привет\n"),
        ("cp1254", "Şirket çalışanları bildirim süresi otuz gündür.\n"),
        # Central European letters read as cp1252 stand alone, as Western ones do, but some as symbols inside words
        # ("P³atnoœæ"); DOS and Mac Western text reads as capitals inside words ("KŸndigung", "d‚lai").
        ("cp1250", "Okres wypowiedzenia wynosi 45 dni. Płatność następuje w ciągu 30 dni.\n"),
        ("iso-8859-2", "Okres wypowiedzenia wynosi 45 dni. Płatność następuje w ciągu 30 dni.\n"),
        ("mac-roman", "Die Kündigungsfrist beträgt 45 Tage.\n"),
        ("cp850", "Le délai de préavis est de 45 jours.\n"),
        # Single bytes that read as half-width katakana in Shift-JIS, and as nothing else charset-normalizer finds.
        ("koi8-r", "Срок уведомления составляет 45 дней. Оплата в течение 30 дней.\n"),
    ],
)
def test_short_legacy_text_is_refused_not_garbled(tmp_path: Path, encoding: str, text: str) -> None:
    # Too little text for its encoding to be told (several read as plausible text): refused, not guessed.
    path = tmp_path / "short.txt"
    path.write_bytes(text.encode(encoding))
    message = _refusal(UnsupportedFormatError, path)
    assert "short.txt" in message and "save it as UTF-8" in message


# A UTF-8 contract: multi-byte characters throughout.
_UTF8_CLAUSE = "Clause 4.2 \u2014 the fee is 1 200 \u20ac a month, payable in Z\u00fcrich; the caf\u00e9\u2019s lease. "


def _load_warning_of_stray_bytes(path: Path) -> tuple[Document, StrayBytesWarning]:
    """The document and the one warning (a StrayBytesWarning) that loading `path` gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        doc = load_document(path)
    [record] = caught
    warning = record.message
    assert isinstance(warning, StrayBytesWarning), warning
    assert record.filename == __file__  # the caller of load_document is warned
    return doc, warning


@pytest.mark.parametrize(("stray", "read_as"), [(b"\x92", "\u2019"), (b"\x96", "\u2013"), (b"\xe9", "\u00e9")])
def test_a_stray_cp1252_byte_in_utf8_text_is_read_as_cp1252_with_a_warning(
    tmp_path: Path, stray: bytes, read_as: str
) -> None:
    # A smart quote or an en dash pasted from a Windows application, an "é" typed in an editor set to cp1252.
    head = (_UTF8_CLAUSE * 20).encode("utf-8") + b"The Supplier"
    path = tmp_path / "contract.txt"
    path.write_bytes(head + stray + b"s notice is ninety days.\r\n" + _UTF8_CLAUSE.encode("utf-8"))
    doc, warning = _load_warning_of_stray_bytes(path)
    assert doc.text == _UTF8_CLAUSE * 20 + f"The Supplier{read_as}s notice is ninety days.\n" + _UTF8_CLAUSE
    with warnings.catch_warnings(record=True) as caught:  # a server's: told in load_warnings only
        warnings.simplefilter("always")
        quiet = load_document(path, warn=False)
    assert caught == [] and quiet.load_warnings == doc.load_warnings == (str(warning),)
    assert doc.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # of the raw bytes, as ever
    message = str(warning)
    assert warning.offsets == (len(head),)
    assert "contract.txt" in message and "1 stray byte" in message and f"byte offset {len(head)}" in message
    assert "Windows-1252" in message and repr(read_as) in message
    assert doc.load_warnings == (message,)  # for callers that report them, without catching warnings


def test_up_to_eight_stray_bytes_are_read_and_more_are_refused_by_count_and_offset(tmp_path: Path) -> None:
    clause = _UTF8_CLAUSE.encode("utf-8")
    strays = [b"\x93", b"\x94", b"\x85", b"\xa0", b"\xfc", b"\x80", b"\x96", b"\x92"]  # each alone, 8 of them
    data = b"".join(clause + stray for stray in strays)
    expected = "".join(_UTF8_CLAUSE + stray.decode("cp1252") for stray in strays)
    offsets = tuple((len(clause) + 1) * n + len(clause) for n in range(len(strays)))
    path = tmp_path / "notes.txt"
    path.write_bytes(data)
    doc, warning = _load_warning_of_stray_bytes(path)
    assert doc.text == expected and warning.offsets == offsets and "8 stray bytes" in str(warning)
    path.write_bytes(b"\xef\xbb\xbf" + data)  # a UTF-8 byte-order mark: the same, offsets counted in the file
    doc, warning = _load_warning_of_stray_bytes(path)
    assert doc.text == expected and warning.offsets == tuple(offset + 3 for offset in offsets)
    # One more: no slip but a passage in another encoding. Refused, naming the bytes, not as binary data.
    path.write_bytes(data + clause + b"\x92")
    message = _refusal(UnsupportedFormatError, path)
    assert f"UTF-8 text except for 9 bytes that are not UTF-8 (the first at byte offset {offsets[0]})" in message
    assert "save it as UTF-8" in message and "binary" not in message


def test_stray_bytes_side_by_side_undefined_or_outnumbering_the_utf8_are_not_read_as_cp1252(tmp_path: Path) -> None:
    clause = (_UTF8_CLAUSE * 3).encode("utf-8")
    path = tmp_path / "notes.txt"
    # Side by side (a legacy-encoded word, a UTF-8 character cut), or a byte that cp1252 leaves undefined: refused
    # as UTF-8 with bytes that are not, where they were refused as binary data.
    two, one = "2 bytes that are", "1 byte that is"
    for bad, count in ((b"\x92\x94", two), (b"\xe2\x80", two), (b"\x81", one)):
        path.write_bytes(clause + bad + clause)
        message = _refusal(UnsupportedFormatError, path)
        assert f"UTF-8 text except for {count} not UTF-8 (the first at byte offset {len(clause)})" in message, bad
    # A UTF-8 text with a word pasted from cp1252 (two accented letters side by side), a Java NUL (C0 80), or an
    # emoji cut at its end: charset detection read the whole file as ISO-8859-10 ("dÃĐlai"), garbling every letter.
    french = "Le délai de préavis est de trente jours. Le dépôt de garantie s'élève à mille euros. "
    for damaged in (
        french.encode() + "la réévaluation".encode("cp1252") + b" " + french.encode(),
        (french * 2).encode() + b"\xc0\x80" + french.encode(),
        (french * 3).encode() + "\N{THUMBS UP SIGN}".encode()[:3],
    ):
        path.write_bytes(damaged)
        assert "is UTF-8 text except for" in _refusal(UnsupportedFormatError, path), damaged[-40:]
    # Western cp1252 text in which two bytes happen to form a UTF-8 character ("ß“" is U+07D3): its letters that
    # stand alone outnumber it, so it stays cp1252, as before.
    text = "Der \u201eGru\u00df\u201c aus K\u00f6ln kostet 5 \u20ac."
    path.write_bytes(text.encode("cp1252"))
    assert _load_quietly(path).text == text
