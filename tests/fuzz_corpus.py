"""A deterministic corpus of damaged, hostile and mislabelled uploads for the reliability suite.

`corpus()` yields (label, file name, bytes): seed PDFs and texts mutated (truncations, bit flips, chunks
dropped or repeated), random bytes, and hand-made hostile PDFs (huge declared lengths, a page tree that
loops, a billion pages claimed, deep nesting, a compression bomb) and wrong headers.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from pathlib import Path

from . import pdf_factory as pdfs

PAGES = [
    "Supply contract. The notice period is ninety days.\nThe penalty is 500 euros.",
    "The contract manager is Alice Smith.\nDisputes go to the courts of Lyon.",
]
TEXT = "Memo: the office closes at five on Fridays. Visitors sign in at the front desk.\n" * 8


def raw_pdf(objects: list[bytes]) -> bytes:
    """A PDF from raw object bodies (object 1 is the catalog), with a correct cross-reference table."""
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _page(contents: bytes) -> list[bytes]:
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >> >> >>"
    )
    return [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>", page, contents]


def _stream(data: bytes, extra: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(data), extra) + data + b"\nendstream"


def hostile_pdfs() -> Iterator[tuple[str, str, bytes]]:
    text = b"BT /F1 12 Tf 72 720 Td (The notice period is ninety days.) Tj ET"
    yield "plain raw pdf", "raw.pdf", raw_pdf(_page(_stream(text)))
    yield (
        "huge declared length",
        "length.pdf",
        raw_pdf(_page(b"<< /Length 99999999999 >>\nstream\n" + text + b"\nendstream")),
    )
    yield "negative length", "negative.pdf", raw_pdf(_page(b"<< /Length -5 >>\nstream\n" + text + b"\nendstream"))
    pages_loop = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
        b"<< /Type /Pages /Kids [2 0 R] /Count 1 >>",
    ]
    yield "page tree loop", "loop.pdf", raw_pdf(pages_loop)
    yield (
        "a billion pages claimed",
        "billion.pdf",
        raw_pdf(
            [
                b"<< /Type /Catalog /Pages 2 0 R >>",
                b"<< /Type /Pages /Kids [3 0 R] /Count 1000000000 >>",
                *_page(_stream(text))[2:],
            ]
        ),
    )
    yield "deep nesting", "nested.pdf", raw_pdf(_page(b"[" * 20_000 + b"]" * 20_000))
    yield "deep dictionary nesting", "dicts.pdf", raw_pdf(_page(b"<< /A " * 5_000 + b"1" + b" >>" * 5_000))
    bomb = zlib.compress(b" " * 20_000_000, 9)  # 20 MB of content from ~20 KB
    yield "compression bomb", "bomb.pdf", raw_pdf(_page(_stream(bomb, b"/Filter /FlateDecode ")))
    yield "undecodable filter", "filter.pdf", raw_pdf(_page(_stream(b"\x00garbage", b"/Filter /JBIG2Decode ")))
    yield "self-referencing object", "selfref.pdf", raw_pdf([b"<< /Type /Catalog /Pages 1 0 R >>"])
    yield (
        "xref pointing past the end",
        "xref.pdf",
        raw_pdf(_page(_stream(text))).replace(b"startxref\n", b"startxref\n9999999").rstrip(),
    )
    yield "only a header", "header.pdf", b"%PDF-1.7\n%%EOF\n"


def wrong_headers() -> Iterator[tuple[str, str, bytes]]:
    pdf = pdfs.text_pdf_bytes(PAGES)
    yield "pdf named .txt", "contract.txt", pdf
    yield "text named .pdf", "contract.pdf", TEXT.encode()
    yield "png named .pdf", "scan.pdf", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
    yield "zip named .txt", "notes.txt", b"PK\x03\x04" + bytes(400)
    yield "html named .pdf", "download.pdf", b"<!DOCTYPE html><html><body>Access denied</body></html>"
    yield "pdf header in text", "notes.md", b"# Notes\n\nEvery PDF starts with %PDF-1.7 as its header.\n"
    yield "utf-16 bom then junk", "odd.txt", b"\xff\xfe" + b"\x00\xd8" * 50
    yield "nul bytes in text", "nul.txt", TEXT.encode()[:200] + b"\x00" * 50 + TEXT.encode()[:200]
    yield "gb18030 text", "gb.txt", ("合同：通知期限为九十天。" * 10).encode("gb18030")
    yield "empty", "empty.txt", b""
    yield "whitespace", "blank.txt", b" \n\t\r\n " * 20


def _mutations(rng: random.Random, seed: bytes, count: int, label: str, name: str) -> Iterator[tuple[str, str, bytes]]:
    for index in range(count):
        data = bytearray(seed)
        kind = index % 4
        if kind == 0:  # truncation
            cut = rng.randrange(0, len(data))
            data = data[:cut]
        elif kind == 1:  # bit flips
            for _ in range(rng.randint(1, 24)):
                position = rng.randrange(len(data))
                data[position] ^= 1 << rng.randrange(8)
        elif kind == 2:  # a chunk dropped
            start = rng.randrange(len(data))
            del data[start : start + rng.randint(1, 512)]
        else:  # a chunk repeated
            start = rng.randrange(len(data))
            chunk = data[start : start + rng.randint(1, 256)]
            data[start:start] = chunk * rng.randint(2, 20)
        yield (
            f"{label} {('truncated', 'bit flips', 'chunk dropped', 'chunk repeated')[kind]} #{index}",
            name,
            bytes(data),
        )


def corpus(
    workdir: Path, pdf_mutations: int = 60, text_mutations: int = 16, random_files: int = 16
) -> list[tuple[str, str, bytes]]:
    """~310 cases. Mutated texts are mostly accepted and then read by the model, which costs far more
    than a refusal: fewer of them keep the suite's time bounded."""
    rng = random.Random(20240914)
    seeds = {
        "text pdf": ("contract.pdf", pdfs.text_pdf_bytes(PAGES), pdf_mutations),
        "encrypted pdf": (
            "locked.pdf",
            pdfs.encrypted_pdf(workdir / "locked.pdf", PAGES, "s3cret").read_bytes(),
            pdf_mutations,
        ),
        "scanned pdf": ("scan.pdf", pdfs.image_only_pdf(workdir / "scan.pdf", 1).read_bytes(), pdf_mutations),
        "raw pdf": ("raw.pdf", next(hostile_pdfs())[2], pdf_mutations),
        "utf-8 text": ("memo.txt", TEXT.encode(), text_mutations),
        "gb18030 text": ("gb.txt", ("合同：通知期限为九十天。" * 20).encode("gb18030"), text_mutations),
    }
    cases = [*hostile_pdfs(), *wrong_headers()]
    for label, (name, data, count) in seeds.items():
        cases.extend(_mutations(rng, data, count, label, name))
    for index in range(random_files):
        cases.append(
            (f"random bytes #{index}", rng.choice(["r.pdf", "r.txt", "r.bin"]), rng.randbytes(rng.randint(1, 4096)))
        )
    return cases
