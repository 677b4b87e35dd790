"""The `infokv-rag` command line, run as a user runs it: a subprocess, its exit code, stdout and stderr.

Bad documents and options are rejected before any model loads (the CLI reads the document first): those cases run
`cli.main` in this process (`cli_in_process`: the same exit code, stdout and stderr), where a subprocess would spend
seconds on imports per case. The cases that answer use the random 3-layer model from conftest, never a real one.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infokv_rag.cli import build_parser
from infokv_rag.config import CompressionConfig
from infokv_rag.errors import ConfigError
from infokv_rag.store import FORMAT_VERSION

from . import pdf_factory as pdfs
from .conftest import CORPUS
from .helpers import build_hub_cache

PAGES = ["Alpha page one.\nThe notice period is thirty days.", "Beta page two."]
TEXT = " ".join(CORPUS * 2)


def run_cli(
    *args: str,
    cache_dir: Path,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    closed_stdout: bool = False,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI run in a subprocess (in `cwd`); with `closed_stdout`, its stdout a pipe whose reader has gone
    (`... | head`)."""
    env = {
        **os.environ,
        "INFOKV_CACHE_DIR": str(cache_dir),
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
        **(env or {}),
    }
    command = [sys.executable, "-m", "infokv_rag.cli", *args]
    if not closed_stdout:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(command, stdout=writer, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout)
    finally:
        os.close(writer)


