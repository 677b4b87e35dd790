"""A LangChain LCEL chain over one compressed document: read once, then asked question after question.

    python examples/langchain_chain.py                       # the sample license PDF, default model
    python examples/langchain_chain.py --model tiny --document contract.pdf -q "What is the notice period?"

Needs the `langchain` extra: pip install -e '.[langchain]'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from infokv_rag import CompressionConfig
from infokv_rag.integrations.langchain import ChatInfoKV

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
    questions = args.question or SAMPLE_QUESTIONS

    chat = ChatInfoKV(
        model=args.model,
        document=args.document,
        compression=CompressionConfig(method=args.method, keep=args.keep),
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
        for question in questions:
            print(f"Q: {question}")
            print("A: ", end="", flush=True)
            started = False
            for piece in chain.stream({"question": question}):
                piece = piece if started else piece.lstrip()
                started = started or bool(piece)
                print(piece, end="", flush=True)
            print()
    totals = next(iter(usage.usage_metadata.values()), {})
    print("usage: " + json.dumps(totals, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
