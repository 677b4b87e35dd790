"""Render an installed man page into the realdocs text format (how `sources/*.txt` were made).

    python benchmarks/realdocs/man2txt.py 5 journald.conf "journald.conf(5) - ..." [SECTION...]

prints the page as corpus text: '#' headings, one paragraph per blank-line separated block,
4-space indented preformatted blocks, table rows as 'cell | cell' lines. SEE ALSO, NOTES and
similar sections are dropped, plus any SECTION named on the command line. The man pages were
rendered on Debian 12 (man-db 2.11, groff 1.22); their code examples were re-indented by hand
afterwards (see README.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

DROP_SECTIONS = frozenset({"SEE ALSO", "NOTES", "COLOPHON", "AUTHOR", "AUTHORS", "REPORTING BUGS", "BUGS", "HISTORY"})
BOX = re.compile(r"^[\s\u2500\u250c\u2510\u2514\u2518\u251c\u2524\u252c\u2534\u253c\u2502]*$")
CELL = "\u2502"
FOLD = {
    "\u2018": "'",
    "\u2019": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u2014": "--",
    "\u2013": "-",
    "\u2022": "-",
    "\u2010": "-",
    "\u2212": "-",
    "\u00a0": " ",
    "\u00bd": " 1/2",
    "\u00b2": "^2",
}
Block = tuple[str, list[str]]


def render(section: str, name: str) -> list[str]:
    """The page as plain lines: very wide so that every filled paragraph is one line."""
    env = dict(os.environ, MANWIDTH="3000", LC_ALL="C.UTF-8")
    raw = subprocess.run(
        ["man", "-P", "cat", section, name], env=env, capture_output=True, text=True, check=True
    ).stdout
    plain = subprocess.run(["col", "-bx"], input=raw, capture_output=True, text=True, check=True).stdout
    for char, ascii_text in FOLD.items():
        plain = plain.replace(char, ascii_text)
    lines = [line.rstrip() for line in plain.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines[1:-1]  # the page header and footer lines


def blocks(lines: list[str]) -> list[Block]:
    """Section headings (indent 0), subsection headings (indent 3), table rows, and runs of
    consecutive lines at one indentation."""
    out: list[Block] = []
    current: list[str] = []
    current_indent = -1

    def flush() -> None:
        nonlocal current, current_indent
        if current:
            out.append(("body", current))
        current, current_indent = [], -1

    for line in lines:
        if not line.strip():
            flush()
            continue
        if BOX.match(line):
            continue
        indent = len(line) - len(line.lstrip(" "))
        text = line.strip()
        if CELL in text:
            flush()
            out.append(("row", [" | ".join(c.strip() for c in text.strip(CELL).split(CELL))]))
        elif indent in (0, 3):
            flush()
            out.append(("h2" if indent == 0 else "h3", [text]))
        else:
            if current and indent != current_indent:
                flush()
            current_indent = indent
            current.append(text)
    flush()
    return out


def _preformatted(body: list[str]) -> bool:
    return len(body) > 2 or (
        len(body) == 2
        and any(
            re.search(r"\S {2,}\S", b) or b.startswith(("#", "[", "$")) or ("=" in b and " " not in b.split("=")[0])
            for b in body
        )
    )


def to_text(title: str, parts: list[Block], drop: frozenset[str]) -> str:
    """Corpus text of the blocks, with `title` as the '#' heading."""
    paragraphs = [f"# {title}"]
    skipping = False
    for kind, body in parts:
        if kind == "h2":
            skipping = body[0] in DROP_SECTIONS | drop
            if not skipping:
                paragraphs.append("## " + body[0])
        elif skipping:
            continue
        elif kind == "h3":
            paragraphs.append("### " + body[0])
        elif kind == "row":
            paragraphs.append(body[0])
        elif _preformatted(body):
            paragraphs.append("\n".join("    " + b for b in body))
        else:
            paragraphs.extend(re.sub(r" {2,}", " ", b) for b in body)
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sec, page, heading = sys.argv[1:4]
    sys.stdout.write(to_text(heading, blocks(render(sec, page)), frozenset(sys.argv[4:])))