CliRunner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """`run_cli`'s signature and result, for runs that end before any model loads, through `cli.main` here."""
    from infokv_rag import cli

    def run(*args: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
        monkeypatch.setenv("INFOKV_CACHE_DIR", str(cache_dir))
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:  # argparse's usage errors
            assert isinstance(exit_.code, int), exit_.code
            code = exit_.code
        output = capsys.readouterr()
        return subprocess.CompletedProcess(["infokv-rag", *args], code, output.out, output.err)

    return run


def assert_clean_failure(result: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """Exit code 2, one actionable `infokv-rag: error:` message naming `phrases`, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("infokv-rag: error: "), result.stderr
    message = result.stderr.lower()
    for phrase in phrases:
        assert phrase.lower() in message, (phrase, result.stderr)


# Each case: a builder writing the bad file, extra CLI arguments, phrases the message must contain
# (what is wrong and what to do about it).
BAD_INPUTS: dict[str, tuple[Callable[[Path], Path], tuple[str, ...], tuple[str, ...]]] = {
    "encrypted-without-password": (
        lambda d: pdfs.encrypted_pdf(d / "locked.pdf", PAGES, "s3cret"),
        (),
        ("locked.pdf", "encrypted", "needs a password", "--password"),
    ),
    "wrong-password": (
        lambda d: pdfs.encrypted_pdf(d / "locked.pdf", PAGES, "s3cret"),
        ("--password", "guess"),
        ("locked.pdf", "wrong password", "--password"),
    ),
    "image-only": (
        lambda d: pdfs.image_only_pdf(d / "scan.pdf"),
        (),
        ("scan.pdf", "no extractable text", "ocr"),
    ),
    "corrupt": (
        lambda d: pdfs.corrupt_pdf(d / "broken.pdf"),
        (),
        ("broken.pdf", "damaged", "repair"),
    ),
    "truncated": (
        lambda d: pdfs.truncated_pdf(d / "cut.pdf", PAGES),
        (),
        ("cut.pdf", "truncated", "download or export it again"),
    ),
    "not-a-pdf": (
        lambda d: _write(d / "photo.pdf", b"\x89PNG\r\n\x1a\n" + bytes(200)),
        (),
        ("photo.pdf", "not a pdf", "png image"),
    ),
    "binary-not-a-document": (
        lambda d: _write(d / "archive.txt", b"PK\x03\x04" + bytes(range(256)) * 4),
        (),
        ("archive.txt", "not a supported document", "zip"),
    ),
    "too-much-content": (
        lambda d: pdfs.heavy_content_pdf(d / "heavy.pdf", 2, 600_000),
        ("--pdf-content-limit", "1000000"),
        ("heavy.pdf", "1,000,000 bytes", "split the pdf"),
    ),
    "empty-file": (
        lambda d: _write(d / "empty.txt", b""),
        (),
        ("empty.txt", "empty", "0 bytes"),
    ),
    "nonexistent-file": (
        lambda d: d / "missing.pdf",
        (),
        ("missing.pdf", "no such file"),
    ),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_document_exits_2_with_actionable_message(
    case: str, tmp_path: Path, random_model_dir: Path, cli_in_process: CliRunner
) -> None:
    build, extra, phrases = BAD_INPUTS[case]
    path = build(tmp_path)
    result = cli_in_process(
        "ask",
        str(path),
        "-q",
        "What is the notice period?",
        "--model",
        str(random_model_dir),
        "--store",
        str(tmp_path / "store"),
        *extra,
        cache_dir=tmp_path / "cache",
    )
    assert_clean_failure(result, *phrases)
    assert not (tmp_path / "store").exists(), "nothing is stored for a document that cannot be read"


def test_json_mode_reports_errors_as_json(tmp_path: Path) -> None:
    result = run_cli("ask", str(tmp_path / "missing.pdf"), "-q", "Q?", "--json", cache_dir=tmp_path)
    assert result.returncode == 2 and "missing.pdf" in result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "FileNotFoundError" and "missing.pdf" in error["message"]


def test_bad_options_and_model_exit_2(tmp_path: Path, cli_in_process: CliRunner) -> None:
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    assert_clean_failure(cli_in_process("ask", str(doc), "-q", "Q?", "--keep", "0", cache_dir=tmp_path), "keep")
    assert_clean_failure(
        cli_in_process("ask", str(doc), "-q", "Q?", "--max-new-tokens", "0", cache_dir=tmp_path), "max-new-tokens"
    )
    assert_clean_failure(cli_in_process("info", str(tmp_path), cache_dir=tmp_path), "not a saved document cache")
    # The model resolves after the document loads: an unknown model is refused, with the choices; as a process too.
    assert_clean_failure(
        run_cli("ask", str(doc), "-q", "Q?", "--model", str(tmp_path / "no-such-model"), cache_dir=tmp_path),
        "cannot resolve model",
        "default, tiny",
    )


def test_keep_1_is_refused_as_the_count_of_one_token_it_would_be(capsys: pytest.CaptureFixture[str]) -> None:
    """`--keep 1` reads as "keep everything" but is a count of one token, which compresses harder than the default:
    refused, pointing to 1.0. A ratio of 1.0 and other counts parse as before."""
    parser = build_parser()
    with pytest.raises(SystemExit) as refusal:
        parser.parse_args(["ask", "doc.txt", "-q", "Q?", "--keep", "1"])
    assert refusal.value.code == 2
    assert "write 1.0 to keep every token, or a count above the 36 and more always kept" in capsys.readouterr().err
    for keep, parsed in (("1.0", 1.0), ("2", 2), ("512", 512), ("0.25", 0.25)):
        assert repr(parser.parse_args(["ingest", "doc.txt", "--out", "out", "--keep", keep]).keep) == repr(parsed)


def test_usage_errors_come_as_json_too_when_json_is_asked_for(tmp_path: Path) -> None:
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    result = run_cli("ask", str(doc), "-q", "Q?", "--json", "--keep", "1", cache_dir=tmp_path)
    assert result.returncode == 2 and "usage:" in result.stderr and "write 1.0" in result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "UsageError" and "write 1.0 to keep every token" in error["message"]
    plain = run_cli("ask", str(doc), "-q", "Q?", "--keep", "1", cache_dir=tmp_path)
    assert plain.returncode == 2 and plain.stdout == ""


def test_a_warning_is_one_line_whatever_the_document_put_in_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A PDF's own names reach warnings through pypdf's errors (a filter named "/X#0AINFO: ..."): written as they
    were, they forged lines of the service's log."""
    from infokv_rag.cli import _show_warning
    from infokv_rag.pdf_damage import pypdf_detail

    forged = 'Unsupported filter /X\nINFO:     127.0.0.1:1 - "GET /forged HTTP/1.1" 200 OK'
    detail = pypdf_detail(NotImplementedError(forged))
    assert "\n" not in detail and "/X\\nINFO:" in detail
    _show_warning(UserWarning("skipped page 2 (\x1b[31m\rforged\u2028line)"), UserWarning)
    written = capsys.readouterr().err
    assert written.count("\n") == 1 and "\\x1b[31m\\rforged\\u2028line" in written, written
    # Text that forges no line is kept as it is: a no-break or ideographic space, a joiner, another script.
    kept = "日本語\u3000報告書, price\xa0100 €, 👨\u200d👩, café"
    assert pypdf_detail(ValueError(kept)) == kept


def test_keep_and_summaries_are_refused_for_a_method_that_keeps_every_token() -> None:
    """Taken and dropped, they would show in the cache's config (`info`) as what was done, and give the same full
    cache another store key per value."""
    from infokv_rag.cli import _config

    parser = build_parser()
    for given, named in ((["--keep", "0.1"], "--keep"), (["--summaries", "64"], "--summaries")):
        with pytest.raises(ConfigError, match=f"{named} set what compression keeps; method full keeps every token"):
            _config(parser.parse_args(["ingest", "doc.txt", "--out", "out", "--method", "full", *given]))
    assert _config(parser.parse_args(["ingest", "doc.txt", "--out", "out", "--method", "full"])).keep == 0.25
    defaults = _config(parser.parse_args(["ingest", "doc.txt", "--out", "out"]))
    assert (defaults.keep, defaults.summaries) == (CompressionConfig.keep, CompressionConfig.summaries)


def test_a_damaged_model_exits_2_and_fetch_verifies_what_it_prints(tmp_path: Path, random_model_dir: Path) -> None:
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    damaged = Path(shutil.copytree(random_model_dir, tmp_path / "damaged"))
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run_cli("ask", str(doc), "-q", "Q?", "--model", str(damaged), "--json", cache_dir=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "ModelError" and f"{weights} is damaged" in error["message"]
    assert_clean_failure(run_cli("fetch", str(damaged), cache_dir=tmp_path), f"{weights} is damaged", "complete copy")


def test_ask_json_then_again_reuses_the_stored_cache(tmp_path: Path, random_model_dir: Path) -> None:
    doc = _write(tmp_path / "contract.txt", TEXT.encode())
    store = tmp_path / "store"
    args = (
        "ask",
        str(doc),
        "-q",
        "What is the notice period?",
        "-q",
        "Who delivers the goods?",
        "--model",
        str(random_model_dir),
        "--store",
        str(store),
        "--max-new-tokens",
        "6",
        "--json",
    )
    first = run_cli(*args, "--verbose", cache_dir=tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["reused_cache"] is False
    assert [a["question"] for a in out["answers"]] == ["What is the notice period?", "Who delivers the goods?"]
    for answer in out["answers"]:
        assert answer["answer"] and answer["completion_tokens"] == 6 and answer["time_to_first_token"] > 0
    stats = out["stats"]
    assert stats["method"] == "infokv" and stats["keep"] == 0.25
    assert stats["document_tokens"] > 100 and 0 < stats["cache_bytes"] < stats["full_cache_bytes"]
    assert Path(out["cache"]).parent == store and (Path(out["cache"]) / "manifest.json").is_file()
    # --verbose shows the prefill progress bar (tokens/s, ETA) on stderr, never on stdout, and before it the fit
    # of the model's surrogate that infokv's first use makes (minutes on a real model).
    assert "tok/s" in first.stderr and "ETA" in first.stderr and "tok/s" not in first.stdout
    assert "fitting the reconstruction surrogate (once per model) [" in first.stderr

    second = run_cli(*args, cache_dir=tmp_path / "cache")
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert again["reused_cache"] is True
    assert again["cache"] == out["cache"]
    assert [a["answer"] for a in again["answers"]] == [a["answer"] for a in out["answers"]]
    assert again["stats"]["prefill_seconds"] == stats["prefill_seconds"], "stats come from the stored ingestion"
    assert "tok/s" not in second.stderr, "no prefill the second time"
    assert sorted(p.name for p in store.iterdir()) == [Path(out["cache"]).name], "no leftovers in the store"


def test_ingest_out_then_info(tmp_path: Path, random_model_dir: Path) -> None:
    pdf = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, "s3cret")
    out_dir = tmp_path / "caches" / "locked"
    ingest = run_cli(
        "ingest",
        str(pdf),
        "--out",
        str(out_dir),
        "--password",
        "s3cret",
        "--model",
        str(random_model_dir),
        "--method",
        "snapkv",
        "--keep",
        "40",
        cache_dir=tmp_path / "cache",
    )
    assert ingest.returncode == 0, ingest.stderr
    saved = json.loads(ingest.stdout)
    assert Path(saved["saved"]) == out_dir.resolve()
    assert saved["method"] == "snapkv" and saved["keep"] == 40 and saved["pages"] == 2
    kept = saved["kept_tokens_per_layer"]
    assert len(kept) == 3 and max(kept) < saved["document_tokens"]

    info = run_cli("info", str(out_dir), cache_dir=tmp_path / "cache")
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["config"]["method"] == "snapkv" and described["config"]["keep"] == 40
    assert described["document"]["pages"] == 2 and described["document"]["source"] == str(pdf)
    assert described["tokens"]["kept_per_layer"] == kept
    assert described["model"]["name"] == str(random_model_dir)
    assert described["format_version"] == FORMAT_VERSION
    # A reader that stops early (`| head -c 3`) ends the run quietly, as it ends a Unix tool (128 + SIGPIPE).
    closed = run_cli("info", str(out_dir), cache_dir=tmp_path / "cache", closed_stdout=True)
    assert (closed.returncode, closed.stderr) == (141, "")
    # So does an error that --json also writes to stdout (a traceback of BrokenPipeError, exit 1, before).
    for refused in (
        ["info", str(tmp_path / "missing"), "--json"],
        ["ask", str(pdf), "-q", "Q?", "--keep", "1", "--json"],
    ):
        closed = run_cli(*refused, cache_dir=tmp_path / "cache", closed_stdout=True)
        assert closed.returncode == 141 and "error" in closed.stderr and "Traceback" not in closed.stderr, closed.stderr

    # `info` verifies checksums: a damaged cache is reported, not described.
    tensors = out_dir / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    assert_clean_failure(run_cli("info", str(out_dir), cache_dir=tmp_path / "cache"), "sha256", "ingest again")


def test_ask_answers_from_a_saved_cache_with_the_model_that_made_it(tmp_path: Path, random_model_dir: Path) -> None:
    """`ingest --out DIR` then `ask DIR` was refused as a directory that is no PDF or text file: a saved cache is
    answered as it was saved, by the model its manifest names (unless --model says another)."""
    document = tmp_path / "contract.txt"
    document.write_text(TEXT)
    out_dir = tmp_path / "saved"
    model = ("--model", str(random_model_dir))
    ingest = run_cli("ingest", str(document), "--out", str(out_dir), *model, cache_dir=tmp_path / "cache")
    assert ingest.returncode == 0, ingest.stderr
    question = ("-q", "What is the notice period?", "--max-new-tokens", "4", "--json")
    from_file = run_cli("ask", str(document), *question, *model, cache_dir=tmp_path / "cache")
    from_saved = run_cli("ask", str(out_dir), *question, cache_dir=tmp_path / "cache")
    assert from_saved.returncode == 0, from_saved.stderr
    answered = json.loads(from_saved.stdout)
    assert answered["cache"] == str(out_dir) and answered["reused_cache"]
    assert answered["model"]["name"] == str(random_model_dir)
    assert answered["answers"][0]["answer"] == json.loads(from_file.stdout)["answers"][0]["answer"]
    refused = run_cli("ask", str(out_dir), "-q", "Q?", "--keep", "0.5", cache_dir=tmp_path / "cache")
    assert_clean_failure(refused, "is a saved cache", "--keep do not apply")

    # A model named by a relative path is named by its absolute one in the manifest, so it answers from anywhere (the
    # relative name was recorded: from elsewhere it named nothing, and was tried as a hub id).
    relative = ("--model", random_model_dir.name)
    saved_here = ("ingest", str(document), "--out", str(tmp_path / "relative"), *relative)
    assert run_cli(*saved_here, cache_dir=tmp_path / "cache", cwd=random_model_dir.parent).returncode == 0
    elsewhere = run_cli("ask", str(tmp_path / "relative"), *question, cache_dir=tmp_path / "cache", cwd=tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert Path(json.loads(elsewhere.stdout)["model"]["name"]).resolve() == random_model_dir.resolve()

    # A stdout that cannot encode a question or an answer gets it escaped (a UnicodeEncodeError mid-answer, before).
    ascii_only = {"PYTHONIOENCODING": "ascii"}
    questions = ("-q", "Où est le préavis?", "-q", "Q?", "--max-new-tokens", "4")
    escaped = run_cli("ask", str(out_dir), *questions, cache_dir=tmp_path / "cache", env=ascii_only)
    assert escaped.returncode == 0 and "O\\xf9 est le pr\\xe9avis?" in escaped.stdout, escaped.stderr


def test_ingest_never_replaces_what_is_not_a_cache(tmp_path: Path) -> None:
    """`--out` names a directory that a save replaces whole: a file, a directory of other files (or of files that
    only share a cache's names) or a path that cannot be made is refused before the model loads (a model that does
    not exist shows that it never loaded), and left as it was."""
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.docx").write_text("important")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "document.txt").write_text("my input")
    notes = _write(tmp_path / "notes.txt", b"my notes")
    refusals = (
        (victim, "other files", "new or empty directory"),
        (inputs, "not a cache that infokv-rag saved", "new or empty directory"),
        (notes, "not a cache directory", "another path"),
        (notes / "cache", "is not a directory", "another path"),
    )
    for out, *phrases in refusals:
        result = run_cli(
            "ingest", str(doc), "--out", str(out), "--model", str(tmp_path / "no-such-model"), cache_dir=tmp_path
        )
        assert_clean_failure(result, str(out), *phrases)
    assert (victim / "thesis.docx").read_text() == "important" and notes.read_bytes() == b"my notes"
    assert (inputs / "document.txt").read_text() == "my input"
    # An ask store that cannot be written, likewise before the model loads (not after reading the document).
    store = run_cli("ask", str(doc), "-q", "Q?", "--store", str(notes / "store"), "--model", "nope", cache_dir=tmp_path)
    assert_clean_failure(store, "cache store", "pass another --store")
    port = run_cli("serve", "--port", "99999", cache_dir=tmp_path)  # argparse's usage error, before any work
    assert port.returncode == 2 and "a port is from 0 to 65535, not 99999" in port.stderr


def test_bad_recall_options_exit_2_before_the_model_loads(tmp_path: Path, cli_in_process: CliRunner) -> None:
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    assert_clean_failure(cli_in_process("ask", str(doc), "-q", "Q?", "--recall", "1.5", cache_dir=tmp_path), "recall")
    assert_clean_failure(
        cli_in_process(
            "ingest", str(doc), "--out", str(tmp_path / "out"), "--method", "full", "--recall", "64", cache_dir=tmp_path
        ),
        "recall",
        "evicts",
    )


def test_bad_questions_exit_2_before_the_model_loads(tmp_path: Path, cli_in_process: CliRunner) -> None:
    """An empty question, or one that is not text (a byte that argv cannot decode), is refused with the options: an
    unknown --model would fail on loading, so the question's error must come first. Every -q is checked before any
    is answered, and a refusal names which one it is when there are several."""
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    nope = ("--model", str(tmp_path / "no-such-model"))
    for questions, phrases in (
        (("",), ("the question is empty",)),
        (("What is the notice period?", " \t\n"), ("question 2 of 2", "empty")),
        # The byte 0xff, as a shell passes $'fee\xff?': named as that byte, not as the lone surrogate Python made of it.
        (("fee\udcff?",), ("the byte 0xFF at character 3", "cannot decode: set a UTF-8 locale")),
    ):
        args = [arg for question in questions for arg in ("-q", question)]
        assert_clean_failure(cli_in_process("ask", str(doc), *args, *nope, cache_dir=tmp_path), *phrases)


def test_questions_that_cannot_fit_are_refused_before_the_prefill(tmp_path: Path, random_model_dir: Path) -> None:
    """A question too long for the context window beside the document, or a --max-new-tokens that is, is refused once
    the model (its tokenizer) is loaded, before the document is prefilled and stored, and before any other question
    is answered: no answer is produced to be lost."""
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    store = tmp_path / "store"
    common = ("ask", str(doc), "--model", str(random_model_dir), "--store", str(store), "--json", "--verbose")
    for extra, phrase in (
        (("-q", "What is the notice period?", "-q", "why? " * 3000), "question 2 of 2 (-q): the document"),
        (("-q", "What is the notice period?", "--max-new-tokens", "100000"), "--max-new-tokens (100000)"),
    ):
        result = run_cli(*common, *extra, cache_dir=tmp_path / "cache")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "loaded in" in result.stderr and "stored the cache" not in result.stderr and "tok/s" not in result.stderr
        error = json.loads(result.stdout)["error"]
        assert error["type"] == "AnswerRoomError" and phrase in error["message"], error
        assert "context window of 4096" in error["message"]
        # The advice names the flag, not the core's field.
        assert "lower --max-new-tokens" in error["message"] and "max_new_tokens" not in error["message"]
        assert not list(store.iterdir()), "nothing is prefilled or stored"


@pytest.mark.parametrize("failure", ["an error", "Ctrl-C"])
def test_json_keeps_the_answers_before_a_failing_question(
    tmp_path: Path,
    random_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: str,
) -> None:
    """A question that fails while answering (after every check passed), or is interrupted, loses none of the answers
    before it: --json prints them with the error, and the exit code is 2 (130 for Ctrl-C)."""
    from infokv_rag import cli
    from infokv_rag.document import CompressedDocument
    from infokv_rag.errors import ContextLengthError

    generate = CompressedDocument.generate
    asked: list[object] = []

    def second_fails(self: CompressedDocument, turns: Any, options: Any = None) -> Any:
        asked.append(turns)
        if len(asked) == 2:
            raise ContextLengthError("the second answer failed") if failure == "an error" else KeyboardInterrupt
        return generate(self, turns, options)

    monkeypatch.setattr(CompressedDocument, "generate", second_fails)
    monkeypatch.setenv("INFOKV_CACHE_DIR", str(tmp_path / "cache"))
    doc = _write(tmp_path / "doc.txt", TEXT.encode())
    questions = ("-q", "What is the notice period?", "-q", "Who delivers?", "-q", "Third?")
    args = ("--model", str(random_model_dir), "--store", str(tmp_path / "store"), "--max-new-tokens", "2", "--json")
    assert cli.main(["ask", str(doc), *questions, *args]) == (2 if failure == "an error" else 130)
    out = capsys.readouterr()
    payload = json.loads(out.out)
    assert [answer["question"] for answer in payload["answers"]] == ["What is the notice period?"]
    assert payload["answers"][0]["completion_tokens"] == 2 and payload["answers"][0]["answer"]
    if failure == "an error":
        assert payload["error"] == {"type": "ContextLengthError", "message": "the second answer failed"}
        assert "infokv-rag: error: the second answer failed" in out.err and len(asked) == 2
    else:
        assert payload["error"] == {"type": "KeyboardInterrupt", "message": "interrupted"}
        assert "infokv-rag: interrupted" in out.err and len(asked) == 2


def test_ingest_and_ask_with_a_cold_tier(tmp_path: Path, random_model_dir: Path) -> None:
    doc = _write(tmp_path / "contract.txt", " ".join(CORPUS * 6).encode())
    out_dir = tmp_path / "cold"
    common = ("--model", str(random_model_dir), "--keep", "0.25")
    ingest = run_cli(
        "ingest",
        str(doc),
        "--out",
        str(out_dir),
        *common,
        "--recall",
        "0.1",
        "--cold-bits",
        "8",
        "--summaries",
        "8",
        cache_dir=tmp_path / "cache",
    )
    assert ingest.returncode == 0, ingest.stderr
    saved = json.loads(ingest.stdout)
    assert 0 < saved["cache_bytes"] < saved["full_cache_bytes"] and saved["cold_bytes"] > 0
    info = run_cli("info", str(out_dir), cache_dir=tmp_path / "cache")
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["config"]["recall"] == 0.1 and described["config"]["cold_bits"] == 8
    assert described["config"]["summaries"] == 8
    cold = described["cold_tier"]
    assert cold["bits"] == 8 and cold["bytes"] == saved["cold_bytes"] and cold["file_bytes"] > cold["bytes"]

    ask: tuple[str, ...] = (
        "ask",
        str(doc),
        "-q",
        "What is the notice period?",
        *common,
        "--store",
        str(tmp_path / "store"),
    )
    ask += ("--max-new-tokens", "2", "--json")
    first_run = run_cli(*ask, "--recall", "16", "--verbose", cache_dir=tmp_path / "cache")
    first = json.loads(first_run.stdout)
    assert first["reused_cache"] is False and first["answers"][0]["recalled_tokens"] == 16 * 3
    # The cache named is the one written (its cold tier's width, left to the model, is part of its key).
    assert (Path(first["cache"]) / "manifest.json").is_file() and (Path(first["cache"]) / "cold.safetensors").is_file()
    assert f"stored the cache in {first['cache']}\n" in first_run.stderr
    assert first["stats"]["cold_bytes"] > 0 and first["stats"]["cache_bytes"] > 0
    # Another budget asks the stored cache (no second prefill); 0 recalls nothing, from the hot cache alone.
    second = json.loads(run_cli(*ask, "--recall", "4", cache_dir=tmp_path / "cache").stdout)
    assert second["reused_cache"] is True and second["answers"][0]["recalled_tokens"] == 4 * 3
    plain = json.loads(run_cli(*ask, cache_dir=tmp_path / "cache").stdout)
    assert plain["answers"][0]["recalled_tokens"] == 0 and plain["stats"]["cold_bytes"] == 0


def test_hub_id_device_and_dtype_offline(tmp_path: Path, random_model_dir: Path) -> None:
    """`--model org/name` reads the HF cache (offline, laid out here), `--device` and `--dtype` choose the placement."""
    repo = "infokv-test/random-llama"
    commit = build_hub_cache(tmp_path / "hf" / "hub", repo, random_model_dir)
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    fetched = run_cli("fetch", repo, cache_dir=tmp_path / "cache", env=offline)
    assert fetched.returncode == 0, fetched.stderr
    assert f"snapshots/{commit}" in fetched.stdout
    doc = _write(tmp_path / "contract.txt", TEXT.encode())
    out_dir = tmp_path / "saved"
    ingest = run_cli(
        "ingest",
        str(doc),
        "--out",
        str(out_dir),
        "--model",
        repo,
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--verbose",
        cache_dir=tmp_path / "cache",
        env=offline,
    )
    assert ingest.returncode == 0, ingest.stderr
    assert f"model {repo} loaded in" in ingest.stderr and "(cpu, bfloat16)" in ingest.stderr
    assert json.loads(run_cli("info", str(out_dir), cache_dir=tmp_path / "cache").stdout)["model"]["name"] == repo

    missing = run_cli("ask", str(doc), "-q", "Q?", "--model", "infokv-test/absent", cache_dir=tmp_path, env=offline)
    assert_clean_failure(missing, "infokv-test/absent", "not in the local hugging face cache", "HF_HUB_OFFLINE")
    bad = run_cli("ask", str(doc), "-q", "Q?", "--dtype", "int4", cache_dir=tmp_path)
    assert bad.returncode == 2 and "unknown dtype 'int4'" in bad.stderr and "Traceback" not in bad.stderr


def test_progress_bar_formats(tmp_path: Path) -> None:
    import io

    from infokv_rag.cli import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar("reading doc.pdf", enabled=True, stream=stream)
    bar(0, 4096)
    bar(2048, 4096)
    bar(4096, 4096)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].endswith("0/4096 tokens starting")  # shown before the first chunk's minutes
    assert "2048/4096 tokens" in lines[1] and "ETA" in lines[1] and "tok/s" in lines[2]
    silent = io.StringIO()
    ProgressBar("x", enabled=False, stream=silent)(1, 2)
    assert silent.getvalue() == ""


def test_progress_bar_times_the_work_from_its_start_not_from_its_making(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bar made before a surrogate's fit (90 s) counted the fit in the reading's rate: 21 tok/s where it read 140."""
    import io

    from infokv_rag import cli

    clock = [100.0]
    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    stream = io.StringIO()
    bar = cli.ProgressBar("reading doc.pdf", enabled=True, stream=stream)
    clock[0] += 90.0  # the fit, before the reading's first update
    bar(0, 4096)
    clock[0] += 2.0
    bar(2048, 4096)
    assert stream.getvalue().splitlines()[1].endswith("2048/4096 tokens 1,024 tok/s ETA 2s")


def test_progress_bar_on_a_terminal_blanks_what_a_longer_line_left(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from infokv_rag import cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = cli.ProgressBar("reading doc.pdf", enabled=True, stream=stream)
    for done, elapsed in ((2000, 2.0), (3000, 3.0)):  # 1,000 tok/s: ETA 10s, then 9s
        monkeypatch.setattr(cli.time, "perf_counter", lambda elapsed=elapsed: bar.started + elapsed)
        bar(done, 12_000)
    screen = ""
    for drawn in stream.getvalue().split("\r")[1:]:  # what the terminal shows after each redraw
        screen = drawn + screen[len(drawn) :]
    assert screen.rstrip() == "reading doc.pdf [#######.......................] 3000/12000 tokens 1,000 tok/s ETA 9s"


def test_calibrate_fits_the_surrogate_once_and_keeps_it(random_model_dir: Path, tmp_path: Path) -> None:
    first = run_cli("calibrate", "--model", str(random_model_dir), "--device", "cpu", cache_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    cached = Path(report["cached"])
    assert cached.parent == tmp_path / "surrogates" and cached.is_file()
    # A fit made because there is none yet shows its progress as --refit does (it takes minutes on a real model),
    # from before its first document; the model's loading draws no bar of transformers' into a pipe.
    assert "fitting the reconstruction surrogate" in first.stderr and "3/3 documents" in first.stderr, first.stderr
    assert "0/3 documents starting" in first.stderr and "Loading weights" not in first.stderr, first.stderr
    fit_lines = [line for line in first.stderr.splitlines() if "surrogate" in line]
    assert fit_lines and not any("tok" in line for line in fit_lines), "a fit counts documents, not tokens"
    stamp = cached.stat().st_mtime_ns
    again = run_cli("calibrate", "--model", str(random_model_dir), "--device", "cpu", cache_dir=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "fitting" not in again.stderr, "nothing to show when the fit is loaded"
    assert json.loads(again.stdout)["fingerprint"] == report["fingerprint"] and cached.stat().st_mtime_ns == stamp
    refit = run_cli("calibrate", "--model", str(random_model_dir), "--refit", cache_dir=tmp_path)
    assert refit.returncode == 0, refit.stderr
    assert "fitting the reconstruction surrogate" in refit.stderr and "3/3" in refit.stderr
    assert cached.stat().st_mtime_ns != stamp


def test_ingest_and_ask_with_the_cache_in_codes(tmp_path: Path, random_model_dir: Path) -> None:
    doc = _write(tmp_path / "contract.txt", " ".join(CORPUS * 6).encode())
    common = ("--model", str(random_model_dir), "--keep", "0.5")
    ingest = run_cli(
        "ingest", str(doc), "--out", str(tmp_path / "coded"), *common, "--stored-bits", "4", cache_dir=tmp_path
    )
    assert ingest.returncode == 0, ingest.stderr
    info = run_cli("info", str(tmp_path / "coded"), cache_dir=tmp_path)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["config"]["stored_bits"] == 4

    ask = ("ask", str(doc), "-q", "Who pays?", *common, "--store", str(tmp_path / "store"), "--max-new-tokens", "2")
    coded = json.loads(run_cli(*ask, "--stored-bits", "4", "--json", cache_dir=tmp_path).stdout)
    plain = json.loads(run_cli(*ask, "--json", cache_dir=tmp_path).stdout)
    # Another width is another cache: not reused, and its codes are a fraction of the entries' bytes.
    assert coded["reused_cache"] is False and plain["reused_cache"] is False
    assert 0 < coded["stats"]["cache_bytes"] < plain["stats"]["cache_bytes"] / 2
    refused = run_cli(*ask, "--stored-bits", "3", cache_dir=tmp_path)
    assert refused.returncode == 2 and "--stored-bits: invalid choice: 3 (choose from 4, 8)" in refused.stderr


def test_serve_takes_the_model_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from infokv_rag.cli import build_parser
    from infokv_rag.service.settings import Settings

    monkeypatch.setenv("INFOKV_MODEL", "tiny")
    assert Settings.from_env(model=build_parser().parse_args(["serve"]).model).model == "tiny"
    given = build_parser().parse_args(["serve", "--model", "default"]).model
    assert Settings.from_env(model=given).model == "default"


def test_serve_takes_a_path_prefix_for_uvicorn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--root-path` reaches uvicorn's config; a prefix that is not one is a usage error before any work, and
    Ray Serve, whose proxy serves the routes at /, refuses it."""
    from infokv_rag import cli
    from infokv_rag.service import app

    given: list[str] = []

    def run(server: app.DrainingServer, sockets: list[socket.socket]) -> None:
        given.append(server.config.root_path)
        for listening in sockets:
            listening.close()

    monkeypatch.setattr(app.DrainingServer, "run", run)
    monkeypatch.setenv("INFOKV_ALLOW_ANONYMOUS", "1")
    assert cli.main(["serve", "--model", "tiny", "--root-path", "/kb", "--data-dir", str(tmp_path / "data")]) == 0
    assert given == ["/kb"]
    for bad in ("kb", "/kb/", "//kb"):
        refused = run_cli("serve", "--root-path", bad, cache_dir=tmp_path)
        assert refused.returncode == 2 and "a path prefix starts with /" in refused.stderr, refused.stderr
    assert cli.main(["serve", "--ray", "--root-path", "/kb"]) != 0
    assert "--root-path is not taken with --ray" in capsys.readouterr().err


def test_serve_refuses_a_model_or_device_that_cannot_load_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """As `ask` refuses them (exit 2, one line), before the data directory is made: the app loads the model inside
    uvicorn's startup, which printed a traceback and exited 3."""
    from infokv_rag import cli

    monkeypatch.setenv("INFOKV_ALLOW_ANONYMOUS", "1")
    data = tmp_path / "data"
    refusals = [(["--model", "bogus"], "cannot resolve model 'bogus'")]
    if not torch.cuda.is_available():
        refusals.append((["--model", "tiny", "--device", "cuda"], "sees no CUDA GPU"))
    for options, told in refusals:
        assert cli.main(["serve", *options, "--port", "0", "--data-dir", str(data)]) == 2
        error = capsys.readouterr().err
        assert error.startswith("infokv-rag: error: ") and told in error and "Traceback" not in error, error
    # A port in use, likewise before the model loads (uvicorn bound it after the model had loaded, then exited 3).
    with socket.socket() as taken:
        # As uvicorn binds: with SO_REUSEADDR a second bind of the port passes, and only listening claims it.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert cli.main(["serve", "--model", "tiny", "--port", port, "--data-dir", str(data)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"infokv-rag: error: cannot listen on 127.0.0.1:{port}") and "--port" in error, error
    assert not data.exists()


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example_script(script: str, *args: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "INFOKV_CACHE_DIR": str(cache_dir), "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300, env=env
    )


def run_example_in_process(
    script: str, *args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """The example run as `python examples/SCRIPT ARGS` runs it (`__main__`, its exit code, stdout and stderr), in
    this process: a subprocess costs each example's imports again (torch, langchain, llama-index), ten seconds or
    more, for checks that end before any model loads."""
    path = EXAMPLES / script
    with monkeypatch.context() as patched:
        patched.syspath_prepend(str(EXAMPLES))  # as Python puts a script's own directory first
        patched.setattr(sys, "argv", [str(path), *args])
        capsys.readouterr()
        try:
            runpy.run_path(str(path), run_name="__main__")
            code: int | str | None = 0
        except SystemExit as exit_:
            code = exit_.code
    output = capsys.readouterr()
    assert isinstance(code, int), code
    return subprocess.CompletedProcess([str(path), *args], code, output.out, output.err)


@pytest.mark.parametrize("script", ["demo.py", "langchain_chain.py", "llamaindex_query_engine.py"])
def test_examples_refuse_bad_options_before_the_model_loads(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFOKV_CACHE_DIR", str(tmp_path))

    def run_example(*args: str) -> subprocess.CompletedProcess[str]:
        return run_example_in_process(script, *args, monkeypatch=monkeypatch, capsys=capsys)

    for keep, message in (
        ("0", "keep token count must be positive"),
        ("2.5", "keep ratio must be in (0, 1]"),
        ("1", "write 1.0 to keep every token"),
    ):
        # --model nope would fail on loading: the option error must come first.
        result = run_example("--keep", keep, "--model", "nope")
        assert result.returncode == 2 and message in result.stderr, result.stderr[-800:]
        assert "Traceback" not in result.stderr
    if script != "demo.py":
        missing = run_example("--document", str(tmp_path / "nope.pdf"))
        assert missing.returncode == 2 and "no such file" in missing.stderr.lower(), missing.stderr[-800:]
        assert missing.stderr.startswith(f"{script}: error: ") and missing.stderr.count("\n") == 1
    usage = run_example("--help")
    assert usage.returncode == 0 and "exit codes: 0 done;" in usage.stdout
    assert ("1 with --strict" in usage.stdout) == (script == "demo.py")
    # An error after the options (here a model that cannot load) is one line and exit 2 too, as the CLI reports it;
    # run as a user runs the script, so its imports, `__main__` and exit code are the real ones.
    unknown = run_example_script(script, "--model", str(tmp_path / "no-such-model"), cache_dir=tmp_path)
    assert unknown.returncode == 2, unknown.stderr[-800:]
    assert unknown.stderr.startswith(f"{script}: error: cannot resolve model") and unknown.stderr.count("\n") == 1


def test_examples_take_keep_as_a_token_count(tmp_path: Path, random_model_dir: Path) -> None:
    doc = _write(tmp_path / "contract.txt", " ".join(CORPUS * 6).encode())
    result = run_example_script(
        "langchain_chain.py",
        *("--model", str(random_model_dir), "--document", str(doc), "--keep", "48", "--max-tokens", "3"),
        *("-q", "Who signs?"),
        cache_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "infokv keep 48:" in result.stdout
    # A saved cache is answered by the model that made it, as `infokv-rag ask DIR` answers it (the examples loaded
    # `default` for it, then refused the cache as another model's).
    saved = tmp_path / "saved"
    ingest = ("ingest", str(doc), "--out", str(saved), "--model", str(random_model_dir), "--keep", "48")
    assert run_cli(*ingest, cache_dir=tmp_path).returncode == 0
    answered = run_example_script(
        "llamaindex_query_engine.py",
        "--document",
        str(saved),
        "--max-tokens",
        "3",
        "-q",
        "Who signs?",
        cache_dir=tmp_path,
    )
    assert answered.returncode == 0, answered.stderr[-2000:]


def test_prune_removes_stored_caches_as_told_and_refuses_without_a_limit(
    random_engine: Any, tmp_path: Path, cli_in_process: CliRunner
) -> None:
    from infokv_rag.documents import document_from_text
    from infokv_rag.store import CacheStore

    store = CacheStore(tmp_path / "cache" / "documents")
    config = CompressionConfig(keep=0.25)
    for text in (TEXT, " ".join(CORPUS)):
        store.ingest(random_engine, document_from_text(text), config)
    [older, newer] = store.entries()
    os.utime(older.path, (older.last_used - 86400 * 3,) * 2)

    assert_clean_failure(cli_in_process("prune", cache_dir=tmp_path / "cache"), "--max-size or --unused-for")
    for size in ("2X", "-1", "inf", "nan", "1e300G"):  # the last is finite until its unit multiplies it
        usage = cli_in_process("prune", "--max-size", size, cache_dir=tmp_path / "cache")
        assert usage.returncode == 2 and "a size is a number of bytes" in usage.stderr, (size, usage.stderr)
    for days in ("-1", "1e305"):
        usage = cli_in_process("prune", "--unused-for", days, cache_dir=tmp_path / "cache")
        assert usage.returncode == 2 and "a number of days at least 0" in usage.stderr, (days, usage.stderr)
    dry = cli_in_process("prune", "--unused-for", "1", "--dry-run", "--json", cache_dir=tmp_path / "cache")
    listed = json.loads(dry.stdout)
    assert dry.returncode == 0 and [entry["path"] for entry in listed["removed"]] == [str(older.path)]
    assert listed["left"] == {"entries": 1, "bytes": newer.bytes} and older.path.is_dir()
    done = cli_in_process("prune", "--unused-for", "1", cache_dir=tmp_path / "cache")
    assert done.returncode == 0 and f"removed {older.path} (" in done.stdout and "1 left" in done.stdout
    assert not older.path.exists() and newer.path.is_dir()
    emptied = cli_in_process("prune", "--max-size", "0", "--store", str(store.root), cache_dir=tmp_path / "other")
    assert emptied.returncode == 0 and "removed 1 cache(s)" in emptied.stdout and store.entries() == []


def test_main_run_in_process_leaves_the_callers_stdout_as_it_was(tmp_path: Path, cli_in_process: CliRunner) -> None:
    before = sys.stdout.errors
    assert before != "backslashreplace"
    result = cli_in_process("prune", "--max-size", "0", "--store", str(tmp_path / "store"), cache_dir=tmp_path)
    assert result.returncode == 0 and "removed 0 cache(s)" in result.stdout
    assert sys.stdout.errors == before


def test_an_interruption_is_told_on_a_line_of_its_own_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C mid-bar or mid-answer printed "...tokens startinginfokv-rag: interrupted"; into a pipe or a log the
    message stays its own first line, as scripts read it."""
    import io

    from infokv_rag import cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, told in ((Terminal(), "\ninfokv-rag: interrupted\n"), (io.StringIO(), "infokv-rag: interrupted\n")):
        monkeypatch.setattr(sys, "stderr", stream)
        cli.say_interrupted("infokv-rag")
        assert stream.getvalue() == told
