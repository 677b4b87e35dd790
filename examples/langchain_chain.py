"""A LangChain LCEL chain over one compressed document: read once, then asked question after question.

    python examples/langchain_chain.py                       # the sample maintenance agreement PDF, default model
    python examples/langchain_chain.py --model tiny --document contract.pdf -q "What is the notice period?"

Needs the `langchain` extra: pip install -e '.[langchain]'.
"""

from __future__ import annotations

import json
import sys

from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from _common import parse_args, run
from infokv_rag.integrations.langchain import ChatInfoKV


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)

    chat = ChatInfoKV(
        model=args.model,
        document=args.source or args.document,  # the file as read (and decrypted) by parse_args, or a cache dir
        compression=args.compression,
        max_tokens=args.max_tokens,
    )
    prompt = ChatPromptTemplate.from_messages(
        [("human", "Question: {question}\nAnswer concisely, using only the document above.")]
    )
    chain = prompt | chat | StrOutputParser()

    # Reading the document is the one expensive step; every question after it costs only its own tokens.
    stats = chat.compressed_document().stats
    print(
        f"document: {args.document} ({stats.document_tokens} tokens, {stats.method} keep {stats.keep}: "
        f"cache {stats.cache_bytes / 2**20:.1f} MiB, {stats.compression_ratio:.0%} of full)"
    )
    with get_usage_metadata_callback() as usage:
        for question in args.questions:
            print(f"Q: {question}")
            print("A: ", end="", flush=True)
            started = False
            for piece in chain.stream({"question": question}):
                piece = piece if started else piece.lstrip()
                started = started or bool(piece)
                print(piece, end="", flush=True)
            print()
    totals = next(iter(usage.usage_metadata.values()), None)
    print("usage: " + json.dumps(totals or {}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(run(main, __file__))
