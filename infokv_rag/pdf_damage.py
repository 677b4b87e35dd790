"""Damage in a PDF that pypdf reads past: pages whose content does not decode or cannot be found, and pages the
page tree lists that are missing. `documents._load_pdf` refuses such a file (`damage_error`) rather than answer from
part of it as if it were all of it."""

from __future__ import annotations

import contextlib
import logging
import shlex
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pypdf import PageObject, PdfReader
from pypdf.filters import ASCII85Decode, ASCIIHexDecode
from pypdf.generic import ArrayObject, DictionaryObject, IndirectObject, NullObject, StreamObject

from .errors import CorruptPDFError, on_one_line

_PYPDF_LOGGER = logging.getLogger("pypdf")

# pypdf (strict=False) reads a damaged PDF as far as it can and reports what it worked around only through
# `logging`, if at all: a compressed content stream that does not inflate gives the text before the damage (or
# none), a page whose content object is gone reads as blank, and a page whose object is gone is left out of the
# page list. Loading such a file would answer from part of a document as if it were all of it, so these are
# checked here directly (not through pypdf's log records alone: an application may raise the "pypdf" logger's
# level, and pypdf 5 and 6.0 do not report a stream that fails to inflate at all), and the file is refused,
# naming the pages. A cross-reference table that pypdf had to rebuild (a wrong startxref offset, common in real
# files) is no damage by itself: the file loads when every page is found and its content decodes.


