"""What the framework examples share: the sample document, its questions and the command line.

Imported as `_common`: `python examples/<name>.py` puts the examples folder on sys.path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infokv_rag.cli import ratio_or_count
from infokv_rag.config import DEFAULT_METHOD, CompressionConfig
from infokv_rag.errors import ConfigError
from infokv_rag.scorers import method_names

SAMPLE = Path(__file__).resolve().parent / "sample" / "apache-license-2.0.pdf"
SAMPLE_QUESTIONS = [
    "When was Version 2.0 of the Apache License issued (month and year)?",
    'In the definition of "Legal Entity", what share of the outstanding shares amounts to control?',
    "On what basis does the Licensor provide the Work, according to the Disclaimer of Warranty?",
]


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The examples' options; `questions` holds the -q questions, else the sample questions, and `compression`
    the checked `CompressionConfig` (a wrong value stops here, before the model loads)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="default", help="default, tiny, a local HF directory or a .gguf file")
    parser.add_argument("--document", default=str(SAMPLE), help=".pdf/.txt/.md file or a saved cache directory")
    parser.add_argument("-q", "--question", action="append", help="ask this (repeatable); default: sample questions")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=method_names(), help="compression method")
    parser.add_argument(
        "--keep",
        type=ratio_or_count("--keep"),
        default=0.25,
        help="kept in the cache: ratio (0.25) or token count (512)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer")
    args = parser.parse_args(argv)
    args.questions = args.question or SAMPLE_QUESTIONS
    if not Path(args.document).exists():
        parser.error(f"--document: no such file or directory: {args.document}")
    try:
        args.compression = CompressionConfig(method=args.method, keep=args.keep)
    except ConfigError as error:
        parser.error(str(error))
    return args
