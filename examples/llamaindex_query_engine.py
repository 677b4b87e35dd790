"""A LlamaIndex query engine over one compressed document, answering with the pages it draws on.

    python examples/llamaindex_query_engine.py                     # the sample maintenance agreement PDF, default model
    python examples/llamaindex_query_engine.py --model tiny --document manual.pdf -q "What does valve V-2 do?"

Needs the `llamaindex` extra: pip install -e '.[llamaindex]'.
"""

from __future__ import annotations

import sys

from _common import parse_args, run
from infokv_rag.integrations.llama_index import DocumentQueryEngine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)

    engine = DocumentQueryEngine.from_file(
        args.document,
        model=args.model,
        compression=args.compression,
        password=args.password,
        max_tokens=args.max_tokens,
    )
    stats = engine.document.stats  # reads the document once; every query below reuses its cache
    print(
        f"document: {args.document} ({stats.pages} pages, {stats.document_tokens} tokens, "
        f"{stats.method} keep {stats.keep}: {stats.compression_ratio:.0%} of the full cache)"
    )
    for question in args.questions:
        response = engine.query(question)
        pages = ", ".join(node.node.metadata["page_label"] for node in response.source_nodes) or "none"
        print(f"Q: {question}")
        print(f"A: {' '.join(str(response).split())}")
        print(f"pages: {pages}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main, __file__))
