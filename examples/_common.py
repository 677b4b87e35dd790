"""What the examples share: the sample document, its questions, the command line and its exit codes.

Imported as `_common`: `python examples/<name>.py` puts the examples folder on sys.path.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from infokv_rag.cli import ERROR_EXIT, STDOUT_CLOSED_EXIT, ratio_or_count, run_reporting, saved_model_missing
from infokv_rag.config import DEFAULT_METHOD, CompressionConfig, parse_keep
from infokv_rag.documents import load_document
from infokv_rag.errors import ConfigError, DocumentError, ModelError
from infokv_rag.models import resolve_model
from infokv_rag.prompt import question_turns
from infokv_rag.scorers import method_names
from infokv_rag.store import MANIFEST, saved_model_name

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE = SAMPLE_DIR / "maintenance-agreement.pdf"
"""The examples' document: an agreement written for this project, so no model answers it from memory."""
SAMPLE_QUESTIONS = SAMPLE_DIR / "maintenance-agreement-questions.md"
DEFAULT_KEEP = 0.25


def read_questions(path: Path = SAMPLE_QUESTIONS) -> list[tuple[str, list[str]]]:
    """(question, accepted answer texts) from the markdown table of a sample's questions file."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append((cells[1], re.findall(r"`([^`]+)`", cells[2])))
    if not rows:
        raise DocumentError(f"no questions found in {path}: restore it from the repository (git checkout {path})")
    return rows


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The examples' options; `questions` holds the -q questions, else the sample questions, `compression` the
    checked `CompressionConfig` and `source` the loaded `Document` (None for a saved cache directory). A wrong
    value, or a document that cannot be read (damaged, encrypted without the right --password, not a document),
    stops here, before the model loads."""
    parser = argparse.ArgumentParser(description=description, epilog=exit_codes())
    parser.add_argument(
        "--model",
        default=None,
        help="default, tiny, a local HF directory or a .gguf file (default: default; a saved cache: the model that "
        "made it)",
    )
    parser.add_argument("--document", default=str(SAMPLE), help=".pdf/.txt/.md file or a saved cache directory")
    parser.add_argument("-q", "--question", action="append", help="ask this (repeatable); default: sample questions")
    parser.add_argument(
        "--method",
        choices=method_names(),
        help=f"compression method (default {DEFAULT_METHOD}; a saved cache: the one it was made with)",
    )
    parser.add_argument(
        "--keep",
        type=ratio_or_count("--keep", parse_keep),
        help=f"kept in the cache: ratio (default {DEFAULT_KEEP}; 1.0: every token) or token count (512); a saved "
        "cache: its own",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer")
    parser.add_argument("--password", default=None, help="opens an encrypted PDF")
    args = parser.parse_args(argv)
    args.questions = args.question or [question for question, _ in read_questions()]
    for question in args.questions:
        question_turns(question)  # an empty one is refused here, also where a chain's template would wrap it
    # Refusals below are errors of infokv-rag's or of the system: `run` reports them in one line, as the CLI does.
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    args.source = None  # a saved cache directory is verified when it loads
    saved_cache = (Path(args.document) / MANIFEST).is_file()
    if not saved_cache:
        args.source = load_document(args.document, password=args.password)
    if args.model is None:  # as `infokv-rag ask DIR` and the adapters answer a saved cache
        args.model = saved_model_name(args.document) if saved_cache else "default"
        if saved_cache:
            try:
                resolve_model(args.model)
            except ModelError as error:
                raise saved_model_missing(args.document, args.model, error) from None
    # A saved cache is answered with the compression it was made with (recall, codes, settings no flag here sets);
    # a --method or --keep given for it is checked against that.
    args.compression = None
    if not saved_cache or args.method is not None or args.keep is not None:
        method = args.method or DEFAULT_METHOD
        args.compression = CompressionConfig(method=method, keep=DEFAULT_KEEP if args.keep is None else args.keep)
    return args


def exit_codes(*own: str) -> str:
    """The exit codes an example's --help lists: 0, then `own` (its own codes, "N what"), then the shared ones."""
    codes = [
        "0 done",
        *own,
        f"{ERROR_EXIT} a wrong option or document, a model that cannot load, a cache of another model or any other "
        "error (one line on stderr)",
        f"{STDOUT_CLOSED_EXIT} stdout closed early (`| head`)",
    ]
    return "exit codes: " + "; ".join(codes)


def run(main: Callable[[], int], script: str) -> int:
    """`main()`'s exit code, or the example's own when it fails, as `infokv-rag` reports it (`run_reporting`)."""
    return run_reporting(main, Path(script).name)
