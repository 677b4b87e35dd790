"""Typeset the bundled sample documents (examples/sample/NAME.txt) as their PDFs (NAME.pdf).

Run from anywhere: `python examples/make_sample_pdf.py [NAME ...]` (default: every sample). Needs reportlab
(the `dev` extra). The samples: the maintenance agreement the examples read (written for this project, so no
model has read it) and the Apache License 2.0 (the planted-fact benchmark's document, `benchmarks/quality.py`).
The text goes in unchanged, paragraph by paragraph, so every word (and the section numbering) can be found in
the PDF's extracted text; the output is byte-reproducible.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from xml.sax.saxutils import escape

from reportlab.lib.enums import TA_CENTER
from reportlab.lib.pagesizes import LETTER
from reportlab.lib.styles import ParagraphStyle, getSampleStyleSheet
from reportlab.lib.units import inch
from reportlab.platypus import Flowable, Paragraph, Preformatted, SimpleDocTemplate, Spacer

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLES = {
    "maintenance-agreement": ("Equipment Maintenance Services Agreement VDS-2026-0417", "infokv-rag"),
    "apache-license-2.0": ("Apache License, Version 2.0", "The Apache Software Foundation"),
}
"""Each sample's name (its .txt and .pdf in SAMPLE_DIR) -> (PDF title, PDF author)."""

_SECTION = re.compile(r"^(\d+\.\s[^.]+\.)(.*)$", re.DOTALL)
_FIELD = re.compile(r"^([A-Z][^:]{0,60}):\s(.+)$")


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """Blank-line separated blocks as (indent of the first line, lines)."""
    blocks: list[tuple[int, list[str]]] = []
    for raw in re.split(r"\n\s*\n", text.strip("\n")):
        lines = raw.split("\n")
        indent = len(lines[0]) - len(lines[0].lstrip(" "))
        blocks.append((indent, lines))
    return blocks


def _field_lines(lines: list[str]) -> list[re.Match[str]] | None:
    """A block of "Label: value" lines (an order form's particulars), one match per line; None for any other."""
    matches = [_FIELD.match(line.strip()) for line in lines]
    fields = [match for match in matches if match is not None]
    return fields if len(lines) > 1 and len(fields) == len(lines) else None


def build_story(text: str) -> list[Flowable]:
    """Turn a sample's text into reportlab flowables."""
    styles = getSampleStyleSheet()
    body = ParagraphStyle("body", parent=styles["BodyText"], fontName="Times-Roman", fontSize=11, leading=14)
    title = ParagraphStyle("title", parent=body, fontName="Times-Bold", fontSize=16, leading=20, alignment=TA_CENTER)
    centered = ParagraphStyle("centered", parent=body, alignment=TA_CENTER)
    heading = ParagraphStyle("heading", parent=body, fontName="Times-Bold", spaceBefore=10, alignment=TA_CENTER)
    item = ParagraphStyle("item", parent=body, leftIndent=0.4 * inch)
    code = ParagraphStyle("code", parent=styles["Code"], fontSize=9, leading=11, leftIndent=0.25 * inch)

    story: list[Flowable] = []
    in_appendix_notice = False
    for index, (indent, lines) in enumerate(_blocks(text)):
        joined = " ".join(line.strip() for line in lines)
        if index == 0:
            # Title block: "Apache License", version line, URL.
            story.append(Paragraph(escape(lines[0].strip()), title))
            story.extend(Paragraph(escape(line.strip()), centered) for line in lines[1:])
            story.append(Spacer(1, 12))
        elif joined.isupper() or joined.startswith("APPENDIX"):
            story.append(Paragraph(escape(joined), heading))
        elif fields := _field_lines(lines):
            # Particulars keep a line each, their labels bold, as an order form prints them.
            story.extend(Paragraph(f"<b>{escape(f[1])}:</b> {escape(f[2])}", item) for f in fields)
            story.append(Spacer(1, 6))
        elif in_appendix_notice or (indent <= 3 and joined.startswith("Copyright [")):
            # The boilerplate notice is meant to be pasted as is: keep its lines.
            in_appendix_notice = True
            common = min(len(line) - len(line.lstrip(" ")) for line in lines if line.strip())
            story.append(Preformatted("\n".join(line[common:] for line in lines), code))
            story.append(Spacer(1, 6))
        elif joined.startswith("("):
            story.append(Paragraph(escape(joined), item))
        else:
            match = _SECTION.match(joined)
            if match:
                # Bold section title; the numbering stays part of the text.
                story.append(Paragraph(f"<b>{escape(match.group(1))}</b>{escape(match.group(2))}", body))
            else:
                story.append(Paragraph(escape(joined), body))
    return story


def write_sample(name: str, target: Path) -> None:
    """Typeset sample `name` (a key of SAMPLES) into the PDF `target`."""
    title, author = SAMPLES[name]
    text = (SAMPLE_DIR / f"{name}.txt").read_text(encoding="utf-8")
    doc = SimpleDocTemplate(
        str(target),
        pagesize=LETTER,
        leftMargin=1.1 * inch,
        rightMargin=1.1 * inch,
        topMargin=1 * inch,
        bottomMargin=1 * inch,
        title=title,
        author=author,
        subject="Sample document for infokv-rag",
        invariant=1,  # no timestamps or random IDs: the same text gives the same bytes
    )
    doc.build(build_story(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(SAMPLES)} (default: all)")
    parser.add_argument("--out-dir", type=Path, default=SAMPLE_DIR, help=f"where the PDFs go (default: {SAMPLE_DIR})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in SAMPLES]
    if unknown:
        parser.error(f"no sample named {', '.join(unknown)}; the samples: {', '.join(SAMPLES)}")
    for name in args.names or SAMPLES:
        target = args.out_dir / f"{name}.pdf"
        write_sample(name, target)
        print(f"wrote {target} ({target.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