class PypdfReports(logging.Handler):
    """The log records pypdf emits in this thread while one PDF is read (other threads may be loading other
    files at the same time)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if threading.get_ident() == self.thread:
            self.records.append(record)


@contextlib.contextmanager
def pypdf_reports() -> Iterator[PypdfReports]:
    """Collect pypdf's log records while a PDF is read; they still reach the application's own handlers."""
    reports = PypdfReports()
    _PYPDF_LOGGER.addHandler(reports)
    try:
        yield reports
    finally:
        _PYPDF_LOGGER.removeHandler(reports)


def _inflate_failure(record: logging.LogRecord) -> str | None:
    """zlib's complaint in a record of pypdf giving up on part of a Flate stream it inflated (newer pypdf logs
    one: "Error -3 while decompressing data: ..."), or None."""
    message = record.getMessage()
    return message if record.name == "pypdf.filters" and message.startswith("Error -") else None


_FLATE = frozenset({"/FlateDecode", "/Fl"})
# Filters that may come before /FlateDecode in a chain (reportlab writes [/ASCII85Decode /FlateDecode]).
_TEXT_FILTERS: dict[str, Any] = {
    "/ASCII85Decode": ASCII85Decode,
    "/A85": ASCII85Decode,
    "/ASCIIHexDecode": ASCIIHexDecode,
    "/AHx": ASCIIHexDecode,
}
_INFLATE_LIMIT = 75_000_000  # bytes of output checked per stream (pypdf's own limit on what it inflates)
_FORM_DEPTH = 8


def page_problem(
    page: PageObject, records: Sequence[logging.LogRecord], checked: dict[tuple[int, int], tuple[bool, str] | None]
) -> tuple[bool, str] | None:
    """What is wrong with the page's content that extraction passed over, or None when nothing is known to be:
    (whether this copy of the file is damaged, what is wrong, phrased to follow "the content of page N").

    Damaged: content the page names that is not in the file (its /Contents object missing, or not a stream), or
    compressed content (of the page, or of a form it draws) that does not inflate. Not damaged but unreadable: a
    form that pypdf cannot decode otherwise (it leaves the form's text out without a word). `records` are
    pypdf's log records while the page's text was extracted; `checked` holds the forms checked already (pages
    share them)."""
    try:
        if "/Contents" in page:
            for stream in _contents(page.raw_get("/Contents")):
                if not isinstance(stream, StreamObject):
                    return True, "cannot be found (the object holding it is missing or damaged)"
                failure = _flate_failure(stream)
                if failure is not None:
                    return True, f"does not decode ({failure})"
        problem = _form_problem(page.get("/Resources"), checked, depth=0)
    except MemoryError:
        raise
    except Exception:  # a structure too broken to walk: extraction has been tried and is judged on its own
        problem = None
    if problem is not None:
        return problem
    for record in records:
        failure = _inflate_failure(record)
        if failure is not None:
            return True, f"does not decode in part ({failure})"
    return None


def _contents(value: Any) -> list[Any]:
    """The objects a page's /Contents value names (one stream, or an array of streams), resolved: None for a
    reference to an object that is not in the file. A direct null names nothing (a blank page)."""
    target = resolved(value)
    items = list(target) if isinstance(target, ArrayObject) else [value]
    found = []
    for item in items:
        if isinstance(item, IndirectObject):
            obj = item.get_object()
            found.append(None if obj is None or isinstance(obj, NullObject) else obj)
        elif not (item is None or isinstance(item, NullObject)):
            found.append(item)
    return found


def _form_problem(
    resources: Any, checked: dict[tuple[int, int], tuple[bool, str] | None], depth: int
) -> tuple[bool, str] | None:
    """What is wrong with a form XObject among `resources` (or a form it draws), as `page_problem` says it."""
    resources = resolved(resources)
    if depth > _FORM_DEPTH or not isinstance(resources, DictionaryObject):
        return None
    xobjects = resources.get("/XObject")
    if not isinstance(xobjects, DictionaryObject):
        return None
    for key in xobjects:
        reference = xobjects.raw_get(key)
        if not isinstance(reference, IndirectObject):
            continue  # a stream is always an indirect object
        ident = (reference.idnum, reference.generation)
        if ident not in checked:
            checked[ident] = None  # a form that draws itself is checked once
            form = reference.get_object()
            if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form":
                checked[ident] = _one_form_problem(form, checked, depth)
        problem = checked[ident]
        if problem is not None:
            return problem
    return None


def _one_form_problem(
    form: StreamObject, checked: dict[tuple[int, int], tuple[bool, str] | None], depth: int
) -> tuple[bool, str] | None:
    try:
        form.get_data()  # what extraction reads; pypdf drops a form it cannot decode, logging it only
    except MemoryError:
        raise
    except Exception as exc:
        return False, f"draws a form that cannot be decoded ({pypdf_detail(exc)})"
    failure = _flate_failure(form)
    if failure is not None:
        return True, f"draws a form that does not decode ({failure})"
    return _form_problem(form.get("/Resources"), checked, depth + 1)


def _flate_failure(stream: StreamObject) -> str | None:
    """zlib's complaint about the Flate data of `stream` when it is damaged, or None: also when the stream is
    not Flate-compressed, or only after a filter not checked here, or the filters before fail (pypdf reports
    those itself)."""
    data = _flate_data(stream)
    if data is None:
        return None
    try:
        _inflate(data)
    except zlib.error as exc:
        return str(exc)
    return None


def fails_checksum(page: PageObject) -> bool:
    """Whether a compressed content stream of `page` inflates whole but fails the checksum stored after it: one
    changed bit of compressed data can still inflate, to other text. Only a complete checksum counts (Acrobat
    drops a checksum's zero last byte); a producer that wrote wrong checksums (jsPDF 1.x) is told apart by no
    check here, so a failure is a warning, never a refusal."""
    try:
        streams = _contents(page.raw_get("/Contents")) if "/Contents" in page else []
        return any(
            isinstance(stream, StreamObject) and (data := _flate_data(stream)) is not None and not _inflate(data)
            for stream in streams
        )
    except MemoryError:
        raise
    except Exception:  # damage that `page_problem` judges
        return False


def _flate_data(stream: StreamObject) -> bytes | None:
    """The Flate-compressed bytes of `stream` (after the text filters before /FlateDecode), or None: not
    Flate-compressed, compressed after a filter not checked here, or its filters before fail."""
    filters = stream.get("/Filter")
    names = list(filters) if isinstance(filters, ArrayObject) else [filters]
    data: Any = stream._data  # the encoded bytes as read from the file (decrypted)
    for name in names:
        if name in _FLATE:
            break
        decoder = _TEXT_FILTERS.get(str(name))
        if decoder is None:
            return None
        try:
            data = decoder.decode(data)
        except MemoryError:
            raise
        except Exception:
            return None
    else:
        return None
    return data if isinstance(data, bytes) else None


def _inflate(data: bytes) -> bool:
    """Inflate zlib data up to `_INFLATE_LIMIT` bytes of output, keeping none; zlib.error where it is damaged, else
    whether its checksum holds (True also where none can be checked).

    Only the zlib header and the compressed blocks are judged damage, as viewers and pypdf judge them: data that
    stops before its final block or checksum, a wrong checksum, or bytes after the end are no damage here, because
    real producers write them so (jsPDF 1.x wrote wrong checksums, Acrobat drops a checksum's zero last byte,
    early Distiller counted line ends into the stream). A corrupted block is damage: it leaves the text from
    there on unreadable, pypdf keeping only what came before."""
    if data.startswith(b"\x1f\x8b"):
        return True  # gzip, not zlib: against the PDF standard, and left to pypdf
    zlib.decompressobj().decompress(data[:2])  # the header: "incorrect header check" when it is none
    if len(data) < 2 or data[1] & 0x20:
        return True  # a preset dictionary, which PDF never uses: left to pypdf
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)  # the blocks alone, without the checksum
    rest, produced, adler = data[2:], 0, zlib.adler32(b"")
    while rest and produced < _INFLATE_LIMIT and not inflater.eof:
        output = inflater.decompress(rest, 1 << 20)
        produced += len(output)
        adler = zlib.adler32(output, adler)
        rest = inflater.unconsumed_tail
    stored = inflater.unused_data[:4]
    return not inflater.eof or len(stored) < 4 or int.from_bytes(stored, "big") == adler


@dataclass(frozen=True)
class MissingPages:
    """Pages a PDF's page tree lists that cannot be found: `listed` pages in all, `lost` of them missing, at
    `where` ((first, last) page-number runs), or None where that cannot be told."""

    listed: int
    lost: int
    where: tuple[tuple[int, int], ...] | None


def missing_pages(reader: PdfReader, found: int) -> MissingPages | None:
    """The pages the page tree promises (entries in /Kids, each /Pages node's /Count) that pypdf cannot find
    (objects missing or damaged), or None when every page it lists is there.

    pypdf walks the tree and leaves out what it cannot resolve; the same walk here keeps their places."""
    try:
        root = reader.root_object["/Pages"].get_object()
        if not isinstance(root, DictionaryObject):
            return None
        runs, exact = _page_runs(root, depth=0)
        declared = root.get("/Count")
    except MemoryError:
        raise
    except Exception:  # pypdf has walked the tree already; what it found is all that can be told
        return None
    lost = sum(count for present, count in runs if not present)
    if sum(count for present, count in runs if present) != found:  # a tree this walk reads unlike pypdf
        listed = declared if isinstance(declared, int) else found
        return MissingPages(listed, listed - found, None) if listed > found else None
    if not lost:
        return None
    where: list[tuple[int, int]] = []
    number = 1
    for present, count in runs:
        if present:
            pass
        elif where and where[-1][1] == number - 1:
            where[-1] = (where[-1][0], number + count - 1)
        else:
            where.append((number, number + count - 1))
        number += count
    return MissingPages(found + lost, lost, tuple(where) if exact else None)


def _page_runs(node: DictionaryObject, depth: int) -> tuple[list[tuple[bool, int]], bool]:
    """The pages under a /Pages node in order, as runs of (found, how many), and whether the places of the
    missing ones are known: a /Kids entry that does not resolve to a page or /Pages dictionary is missing (one
    page, or as many as its parent's /Count leaves unaccounted for when it is the only one missing), and pages
    that /Count promises beyond those are missing at an unknown place."""
    if depth > 100:  # pypdf refuses deeper trees
        raise ValueError("page tree too deep")
    kids = node.get("/Kids")
    runs: list[tuple[bool, int]] = []
    exact, gaps = True, []
    for kid in kids if isinstance(kids, ArrayObject) else []:
        obj = resolved(kid)
        if not isinstance(obj, DictionaryObject) or not obj:
            gaps.append(len(runs))
            runs.append((False, 1))
            continue
        kind = obj.get("/Type")
        if kind == "/Pages" or (kind is None and "/Kids" in obj):
            sub_runs, sub_exact = _page_runs(obj, depth + 1)
            runs.extend(sub_runs)
            exact = exact and sub_exact
        elif kind in ("/Page", None):
            runs.append((True, 1))
        # any other /Type is no page: pypdf skips it too
    declared = node.get("/Count")
    extra = declared - sum(count for _, count in runs) if isinstance(declared, int) else 0
    if extra > 0:
        if len(gaps) == 1:
            runs[gaps[0]] = (False, 1 + extra)
        else:
            runs.append((False, extra))
            exact = False
    return runs, exact


def damage_error(name: str, page_count: int, damaged: dict[int, str], missing: MissingPages | None) -> CorruptPDFError:
    """The refusal of a PDF whose pages are damaged or missing: which, why, and what to do."""
    parts = []
    if missing is not None:
        found = missing.listed - missing.lost
        if missing.where is not None:
            which = f"{_pages(missing.where)} cannot be found"
        else:
            which = f"only {found} can be found" if found else "none can be found"
        parts.append(f"its page tree lists {_count(missing.listed, 'page')} but {which}")
    reasons: dict[str, list[int]] = {}
    for number in sorted(damaged):
        reasons.setdefault(damaged[number], []).append(number)
    for index, (reason, numbers) in enumerate(reasons.items()):
        if index == _MAX_DAMAGE_SHOWN:
            rest = sorted(n for numbers in list(reasons.values())[index:] for n in numbers)
            parts.append(f"the content of {page_list(rest)} is damaged likewise")
            break
        parts.append(f"the content of {page_list(numbers)} {reason}")
    lost = len(damaged) + (missing.lost if missing is not None else 0)
    left = page_count - len(damaged)
    message = f"{name} is damaged: " + "; ".join(parts) + ". "
    if left:
        message += (
            f"The text of {'that page' if lost == 1 else 'those pages'} is not in this copy, and loading the rest "
            "would answer from part of the document as if it were all of it. "
        )
    message += "Download or export it again."
    if left and missing is not None:
        message += (
            " If no intact copy exists, rebuilding it keeps the pages that are left, e.g. "
            f"`qpdf {shlex.quote(name)} repaired.pdf`; load the repaired file knowing that the others are gone."
        )
    elif left:
        keep = ",".join(_run_text(run) for run in _runs([n for n in range(1, page_count + 1) if n not in damaged]))
        copy = Path(name).with_name(Path(name).stem + "-rest.pdf")
        message += (
            " If no intact copy exists, make one without the damaged pages, e.g. "
            f"`{shlex.join(['qpdf', name, '--pages', '.', keep, '--', str(copy)])}`, and load that knowing that "
            "those pages are left out."
        )
    return CorruptPDFError(message)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


_MAX_DAMAGE_SHOWN = 5


def _runs(numbers: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted page numbers as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    return tuple(runs)


def _run_text(run: tuple[int, int]) -> str:
    return str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}"


def _pages(runs: Sequence[tuple[int, int]]) -> str:
    """ "page 2", "pages 1-2, 5": the pages of `runs`."""
    label = "page" if len(runs) == 1 and runs[0][0] == runs[0][1] else "pages"
    return f"{label} " + ", ".join(_run_text(run) for run in runs)


def page_list(numbers: Sequence[int]) -> str:
    """ "page 2", "pages 1-2, 5": sorted page numbers as a message names them."""
    return _pages(_runs(numbers))


def unreadable_text(page: PageObject) -> str | None:
    """Why the text of `page`, read as nothing or as U+FFFD, is not what the page shows, or None where nothing is
    known to be wrong (a blank page, a scan): its content cannot be parsed (pypdf then extracts nothing, without a
    word), or it shows text in a font its resources do not hold (read as nothing, or as U+FFFD). Phrased to follow
    "text extraction failed"."""
    try:
        contents = page.get_contents()
        if contents is None:
            return None
        operations = contents.operations
    except MemoryError:
        raise
    except Exception as exc:
        return f"its content cannot be parsed: {pypdf_detail(exc)}"
    try:
        resources = resolved(page.get("/Resources"))
        fonts = resolved(resources.get("/Font")) if isinstance(resources, DictionaryObject) else None
        held = set(fonts) if isinstance(fonts, DictionaryObject) else set()
    except MemoryError:
        raise
    except Exception as exc:
        return f"its fonts cannot be read: {pypdf_detail(exc)}"
    font = None
    for operands, operator in operations:
        if operator == b"Tf" and operands:
            font = operands[0]
        elif operator in _SHOW_TEXT and font is not None and font not in held:
            return f"its text is drawn in font {font}, which it does not hold"
    return None


_SHOW_TEXT = frozenset({b"Tj", b"TJ", b"'", b'"'})


def resolved(value: Any) -> Any:
    """The object a reference names (pypdf's `get` gives the reference itself: many producers write /Resources
    and /Font as references), or `value` when it is none."""
    return value.get_object() if isinstance(value, IndirectObject) else value


def pypdf_detail(exc: BaseException) -> str:
    """pypdf's error, on one line (it may quote the file's own names) and at most 160 characters."""
    message = on_one_line(str(exc).strip()) or type(exc).__name__
    return message if len(message) <= 160 else message[:157] + "..."
