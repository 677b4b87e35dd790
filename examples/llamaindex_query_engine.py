"""A LlamaIndex query engine over one compressed document, answering with the pages it draws on.

    python examples/llamaindex_query_engine.py                     # the sample license PDF, default model
    python examples/llamaindex_query_engine.py --model tiny --document manual.pdf -q "What does valve V-2 do?"

Needs the `llamaindex` extra: pip install -e '.[llamaindex]'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infokv_rag import CompressionConfig
from infokv_rag.integrations.llama_index import DocumentQueryEngine

SAMPLE = Path(__file__).resolve().parent / "sample" / "apache-license-2.0.pdf"
SAMPLE_QUESTIONS = [
    "When was Version 2.0 of the Apache License issued (month and year)?",
    'In the definition of "Legal Entity", what share of the outstanding shares amounts to control?',
    "On what basis does the Licensor provide the Work, according to the Disclaimer of Warranty?",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default, tiny, a local HF directory or a .gguf file")
    parser.add_argument("--document", default=str(SAMPLE), help=".pdf/.txt/.md file or a saved cache directory")
    parser.add_argument("-q", "--question", action="append", help="ask this (repeatable); default: sample questions")
    parser.add_argument("--method", default="infokv", help="compression method (infokv, snapkv, full, ...)")
    parser.add_argument("--keep", type=float, default=0.25, help="share of the document's tokens kept in the cache")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer")
    args = parser.parse_args(argv)

    engine = DocumentQueryEngine.from_file(
        args.document,
        model=args.model,
        compression=CompressionConfig(method=args.method, keep=args.keep),
        max_tokens=args.max_tokens,
    )
    stats = engine.document.stats  # reads the document once; every query below reuses its cache
    print(
        f"document: {args.document} ({stats.pages} pages, {stats.document_tokens} tokens, "
        f"{stats.method} keep {stats.keep}: {stats.compression_ratio:.0%} of the full cache)"
    )
    for question in args.question or SAMPLE_QUESTIONS:
        response = engine.query(question)
        pages = ", ".join(node.node.metadata["page_label"] for node in response.source_nodes) or "none"
        print(f"Q: {question}")
        print(f"A: {' '.join(str(response).split())}")
        print(f"pages: {pages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
