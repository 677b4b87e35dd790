"""Saved caches: round trips across processes, refusal of anything damaged or foreign, crash safety,
and the cache store that turns a second ingestion of the same file into a load.

Unit tests use the random 3-layer model from conftest; one integration test per real model is marked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from safetensors.torch import load_file, save_file

from infokv_rag import (
    CacheStore,
    CacheStoreError,
    CacheUnreadableError,
    CompressedDocument,
    CompressionConfig,
    ConfigError,
    InfoKVEngine,
    scorers,
)
from infokv_rag import store as store_module
from infokv_rag.documents import Page, document_from_text, load_document
from infokv_rag.errors import NotARegularFileError
from infokv_rag.scorers.base import Method
from infokv_rag.scorers.infokv import WHOLE_WORDS_REVISION
from infokv_rag.signals import LayerBudgetSettings
from infokv_rag.store import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    STALE_SECONDS,
    TENSORS,
    TEXT,
    StoreWriteWarning,
    _manifest_checksum,
    _sha256,
    check_save_target,
    describe,
)

from .conftest import CORPUS
from .helpers import document_cache, resign

TEXT_A = " ".join(CORPUS * 2)
TEXT_B = " ".join(reversed(CORPUS * 3))
QUESTION = "What is the notice period?"
NEW_TOKENS = 8


def assert_same_document(loaded: CompressedDocument, original: CompressedDocument) -> None:
    assert loaded.document == original.document
    assert loaded.config == original.config
    assert loaded.stats == original.stats
    assert loaded.cache.document_tokens == original.cache.document_tokens
    assert loaded.cache.lengths == original.cache.lengths
    for got, want in zip(document_cache(loaded).layers, document_cache(original).layers, strict=True):
        for name in ("keys", "values", "positions", "scores"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    if original.information_reference is None:
        assert loaded.information_reference is None
    else:
        assert loaded.information_reference is not None
        assert torch.equal(loaded.information_reference, original.information_reference)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


# --- round trip ---------------------------------------------------------------------------------

ASK_IN_NEW_PROCESS = """
import json, sys
import torch
from infokv_rag import InfoKVEngine
engine = InfoKVEngine.from_pretrained(sys.argv[1], device="cpu")
doc = engine.load(sys.argv[2])
print(json.dumps({"answer": doc.ask(sys.argv[3], max_new_tokens=int(sys.argv[4])), "text": doc.document.text,
                  "kept": doc.stats.kept_tokens_per_layer}))
"""


def ask_in_new_process(model: str, cache: Path, question: str, new_tokens: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", ASK_IN_NEW_PROCESS, model, str(cache), question, str(new_tokens)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def doc_a(random_engine: InfoKVEngine) -> CompressedDocument:
    return random_engine.ingest_text(TEXT_A, CompressionConfig(keep=0.25))


@pytest.fixture(scope="module")
def saved_a(doc_a: CompressedDocument, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return doc_a.save(tmp_path_factory.mktemp("saved") / "a")


def test_a_cache_is_written_as_safetensors_writes_it_and_leaves_no_types_behind() -> None:
    """`safetensors_bytes` writes what `safetensors.torch.save` does, byte for byte, without its ctypes array type per
    byte size (kept by ctypes for the life of the process: every save of a new size grew a service for good)."""
    import ctypes
    import itertools

    from safetensors.torch import save

    from infokv_rag.files import safetensors_bytes

    dtypes = (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.int32, torch.float32, torch.int64)
    for order, chosen in enumerate(itertools.permutations(dtypes, 3)):
        tensors = {f"t{i}{'x' * (order % 3)}": torch.randn(i + 2, 3).to(dtype) for i, dtype in enumerate(chosen)}
        tensors["empty"] = torch.zeros(0, dtype=chosen[0])
        for metadata in (None, {"binding": "ab" * 32}):
            assert safetensors_bytes(tensors, metadata) == save(tensors, metadata=metadata), (chosen, metadata)
    types = len(ctypes._pointer_type_cache)  # type: ignore[attr-defined]
    for length in range(1000, 1040):
        safetensors_bytes({"keys": torch.randn(length)})
    assert len(ctypes._pointer_type_cache) == types  # type: ignore[attr-defined]


def test_save_load_in_new_process_gives_the_same_answer(
    random_engine: InfoKVEngine, random_model_dir: Path, doc_a: CompressedDocument, saved_a: Path
) -> None:
    before = doc_a.ask(QUESTION, max_new_tokens=NEW_TOKENS)
    assert sorted(p.name for p in saved_a.iterdir()) == sorted([MANIFEST, TENSORS, TEXT])
    assert sorted(p.name for p in saved_a.parent.iterdir()) == ["a"], "no staging leftovers"

    loaded = random_engine.load(saved_a)
    assert_same_document(loaded, doc_a)
    assert loaded.ask(QUESTION, max_new_tokens=NEW_TOKENS) == before

    other = ask_in_new_process(str(random_model_dir), saved_a, QUESTION, NEW_TOKENS)
    assert other["answer"] == before
    assert other["text"] == TEXT_A and other["kept"] == doc_a.stats.kept_tokens_per_layer


def test_pdf_page_map_survives(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    from .pdf_factory import text_pdf

    path = text_pdf(tmp_path / "contract.pdf", ["Page one: the notice period is thirty days.", "Page two."])
    doc = random_engine.ingest(path, CompressionConfig(method="snapkv", keep=50))
    assert doc.information_reference is None  # snapkv computes no entropy: the None must round-trip too
    loaded = random_engine.load(doc.save(tmp_path / "c"))
    assert_same_document(loaded, doc)
    assert loaded.document.source == str(path) and [page.number for page in loaded.document.pages] == [1, 2]
    assert loaded.document.page_of(loaded.document.text.index("Page two")) == 2


def test_a_cache_loaded_in_another_dtype_counts_the_bytes_it_holds(random_model_dir: Path, tmp_path: Path) -> None:
    """Entries are read into the loading engine's dtype: its stats count those, as an ingestion there would."""
    saver = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu", dtype="fp32")
    loader = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu", dtype="bf16")
    config = CompressionConfig(keep=0.25, recall=0.1)
    saved = saver.ingest_text(TEXT_A, config).save(tmp_path / "fp32")
    loaded, ingested = loader.load(saved), loader.ingest_text(TEXT_A, config)
    assert loaded.stats.cache_bytes == loaded.cache.nbytes == ingested.stats.cache_bytes
    assert (
        loaded.stats.full_cache_bytes
        == ingested.stats.full_cache_bytes
        == saver.load(saved).stats.full_cache_bytes // 2
    )
    assert loaded.cold_tier is not None and loaded.stats.cold_bytes == loaded.cold_tier.nbytes


@pytest.mark.parametrize("method", ["kvzip", "infokv_quality"])
def test_a_cache_with_global_layer_budgets_round_trips(
    random_engine: InfoKVEngine, tmp_path: Path, method: str
) -> None:
    config = CompressionConfig(method=method, keep=0.25, chunk_size=64, settings={"layer_budgets": "global"})
    doc = random_engine.ingest_text(TEXT_A, config)
    loaded = random_engine.load(doc.save(tmp_path / method))
    assert_same_document(loaded, doc)
    settings = loaded.config.settings
    assert isinstance(settings, LayerBudgetSettings) and settings.layer_budgets == "global"
    assert loaded.ask(QUESTION, max_new_tokens=NEW_TOKENS) == doc.ask(QUESTION, max_new_tokens=NEW_TOKENS)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_cache_saved_to_a_new_path_has_the_mode_the_umask_gives(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, mask: int
) -> None:
    """Its staging directory was made private (0700) and installed as it was: a cache saved by one user for a
    service account to load could not be read, where one saved into an empty directory could."""
    previous = os.umask(mask)
    try:
        target = doc_a.save(tmp_path / "new" / "c")
        store = CacheStore(tmp_path / "store")
        store.ingest(random_engine, doc_a.document, doc_a.config)
    finally:
        os.umask(previous)
    assert (target.stat().st_mode & 0o777) == 0o777 & ~mask
    entry = store.path_for(random_engine, doc_a.document, doc_a.config)
    assert (entry.stat().st_mode & 0o777) == 0o700, "a cache store's entry stays private (it holds the text)"


def test_save_replaces_an_existing_cache(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path
) -> None:
    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    target = doc_a.save(tmp_path / "c")
    assert doc_b.save(target) == target
    assert_same_document(random_engine.load(target), doc_b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "the retired cache is removed"
    # A damaged cache is replaced too, keeping the directory's permissions; an empty directory is filled.
    _flip_byte(target / TENSORS)
    target.chmod(0o750)
    assert doc_a.save(target) == target
    assert (target.stat().st_mode & 0o777) == 0o750
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty").chmod(0o751)
    assert_same_document(random_engine.load(doc_a.save(tmp_path / "empty")), doc_a)
    assert ((tmp_path / "empty").stat().st_mode & 0o777) == 0o751
    # Never what is not a cache: a save replaces the whole directory.
    (target / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for refused in (target, tmp_path / "file", tmp_path / "file" / "under"):
        with pytest.raises(CacheStoreError, match="another path|other files"):
            doc_b.save(refused)
    assert (target / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert_same_document(random_engine.load(target), doc_a)
    # Nor files that only share a cache's names: the user's own document.txt, or a cache's files whose manifest
    # is not one infokv-rag wrote.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / TEXT).write_text("my input")
    (target / "notes.txt").unlink()
    (target / MANIFEST).write_text('{"format_version": 8}')
    for refused in (mine, target):
        with pytest.raises(CacheStoreError, match="not a cache that infokv-rag saved"):
            doc_b.save(refused)
    assert (mine / TEXT).read_text() == "my input" and (target / TENSORS).is_file()
    # Another tool's manifest.json beside the user's own document.txt is not a later release's cache, whatever
    # format it claims.
    (mine / MANIFEST).write_text(json.dumps({"format_version": 11, "library_version": "3.2.0", "files": ["notes"]}))
    with pytest.raises(CacheStoreError, match="not a cache that infokv-rag saved"):
        doc_b.save(mine)
    assert (mine / TEXT).read_text() == "my input"
    # A later release's cache is ours: loading it says to ingest the document again, and saving that is allowed.
    shutil.rmtree(target)
    doc_a.save(target)
    _edit_manifest(target, lambda m: m.update(format_version=FORMAT_VERSION + 1, checksum="of another scheme"), False)
    with pytest.raises(CacheStoreError, match=f"uses cache format {FORMAT_VERSION + 1}"):
        random_engine.load(target)
    assert_same_document(random_engine.load(doc_b.save(target)), doc_b)


# --- refusals -----------------------------------------------------------------------------------


def _flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(directory: Path, edit: Callable[[dict[str, Any]], object], recompute_checksum: bool) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    edit(manifest)
    if recompute_checksum:
        manifest["checksum"] = _manifest_checksum(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _with_nan(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    broken = tensors[name].clone()
    broken.view(-1)[0] = float("nan")
    return {**tensors, name: broken}


DAMAGE = {
    # one flipped bit deep inside the key/value data
    "tensors-one-byte": (lambda d: _flip_byte(d / TENSORS, 0.7), r"tensors\.safetensors fails its sha256 check"),
    "text-one-byte": (lambda d: _flip_byte(d / TEXT, 0.3), r"document\.txt fails its sha256 check"),
    "tensors-truncated": (lambda d: _truncate(d / TENSORS), r"tensors\.safetensors fails its sha256 check \(truncated"),
    "tensors-missing": (lambda d: (d / TENSORS).unlink(), r"tensors\.safetensors is missing"),
    "manifest-edited": (
        lambda d: _edit_manifest(d, lambda m: m["tokens"].update(document=m["tokens"]["document"] + 1), False),
        r"manifest\.json fails its checksum \(edited or damaged\)",
    ),
    "manifest-model-swapped": (
        lambda d: _edit_manifest(d, lambda m: m["model"].update(fingerprint="0" * 64), False),
        r"fails its checksum",
    ),
    "manifest-garbage": (
        lambda d: (d / MANIFEST).write_bytes(b'{"format_version": 1, "chec'),
        r"manifest\.json is damaged",
    ),
    "manifest-missing": (lambda d: (d / MANIFEST).unlink(), r"is not a saved document cache \(no manifest\.json\)"),
    "unknown-format-version": (
        lambda d: _edit_manifest(d, lambda m: m.update(format_version=FORMAT_VERSION + 1), True),
        rf"uses cache format {FORMAT_VERSION + 1}, "
        rf"but this version of infokv-rag reads formats 2, 3, 4, 5, 6, 7, 8, 9 and {FORMAT_VERSION}",
    ),
    # Consistent manifests (re-signed, as a broken tool would) holding fields in other shapes.
    "manifest-stats-a-list": (
        lambda d: _edit_manifest(d, lambda m: m.update(stats=list(m["stats"])), True),
        r"incomplete or malformed manifest \(AttributeError",
    ),
    "manifest-files-a-list": (
        lambda d: _edit_manifest(d, lambda m: m.update(files=list(m["files"])), True),
        r"incomplete or malformed manifest|cannot be parsed",
    ),
    "manifest-token-count-infinite": (  # json writes float("inf") as Infinity
        lambda d: _edit_manifest(d, lambda m: m["tokens"].update(document=float("inf")), True),
        r"incomplete or malformed manifest \(OverflowError",
    ),
    "manifest-token-count-other": (
        lambda d: _edit_manifest(d, lambda m: m["tokens"].update(document=m["tokens"]["document"] - 1), True),
        r"says its document is \d+ tokens, but its text reads as \d+",
    ),
    "keys-nan": (
        lambda d: resign(d, _with_nan(load_file(d / TENSORS), "keys.1")),
        r"tensors\.safetensors holds NaN or infinite values in keys\.1",
    ),
    "future-format-other-checksum": (
        lambda d: _edit_manifest(d, lambda m: m.update(format_version="2.0", checksum="blake3:..."), False),
        r"uses cache format '2\.0'",
    ),
    # A later release's method, saved under this format number: which release saved it, not "choose one of".
    "method-of-a-later-release": (
        lambda d: _edit_manifest(
            d, lambda m: m.update(library_version="9.9.9") or m["config"].update(method="v3"), True
        ),
        r"a compression config this release \(\S+\) cannot use \(unknown method 'v3'.*saved by infokv-rag 9\.9\.9",
    ),
    # The tensors file is what is wrong, not the manifest.
    "summaries-missing": (
        lambda d: resign(d, {k: v for k, v in load_file(d / TENSORS).items() if k != "summary_keys.0"}),
        r"lacks the summaries of layer 0",
    ),
    "information-not-a-vector": (
        lambda d: resign(
            d, {**(t := load_file(d / TENSORS)), "information_reference": t["information_reference"][None]}
        ),
        r"holds information values of shape \(1, \d+\), not \(n,\)",
    ),
    "positions-float": (
        lambda d: resign(d, {**(t := load_file(d / TENSORS)), "positions.0": t["positions.0"].float()}),
        r"tensors\.safetensors holds positions\.0 as float32, not as the int64 token positions",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_is_refused(damage: str, random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path) -> None:
    harm, message = DAMAGE[damage]
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    random_engine.load(copy)  # intact copy loads
    harm(copy)
    with pytest.raises(CacheStoreError, match=message) as refused:
        random_engine.load(copy)
    assert "ingest" in str(refused.value), "the message says what to do"


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(files=list(m["files"])),
        lambda m: m.update(document="contract"),
        lambda m: m["document"].update(pages=3),
        lambda m: m.pop("tokens"),
    ],
)
def test_info_refuses_a_malformed_manifest_as_load_does(
    edit: Callable[[dict[str, Any]], object], random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path
) -> None:
    """`infokv-rag info` (`describe`) on a re-signed manifest whose fields are missing or of other shapes: the same
    `CacheStoreError` as a load, not a traceback."""
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    _edit_manifest(copy, edit, True)
    for read in (describe, random_engine.load):
        with pytest.raises(CacheStoreError, match="malformed manifest|cannot be parsed"):
            read(copy)


def test_a_manifest_nested_too_deep_or_too_large_is_damaged_for_load_info_and_a_save(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, saved_a: Path, tmp_path: Path
) -> None:
    """Parsing either would raise RecursionError, or take memory without end: `CacheStoreError` instead, and a save
    refuses the directory as it refuses any that is not a cache of ours."""
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    nested = b"[" * 100_000 + b"]" * 100_000
    large = json.dumps({"format_version": FORMAT_VERSION, "padding": "x" * MAX_MANIFEST_BYTES}).encode()
    for content in (nested, large):
        (copy / MANIFEST).write_bytes(content)
        for read in (describe, random_engine.load):
            with pytest.raises(CacheStoreError, match=r"manifest\.json is damaged"):
                read(copy)
        with pytest.raises(CacheStoreError, match="not a cache that infokv-rag saved"):
            doc_a.save(copy)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [(TEXT, "fails its sha256 check"), (TENSORS, "fails its sha256 check"), (MANIFEST, "is damaged")],
)
def test_a_file_grown_far_past_its_record_is_refused_without_being_read(
    name: str, refusal: str, random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path
) -> None:
    """A damaged file of 40 GiB (sparse: it takes no disk) was read whole before its size was compared: a bare
    MemoryError (a traceback from `infokv-rag info`). A read takes one byte more than the manifest records."""
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    os.truncate(copy / name, 40 << 30)
    for read in (describe, random_engine.load):
        with pytest.raises(CacheStoreError, match=re.escape(f"{name} {refusal}")):
            read(copy)


@pytest.mark.parametrize("recorded", [10**11, 2**63 - 1])
def test_a_file_record_beyond_memory_is_refused_as_damage(
    recorded: int, random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path
) -> None:
    """The read took the manifest's byte count as what to allocate: a bare MemoryError, or an OverflowError out of
    `infokv-rag info`, for a manifest that a broken tool re-signed."""
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    _edit_manifest(copy, lambda m: m["files"][TEXT].update(bytes=recorded), True)
    for read in (describe, random_engine.load):
        with pytest.raises(CacheStoreError, match=f"{TEXT} fails its sha256 check"):
            read(copy)


@pytest.mark.parametrize("name", ["../outside.txt", "absolute", "notes.txt"])
def test_a_manifest_naming_other_files_than_a_caches_own_is_refused_without_reading_them(
    name: str, random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path
) -> None:
    """`infokv-rag info` checks every file the manifest names: one outside the cache, named with a guess of its
    sha256, would tell whether the guess is right."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"hunter2\n")
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    (copy / "notes.txt").write_bytes(outside.read_bytes())
    guessed = {"sha256": _sha256(b"hunter2\n"), "bytes": 8}
    _edit_manifest(copy, lambda m: m["files"].update({str(outside) if name == "absolute" else name: guessed}), True)
    for read in (describe, random_engine.load):
        with pytest.raises(CacheStoreError, match="malformed manifest"):
            read(copy)


@pytest.fixture(scope="module")
def other_random_engine(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> InfoKVEngine:
    """Same architecture and tokenizer as random_engine, different weights."""
    target = Path(shutil.copytree(random_model_dir, tmp_path_factory.mktemp("other") / "model"))
    weights = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    weights = {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in weights.items()}
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return InfoKVEngine.from_pretrained(str(target), device="cpu")


def test_cache_of_another_model_with_the_same_shapes_is_refused(
    random_engine: InfoKVEngine, other_random_engine: InfoKVEngine, saved_a: Path
) -> None:
    assert other_random_engine.runner.num_layers == random_engine.runner.num_layers
    assert other_random_engine.fingerprint != random_engine.fingerprint
    with pytest.raises(CacheStoreError, match="was made by model .* not by the loaded model") as refused:
        other_random_engine.load(saved_a)
    assert "ingest again" in str(refused.value)


def test_a_cache_of_the_same_weights_under_another_layer_count_is_refused_as_another_models(
    random_engine: InfoKVEngine, random_model_dir: Path, saved_a: Path, tmp_path: Path
) -> None:
    """transformers reads a model's weights under a config.json of fewer layers, and the fingerprint leaves the
    layer count out: each model's caches were refused by the other as damaged ("ingest the document again")."""
    pruned_dir = Path(shutil.copytree(random_model_dir, tmp_path / "pruned"))
    config = json.loads((pruned_dir / "config.json").read_text())
    config["num_hidden_layers"] -= 1
    (pruned_dir / "config.json").write_text(json.dumps(config))
    pruned = InfoKVEngine.from_pretrained(str(pruned_dir), device="cpu")
    layers = random_engine.runner.num_layers
    with pytest.raises(CacheStoreError, match=f"made by a model of {layers} layers, .* has {layers - 1}: the same"):
        pruned.load(saved_a)


@pytest.mark.parametrize("stored_bits", [None, 8])
def test_a_head_that_holds_a_position_twice_is_refused_without_a_cold_tier_too(
    random_engine: InfoKVEngine, tmp_path: Path, stored_bits: int | None
) -> None:
    """A re-signed cache where one head's extra repeats a position its layer holds: that entry would be attended
    twice. Refused for every cache, not only for one whose cold tier counts it out."""
    doc = random_engine.ingest_text(TEXT_A, CompressionConfig(keep=0.3, stored_bits=stored_bits))
    assert doc.cold_tier is None
    extras = doc.cache.extra_positions()
    assert extras is not None, "the default budgets are per head"
    layer, head = next(
        (index, head) for index, (_, counts) in enumerate(extras) for head in range(len(counts)) if int(counts[head])
    )
    first_of_head = int(extras[layer][1][:head].sum())
    path = doc.save(tmp_path / "doc")
    tensors = load_file(path / TENSORS)
    tensors[f"extra_positions.{layer}"][first_of_head] = tensors[f"positions.{layer}"][head, -1]
    resign(path, tensors)
    with pytest.raises(CacheStoreError, match=f"layer {layer} holds a position of head {head} twice"):
        random_engine.load(path)


# --- bindings -------------------------------------------------------------------------------------


def _as_format_9(path: Path) -> Path:
    """The saved cache as format 9 saved it: its tensors without a binding (`resign` writes them bare)."""
    resign(path, load_file(path / TENSORS))
    _edit_manifest(path, lambda m: m.update(format_version=9), True)
    return path


def _copy_in(path: Path, source: Path, name: str) -> None:
    """The file `name` of the cache `source` copied into the cache `path`, its manifest re-signed to match."""
    shutil.copy(source / name, path / name)
    record = json.loads((source / MANIFEST).read_text())["files"][name]
    _edit_manifest(path, lambda m: m["files"].update({name: record}), True)


def test_another_caches_text_or_tensors_behind_a_re_signed_manifest_are_refused(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """Two documents of as many tokens, a full cache each: either's tensors fit the other's text, so only the hot
    tensors' binding tells a mix of the two; and the manifest's document record is bound too (a `CacheStore` trusts
    its sha256)."""
    config = CompressionConfig(method="full")
    doc, other = (random_engine.ingest_text(text, config) for text in (TEXT_A, " ".join(CORPUS[::-1] * 2)))
    assert doc.cache.document_tokens == other.cache.document_tokens
    path, other_path = doc.save(tmp_path / "doc"), other.save(tmp_path / "other")
    for name in (TEXT, TENSORS):
        mixed = Path(shutil.copytree(path, tmp_path / f"with-other-{name}"))
        _copy_in(mixed, other_path, name)
        with pytest.raises(CacheStoreError, match=r"tensors\.safetensors is not bound to this cache"):
            random_engine.load(mixed)
    _edit_manifest(path, lambda m: m["document"].update(sha256=other.document.sha256), True)
    with pytest.raises(CacheStoreError, match=r"tensors\.safetensors is not bound to this cache"):
        random_engine.load(path)


def test_a_bound_cache_whose_manifest_says_an_older_format_is_refused(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """The format is not a bound record, yet format 2's config is read otherwise (its settings flat: these would
    read back as the defaults, surprisal and top-20 entropy): tensors that carry a binding behind a manifest
    re-signed as an older format are refused, whichever."""
    settings = {"layer_budgets": "uniform", "information": "entropy", "entropy_top_k": 3}
    saved = random_engine.ingest_text(TEXT_A, CompressionConfig(keep=0.5, settings=settings)).save(tmp_path / "cache")
    for version in (2, 9):
        copy = Path(shutil.copytree(saved, tmp_path / f"as-{version}"))
        _edit_manifest(copy, partial(dict.update, format_version=version), True)
        with pytest.raises(CacheStoreError, match=r"tensors\.safetensors is not bound to this cache"):
            random_engine.load(copy)


def test_tensors_the_config_does_not_read_are_refused_in_every_format(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, saved_a: Path, tmp_path: Path
) -> None:
    """The default per-head budgets saved, the config re-signed as uniform budgets: the heads' extras, entries the
    document kept, would be silently left out. A cache without a binding (format 9) loads as it was, but not so."""
    for bound in (True, False):
        copy = Path(shutil.copytree(saved_a, tmp_path / f"copy-{bound}"))
        if not bound:
            assert_same_document(random_engine.load(_as_format_9(copy)), doc_a)
        _edit_manifest(copy, lambda m: m["config"]["settings"].update(layer_budgets="uniform"), True)
        with pytest.raises(CacheStoreError, match=r"holds tensors that its config does not read \(extra_"):
            random_engine.load(copy)


@pytest.mark.parametrize("bound", [True, False])
@pytest.mark.parametrize("to", ["the model's most", "beyond any"])
def test_a_token_count_raised_with_the_head_before_the_text_is_refused(
    bound: bool, to: str, random_engine: InfoKVEngine, saved_a: Path, tmp_path: Path
) -> None:
    """tokens.head and tokens.document raised together in a re-signed manifest: the text still reads as that many
    tokens, but the entries end where the document did, and the question would be placed past it. A count no
    document of this model reaches is refused before anything of its size is made (it asked for any memory)."""
    n = random_engine.load(saved_a).cache.document_tokens
    raised, message = (
        (random_engine.max_document_tokens - n, "its entries end at position")
        if to == "the model's most"
        else (10**13, "outside the 1 to")
    )
    copy = Path(shutil.copytree(saved_a, tmp_path / "copy"))
    if not bound:
        _as_format_9(copy)
    _edit_manifest(copy, lambda m: m["tokens"].update(head=m["tokens"]["head"] + raised, document=n + raised), True)
    with pytest.raises(CacheStoreError, match=message):
        random_engine.load(copy)


# --- older formats -------------------------------------------------------------------------------

FORMAT_2 = Path(__file__).parent / "data" / "format2"
"""Caches saved by commit ca48d80 (format 2: the config one flat dict of every method's fields) from
conftest's random model; tests/data/format2/*/manifest.json holds each config."""

FORMAT_2_CONFIGS = {
    "infokv": CompressionConfig(
        method="infokv",
        keep=0.5,
        summaries=0,  # saved before summaries existed
        # Saved before `attention`, `layer_budgets`, `units` and `numbers` existed: made with the window, uniform
        # budgets and numbers scored like any token, whatever today's defaults are.
        settings={
            "tau": 0.75,
            "lam": 0.5,
            "information": "entropy",
            "aggregation": "token",
            "attention": "window",
            "layer_budgets": "uniform",
            "units": "token",
            "numbers": "scored",
            "normalization": "minmax",
        },
    ),
    "snapkv": CompressionConfig(method="snapkv", keep=40, window=8, summaries=0, settings={"pooling_kernel": 3}),
}


@pytest.mark.parametrize("name", list(FORMAT_2_CONFIGS))
def test_a_cache_saved_in_format_2_loads_and_saves_as_the_current_format(
    name: str, random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    old = Path(shutil.copytree(FORMAT_2 / name, tmp_path / "old"))
    # The random model's weight bytes may differ between library versions; its shapes do not.
    _edit_manifest(old, lambda m: m["model"].update(fingerprint=random_engine.fingerprint), True)
    doc = random_engine.load(old)
    assert doc.config == FORMAT_2_CONFIGS[name]
    assert doc.stats.method == name and doc.stats.document_tokens == doc.cache.document_tokens
    assert (doc.information_reference is not None) == (name == "infokv")
    assert doc.ask("What is the notice period?", max_new_tokens=4)
    new = doc.save(tmp_path / "new")
    assert json.loads((new / MANIFEST).read_text())["format_version"] == FORMAT_VERSION
    assert_same_document(random_engine.load(new), doc)


# --- crash safety -------------------------------------------------------------------------------

SAVE_FOREVER = """
import os, sys, time
from types import SimpleNamespace
import safetensors.torch
from infokv_rag import store
from infokv_rag.cache import DocumentCache, EvictedSummary, HeadExtras, LayerKV
from infokv_rag.config import CompressionConfig
from infokv_rag.documents import Document

def rebuild(path):
    # A document from a saved cache without loading any model: only store.save_document runs here.
    manifest = store.read_manifest(path)
    tensors = safetensors.torch.load_file(os.path.join(path, store.TENSORS))
    count = len(manifest["tokens"]["kept_per_layer"])
    layers = [LayerKV(*(tensors[f"{n}.{i}"] for n in ("keys", "values", "positions", "scores"))) for i in range(count)]
    summaries = [
        EvictedSummary(*(tensors[f"summary_{n}.{i}"] for n in store.SUMMARY_TENSORS)) for i in range(count)
    ] if "summary_keys.0" in tensors else None
    extras = [
        HeadExtras(*(tensors[f"extra_{n}.{i}"] for n in store.EXTRA_TENSORS)) for i in range(count)
    ] if "extra_keys.0" in tensors else None
    text = open(os.path.join(path, store.TEXT), encoding="utf-8").read()
    return SimpleNamespace(
        engine=SimpleNamespace(**manifest["model"], prompt=SimpleNamespace(head_tokens=manifest["tokens"]["head"])),
        cache=DocumentCache(layers, manifest["tokens"]["document"], summaries=summaries, extras=extras),
        config=CompressionConfig.from_dict(manifest["config"]),
        document=Document.from_layout(text, manifest["document"]),
        stats=SimpleNamespace(to_dict=lambda: manifest["stats"]),
        information_reference=tensors.get("information_reference"),
        cold_tier=None,
    )

# Slow the save down so that kills land inside it: every file is written in pieces with pauses, and
# every rename waits first (which widens the window between retiring the old cache and installing).
def slow_write(path, data):
    with open(path, "wb") as handle:
        step = max(1, len(data) // 4)
        for start in range(0, len(data), step):
            handle.write(data[start:start + step])
            handle.flush()
            time.sleep(0.01)
        os.fsync(handle.fileno())

real_replace = os.replace
def slow_replace(src, dst):
    time.sleep(0.01)
    real_replace(src, dst)

store.write_synced = slow_write
os.replace = slow_replace
documents = [rebuild(sys.argv[1]), rebuild(sys.argv[2])]
print("ready", flush=True)
for index in range(10_000):
    store.save_document(documents[index % 2], sys.argv[3])
    print("saved", index % 2, flush=True)
"""


def test_killing_a_save_never_leaves_a_half_written_cache(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, saved_a: Path, tmp_path: Path
) -> None:
    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    saved_b = doc_b.save(tmp_path / "source-b")
    script = tmp_path / "save_forever.py"
    script.write_text(textwrap.dedent(SAVE_FOREVER))
    target = tmp_path / "store" / "cache"
    rng = random.Random(1234)
    outcomes: list[str] = []
    killed_mid_save = 0
    seen: set[str] = set()
    for round_ in range(6):
        child = subprocess.Popen(
            [sys.executable, str(script), str(saved_a), str(saved_b), str(target)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        assert child.stdout is not None and child.stderr is not None
        try:
            ready = child.stdout.readline()
            assert ready.strip() == "ready", (ready, child.stderr.read() if child.stderr else "")
            if round_ == 5:
                # Surely past a completed save: the kill hits a replacement of an existing cache.
                line = None
                while line != "saved 1":
                    line = child.stdout.readline().strip()
                    assert line, "the saving child died"
            # One save takes ~0.15 s: moments from before the first save completes to a few saves in.
            time.sleep(rng.uniform(0.0, 0.6) if round_ else rng.uniform(0.0, 0.1))
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
            child.stdout.close()
            child.stderr.close()
        assert child.returncode == -signal.SIGKILL
        # A kill inside a save leaves its staging (or retired) directory beside the target.
        # (On a busy machine the kill may come before the first save created the directory.)
        siblings = target.parent.iterdir() if target.parent.exists() else iter(())
        leftovers = {p.name for p in siblings if p.name != target.name} - seen
        seen |= leftovers
        killed_mid_save += any(".saving-" in name or ".old-" in name for name in leftovers)
        if not target.exists():
            outcomes.append("absent")
            continue
        loaded = random_engine.load(target)  # raises CacheStoreError for a half cache: that fails the test
        if loaded.document.text == TEXT_A:
            assert_same_document(loaded, doc_a)
            outcomes.append("a")
        else:
            assert_same_document(loaded, doc_b)
            outcomes.append("b")
    print(f"outcomes after each kill: {outcomes}; kills inside a save: {killed_mid_save}")
    assert killed_mid_save >= 1, f"no kill landed inside a save: {outcomes}"
    assert set(outcomes) & {"a", "b"}, f"no save ever completed before a kill: {outcomes}"

    # The next save sweeps the staging directories that the killed saves left once they are stale.
    remaining = [p for p in target.parent.iterdir() if p.name != target.name]
    old = time.time() - STALE_SECONDS - 60
    for leftover in remaining:
        os.utime(leftover, (old, old))
    doc_a.save(target)
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    assert_same_document(random_engine.load(target), doc_a)


def test_a_failed_save_keeps_the_old_cache(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infokv_rag import store

    target = doc_a.save(tmp_path / "c")
    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))

    def disk_full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_synced", disk_full)
    with pytest.raises(CacheStoreError, match="cannot write the cache to .*No space left"):
        doc_b.save(target)
    monkeypatch.undo()
    assert_same_document(random_engine.load(target), doc_a)
    assert [p.name for p in tmp_path.iterdir()] == ["c"], "the staging directory is cleaned up"


def test_a_save_over_a_read_only_cache_is_refused_before_any_work(
    doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save removes the cache it replaces, which takes a directory it may write: one it may not is refused up
    front, the old cache and its mode kept and nothing left beside it. (Root may write any directory: its refusal
    is played by `os.access`.)"""
    target = doc_a.save(tmp_path / "c")
    target.chmod(0o555)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != target and real_access(path, mode))
    with pytest.raises(CacheStoreError, match=r"c is read-only \(mode 555\).*chmod u\+w"):
        doc_a.save(target)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert (target.stat().st_mode & 0o777) == 0o555


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only directory")
def test_a_save_over_a_read_only_cache_is_refused_as_a_user(doc_a: CompressedDocument, tmp_path: Path) -> None:
    target = doc_a.save(tmp_path / "c")
    target.chmod(0o555)
    try:
        with pytest.raises(CacheStoreError, match="read-only"):
            doc_a.save(target)
        assert [p.name for p in tmp_path.iterdir()] == ["c"]
    finally:
        target.chmod(0o755)


def test_a_failed_save_leaves_no_copy_beside_a_cache_of_another_mode(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replaced directory's mode is given to the new one once it is installed, never to the staging copy: a
    copy given a read-only mode, then not installed, could not be emptied (by a user who is not root)."""
    from infokv_rag import store

    target = doc_a.save(tmp_path / "c")
    target.chmod(0o750)
    staging_modes = []

    def refuse(staging: Path, target: Path) -> None:
        staging_modes.append(staging.stat().st_mode & 0o777)
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(store, "replace_directory", refuse)
    with pytest.raises(CacheStoreError, match="cannot write the cache"):
        doc_a.save(target)
    assert staging_modes == [0o777 & ~_umask()], "the copy keeps a new directory's mode until installed"
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    monkeypatch.undo()
    assert_same_document(random_engine.load(doc_a.save(target)), doc_a)
    assert (target.stat().st_mode & 0o777) == 0o750, "the installed cache has the replaced one's mode"


@pytest.fixture
def without_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing a directory as a system without RENAME_EXCHANGE does: retire the old, then rename the new."""
    from infokv_rag import files

    monkeypatch.setattr(files, "_renameat2", None)


def test_a_save_over_a_cache_exchanges_the_two_so_that_the_path_always_names_one(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed between retiring the old cache and installing the new left no cache at the path (both in
    hidden directories beside it, swept an hour later). Where the system exchanges two paths in one step, the path
    is never without a cache: no rename retires it."""
    from infokv_rag import files

    if files._renameat2 is None:
        pytest.skip("this system's C library has no renameat2")
    target = doc_a.save(tmp_path / "c")
    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    real_replace = os.replace

    def no_retire(source: Path, destination: Path) -> None:
        assert Path(source) != target, "the cache was retired, leaving the path without one"
        real_replace(source, destination)

    real_rmtree = shutil.rmtree
    removed: list[str] = []

    def check_before_removing(path: Path, ignore_errors: bool = False) -> None:
        removed.append((Path(path) / "document.txt").read_text())  # the earlier cache, now at the staging name
        assert_same_document(random_engine.load(target), doc_b)
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(os, "replace", no_retire)
    monkeypatch.setattr(files.shutil, "rmtree", check_before_removing)
    doc_b.save(target)
    monkeypatch.undo()
    assert removed == [TEXT_A] and [p.name for p in tmp_path.iterdir()] == ["c"]
    assert_same_document(random_engine.load(target), doc_b)


def test_a_retire_that_fails_leaves_no_retired_directory(
    doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, without_exchange: None
) -> None:
    from infokv_rag import files

    target = doc_a.save(tmp_path / "c")
    staging = Path(shutil.copytree(target, tmp_path / "staging"))
    real_replace = os.replace

    def refuse_the_retire(source: Path, destination: Path) -> None:
        if Path(source) == target:
            raise OSError(13, "Permission denied")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", refuse_the_retire)
    with pytest.raises(PermissionError):
        files.replace_directory(staging, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "staging"]


@pytest.mark.parametrize("failure", [OSError(5, "Input/output error"), KeyboardInterrupt()], ids=["EIO", "Ctrl-C"])
def test_a_save_that_fails_between_its_renames_puts_the_earlier_cache_back(
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: BaseException,
    without_exchange: None,
) -> None:
    """The earlier cache was retired, the new one's rename failed (or Ctrl-C came between the two), and the retired
    directory was removed anyway: both caches were lost."""
    target = doc_a.save(tmp_path / "c")
    other = random_engine.ingest_text("Another text entirely, to be saved over the first.", CompressionConfig())
    real_replace = os.replace

    def fail_the_install(source: Path, destination: Path) -> None:
        if Path(source).name.startswith(".c.saving-"):
            raise failure
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", fail_the_install)
    with pytest.raises((CacheStoreError, KeyboardInterrupt)):
        other.save(target)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert_same_document(random_engine.load(target), doc_a)


def test_the_sweep_removes_only_what_a_save_left(doc_a: CompressedDocument, tmp_path: Path) -> None:
    """A directory beside the target is swept only when a save named it (its prefix and 16 random hex digits, or
    8 characters of `tempfile.mkdtemp` as releases before format 9 did) and it holds nothing but a cache's files (or,
    retired by such a release, a `cache` directory of them): a user's `.c.old-photos`, or one that only looks like a
    leftover, is never removed, however old."""
    hex_name = "0123456789abcdef"
    users = {
        ".c.old-photos": "holiday.jpg",
        ".c.saving-drafts": "draft.txt",
        ".c.old-backup": TEXT,  # a cache file's name, in a directory no save named
        f".c.old-{hex_name}": "holiday.jpg",
        f".c.saving-{hex_name}": TENSORS + ".mine",
        ".c.old-holidays": "holiday.jpg",  # named as an earlier release's mkdtemp would
    }
    for name, file in users.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / file).write_text("precious")
    leftovers = {f".c.saving-{'1' * 16}": [TENSORS, TEXT], f".c.old-{'2' * 16}": [MANIFEST, TENSORS, TEXT]}
    for name, names in leftovers.items():
        (tmp_path / name).mkdir()
        for file in names:
            (tmp_path / name / file).write_bytes(b"partial")
    (tmp_path / f".c.old-{'3' * 16}").mkdir()  # killed before the retire's rename
    leftovers = {".c.saving-k3_x9qzt": [TENSORS, TEXT], ".c.old-a1b2c3d4/cache": [MANIFEST, TENSORS, TEXT]}
    for name, names in leftovers.items():  # an earlier release's names; it retired a cache into <name>/cache
        (tmp_path / name).mkdir(parents=True)
        for file in names:
            (tmp_path / name / file).write_bytes(b"partial")
    old = time.time() - STALE_SECONDS - 60
    for entry in tmp_path.iterdir():
        os.utime(entry, (old, old))
    doc_a.save(tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "c"])
    for name, file in users.items():
        assert (tmp_path / name / file).read_text() == "precious"


def test_a_path_that_cannot_be_resolved_or_named_is_refused_clearly(doc_a: CompressedDocument, tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path in (loop, loop / "x"):
        with pytest.raises(CacheStoreError, match="cannot save a cache to .*(loop|symbolic links).*another path"):
            doc_a.save(path)
    with pytest.raises(CacheStoreError, match="cannot save a cache to .*File name too long.*another path"):
        doc_a.save(tmp_path / ("x" * 300))
    # A name that fits, but not in the name of the directory a save writes into first: refused before anything is
    # written (it failed once the document was read and its cache encoded), and the CLI's check says so too.
    with pytest.raises(CacheStoreError, match=r"\.x{240}\.saving-<16 hex digits>, 265 bytes.* 10 bytes shorter"):
        doc_a.save(tmp_path / ("x" * 240))
    with pytest.raises(CacheStoreError, match="10 bytes shorter"):
        check_save_target(tmp_path / ("x" * 240))
    doc_a.save(tmp_path / ("x" * 230))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "x" * 230]


def test_a_path_no_file_system_takes_is_refused_clearly(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path
) -> None:
    for act in (doc_a.save, random_engine.load, describe):
        with pytest.raises(CacheStoreError, match="holds a NUL character"):
            act(tmp_path / "a\0b")


def test_a_save_to_the_working_directory_is_refused(
    doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save would rename the directory the process stands in aside and remove it: `.` would name nothing."""
    for kind in ("empty", "cache"):
        where = tmp_path / kind
        where.mkdir()
        if kind == "cache":
            doc_a.save(where)
        before = sorted(path.name for path in where.iterdir())
        monkeypatch.chdir(where)
        with pytest.raises(CacheStoreError, match="is the working directory"):
            doc_a.save(".")
        assert Path.cwd() == where and sorted(path.name for path in where.iterdir()) == before
    doc_a.save("cache")  # below it: a directory of its own
    assert store_module.is_saved_cache(tmp_path / "cache" / "cache")


def test_a_cache_another_save_replaces_while_it_is_checked_is_saved_over(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two saves to one path: the other retires the cache there while this one checks it (gone, then its own
    installed), which is no reason to refuse; the last save wins, whole."""
    target = doc_a.save(tmp_path / "cache")
    other = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    checks = 0
    really_is_saved_cache = store_module.is_saved_cache

    def replaced_meanwhile(directory: Path) -> bool:
        nonlocal checks
        checks += 1
        if checks == 1:  # the other save retires the cache, installs its own, then removes the one it retired
            other.save(tmp_path / "staged")
            directory.rename(tmp_path / "retired")
            (tmp_path / "staged").rename(directory)
            shutil.rmtree(tmp_path / "retired")
            return False
        return really_is_saved_cache(directory)

    monkeypatch.setattr(store_module, "is_saved_cache", replaced_meanwhile)
    assert doc_a.save(target) == target and checks == 2
    assert_same_document(random_engine.load(target), doc_a)

    def retired_meanwhile(directory: Path) -> bool:
        shutil.rmtree(directory)
        return False

    monkeypatch.setattr(store_module, "is_saved_cache", retired_meanwhile)
    doc_a.save(target)  # retired and not yet installed again: nothing there to refuse
    assert_same_document(random_engine.load(target), doc_a)


# --- saves beside loads ---------------------------------------------------------------------------


def test_a_load_reads_the_cache_it_opened_while_a_save_replaces_it(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save replacing the cache after a load read its manifest: the load reads the rest from the same directory,
    the previous cache whole, never the manifest of one and the tensors of the other."""
    from infokv_rag import store

    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    target = doc_a.save(tmp_path / "c")
    real_manifest = store.verified_manifest
    replaced: list[bool] = []

    def replace_after_the_manifest(files: store.CacheFiles) -> dict[str, Any]:
        manifest = real_manifest(files)
        if not replaced:
            replaced.append(True)
            doc_b.save(target)
        return manifest

    monkeypatch.setattr(store, "verified_manifest", replace_after_the_manifest)
    assert_same_document(random_engine.load(target), doc_a)
    assert replaced
    assert_same_document(random_engine.load(target), doc_b)


def test_a_load_whose_directory_a_save_removed_reads_the_new_cache(
    random_engine: InfoKVEngine, doc_a: CompressedDocument, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that replaces the cache between a load's opening of the directory and of its files removes the files
    (with the directory it retired): the load starts again, on the new cache."""
    from infokv_rag import store

    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    target = doc_a.save(tmp_path / "c")
    real_open = store.open_regular
    replaced: list[bool] = []

    def replace_first(path: Path, directory: int | None = None) -> Any:
        if not replaced:
            replaced.append(True)
            doc_b.save(target)
        return real_open(path, directory)

    monkeypatch.setattr(store, "open_regular", replace_first)
    assert_same_document(random_engine.load(target), doc_b)


def test_a_load_in_the_instant_a_save_leaves_no_cache_reads_the_new_one(
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    without_exchange: None,
) -> None:
    """Between retiring the old cache and installing the new one, a save leaves no directory at the target: a load
    then waits for the new one (the retired directory beside the target tells it one is being installed)."""
    from infokv_rag import store

    doc_b = random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))
    target = doc_a.save(tmp_path / "c")
    retired, found_none, installed = threading.Event(), threading.Event(), threading.Event()
    real_replace, real_replaced = os.replace, store.DirectoryFiles.replaced

    def pause_between_the_renames(source: Path, destination: Path) -> None:
        real_replace(source, destination)
        if Path(source) == target:
            retired.set()
            assert found_none.wait(30)
        elif Path(destination) == target:
            installed.set()

    def replaced_once_installed(files: store.DirectoryFiles) -> bool:
        answer = real_replaced(files)
        found_none.set()
        assert installed.wait(30)
        return answer

    monkeypatch.setattr(os, "replace", pause_between_the_renames)
    monkeypatch.setattr(store.DirectoryFiles, "replaced", replaced_once_installed)
    saver = threading.Thread(target=doc_b.save, args=(target,))
    saver.start()
    try:
        assert retired.wait(30)
        assert not target.exists()
        assert_same_document(random_engine.load(target), doc_b)
    finally:
        found_none.set()
        saver.join(30)


# --- cache store --------------------------------------------------------------------------------


def test_store_reuses_the_cache_of_the_same_file(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "contract.txt"
    path.write_text(TEXT_A)
    store = CacheStore(tmp_path / "store")
    config = CompressionConfig(keep=0.25)
    first, reused = store.ingest(random_engine, load_document(path), config)
    assert reused is False
    answer = first.ask(QUESTION, max_new_tokens=NEW_TOKENS)

    def no_prefill(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the document was prefilled again")

    monkeypatch.setattr(random_engine, "ingest_document", no_prefill)
    # The same bytes under another name are the same document.
    copy = tmp_path / "copy-of-contract.txt"
    copy.write_bytes(path.read_bytes())
    second, reused = store.ingest(random_engine, load_document(copy), config)
    assert reused is True
    assert_same_document(second, first)
    assert second.ask(QUESTION, max_new_tokens=NEW_TOKENS) == answer

    # Another config or another document is a different key: it must prefill.
    for document, other in ((load_document(path), CompressionConfig(keep=0.5)), (document_from_text(TEXT_B), config)):
        with pytest.raises(AssertionError, match="prefilled again"):
            store.ingest(random_engine, document, other)
    assert len(list(store.root.iterdir())) == 1


def test_a_store_that_cannot_take_a_cache_costs_the_next_run_a_prefill_not_this_one_its_answers(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    document = document_from_text(TEXT_A)
    store = CacheStore(tmp_path / "store")

    def disk_full(*_: Any, **__: Any) -> NoReturn:
        raise CacheStoreError("cannot write the cache to the store: [Errno 28] No space left on device")

    monkeypatch.setattr(store_module, "save_document", disk_full)
    with pytest.warns(StoreWriteWarning, match=r"not stored \(cannot write .*No space left.*reads it again"):
        compressed, reused = store.ingest(random_engine, document)
    assert reused is False and compressed.ask("What is this?", max_new_tokens=2)
    assert not store.holds(random_engine, document)
    monkeypatch.undo()
    assert store.ingest(random_engine, document)[1] is False  # read again, and stored this time
    assert store.holds(random_engine, document)
    assert store.ingest(random_engine, document)[1] is True
    # A damaged entry that cannot be replaced is not held either (`ask --json` named it as the cache stored).
    _flip_byte(store.path_for(random_engine, document) / TENSORS, 0.5)
    monkeypatch.setattr(store_module, "save_document", disk_full)
    with pytest.warns(StoreWriteWarning):
        assert store.ingest(random_engine, document)[1] is False
    assert not store.holds(random_engine, document) and not list(store.root.iterdir())


def test_store_reads_a_document_again_once_its_method_keeps_other_tokens(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache stored before a change of what its method keeps (an earlier `Method.revision`: here, before budgets
    kept words whole) is not served after it: the store reads the document again, once. At revision 1 the key is
    the one every cache stored before revisions existed has."""
    document = document_from_text(TEXT_A)
    config = CompressionConfig(keep=0.25)
    store = CacheStore(tmp_path / "store")
    real = scorers.method
    assert real("infokv").revision == WHOLE_WORDS_REVISION > 1

    def before_the_change(name: str) -> Method[Any]:
        return replace(real(name), revision=1) if name == "infokv" else real(name)

    monkeypatch.setattr(scorers, "method", before_the_change)
    _, reused = store.ingest(random_engine, document, config)
    assert reused is False
    identity = random_engine.resolve_config(config).cache_identity()
    material = json.dumps([document.sha256, random_engine.fingerprint, identity], sort_keys=True)
    assert store.path_for(random_engine, document, config).name == hashlib.sha256(material.encode()).hexdigest()[:32]
    monkeypatch.undo()
    _, reused = store.ingest(random_engine, document, config)
    assert reused is False
    _, reused = store.ingest(random_engine, document, config)
    assert reused is True
    assert len(list(store.root.iterdir())) == 2


def test_store_rebuilds_a_damaged_or_foreign_entry(
    random_engine: InfoKVEngine, other_random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    document = document_from_text(TEXT_A)
    config = CompressionConfig(keep=0.25)
    store = CacheStore(tmp_path / "store")
    made, _ = store.ingest(random_engine, document, config)
    entry = store.path_for(random_engine, document, config)
    _flip_byte(entry / TENSORS, 0.6)
    rebuilt, reused = store.ingest(random_engine, document, config)
    assert reused is False
    assert_same_document(random_engine.load(entry), rebuilt)
    # The store owns its entries: one whose manifest is unreadable is rebuilt too (a plain save would refuse it).
    _truncate(entry / MANIFEST)
    assert store.ingest(random_engine, document, config)[1] is False
    assert random_engine.load(entry).document.sha256 == document.sha256
    assert all(
        torch.equal(a.keys, b.keys)
        for a, b in zip(document_cache(rebuilt).layers, document_cache(made).layers, strict=True)
    )

    # Another model's cache planted under this model's key is never used to answer.
    foreign_entry = store.path_for(other_random_engine, document, config)
    shutil.copytree(entry, foreign_entry)
    doc, reused = store.ingest(other_random_engine, document, config)
    assert reused is False
    assert other_random_engine.load(foreign_entry).cache.document_tokens == doc.cache.document_tokens
    assert store.ingest(other_random_engine, document, config)[1] is True

    # Whole, verified caches of another document or another config moved under this key are not used either.
    other_document, half = document_from_text(TEXT_B), CompressionConfig(keep=0.5)
    for source, source_config in ((other_document, config), (document, half)):
        store.ingest(random_engine, source, source_config)
        shutil.rmtree(entry)
        shutil.copytree(store.path_for(random_engine, source, source_config), entry)
        doc, reused = store.ingest(random_engine, document, config)
        assert reused is False and doc.document.sha256 == document.sha256 and doc.config.keep == 0.25
        assert random_engine.load(entry).document.sha256 == document.sha256, "and the entry is rebuilt"


def test_store_rebuilds_an_entry_whose_load_fails_in_any_way(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that fails otherwise than the checks refuse (an allocation, a bug) leaves the entry to be rebuilt,
    as a damaged one is, not the question to fail."""
    document, config = document_from_text(TEXT_A), CompressionConfig(keep=0.25)
    store = CacheStore(tmp_path / "store")
    store.ingest(random_engine, document, config)

    def fails(directory: object) -> NoReturn:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(random_engine, "load", fails)
    rebuilt, reused = store.ingest(random_engine, document, config)
    assert reused is False and rebuilt.document.sha256 == document.sha256


def test_store_rebuilds_a_cache_of_the_same_file_read_into_other_text(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    # The same bytes (so the same sha256) as a release that read them otherwise saw them: a page footer more.
    today = document_from_text(TEXT_A, source="msa.txt")
    earlier = replace(today, text=f"{TEXT_A}\nPage 1", pages=(Page(1, f"{TEXT_A}\nPage 1"),))
    config = CompressionConfig(keep=0.25)
    store = CacheStore(tmp_path / "store")
    store.ingest(random_engine, earlier, config)
    rebuilt, reused = store.ingest(random_engine, today, config)
    assert reused is False and rebuilt.document == today
    assert store.ingest(random_engine, today, config)[1] is True


# --- real models ------------------------------------------------------------------------------------

FACT_TEXT = (
    "This maintenance agreement covers the pumps of the Harbour Street plant. "
    "The access code for the archive room is 48213. "
    "The supplier inspects every pump twice a year and replaces worn seals at its own cost. "
    "Either party may terminate with 47 days notice."
)


@pytest.mark.tiny
def test_tiny_model_answer_survives_save_and_new_process(tiny_engine: InfoKVEngine, tmp_path: Path) -> None:
    doc = tiny_engine.ingest_text(FACT_TEXT, CompressionConfig(keep=0.5))
    question = "What is the access code for the archive room?"
    before = doc.ask(question, max_new_tokens=16)
    path = doc.save(tmp_path / "tiny-cache")
    other = ask_in_new_process("tiny", path, question, 16)
    assert other["answer"] == before
    assert other["text"] == doc.document.text


@pytest.mark.tiny
@pytest.mark.default
def test_tiny_cache_is_refused_by_the_default_model(
    tiny_engine: InfoKVEngine, default_engine: InfoKVEngine, tmp_path: Path
) -> None:
    path = tiny_engine.ingest_text(FACT_TEXT).save(tmp_path / "tiny-cache")
    with pytest.raises(CacheStoreError, match="was made by model 'tiny'.*not by the loaded model 'default'"):
        default_engine.load(path)
    # In a store, the tiny entry is keyed apart and never served to the default model.
    store = CacheStore(tmp_path / "store")
    document = document_from_text(FACT_TEXT)
    planted = store.path_for(default_engine, document, CompressionConfig())
    shutil.copytree(path, planted)
    _, reused = store.ingest(default_engine, document, CompressionConfig())
    assert reused is False


def test_reading_saved_caches_imports_no_transformers() -> None:
    """`infokv-rag info DIR` took 13 s, 7 of them importing transformers (through the ingestion's types), which
    reading a manifest and checking files does not use."""
    code = "import sys, infokv_rag.cli, infokv_rag.store; print(sorted(m for m in sys.modules if 'transformers' in m))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded


@pytest.mark.parametrize(
    ("error", "damage"),
    [
        (OSError(errno.EIO, "Input/output error"), False),
        (PermissionError(errno.EACCES, "Permission denied"), False),
        (OSError(errno.EINVAL, "Bad Request"), False),  # s3fs maps many request errors to EINVAL
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), True),
        (IsADirectoryError(errno.EISDIR, "Is a directory"), True),
        (NotARegularFileError(errno.EINVAL, "not a regular file"), True),
    ],
)
@pytest.mark.parametrize("file", [TENSORS, MANIFEST])
def test_a_file_that_cannot_be_read_now_is_told_apart_from_damage(
    random_engine: InfoKVEngine,
    saved_a: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: OSError,
    damage: bool,
    file: str,
) -> None:
    """Every I/O error reading a cache's file was damage, so the service read the document again for a disk or store
    failing a read for a moment; one that shows no damage is `CacheUnreadableError` (the service's 503 to retry)."""
    read = store_module.DirectoryFiles.read

    def failing(self: Any, name: str, most: int) -> bytes:
        if name == file:
            raise error
        return read(self, name, most)

    monkeypatch.setattr(store_module.DirectoryFiles, "read", failing)
    with pytest.raises(CacheStoreError) as refused:
        random_engine.load(saved_a)
    assert isinstance(refused.value, CacheUnreadableError) is not damage, refused.value


def test_a_saved_cache_whose_summaries_weigh_infinitely_is_refused(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """A summary of log count +inf would outweigh every entry: a cache that holds one, even bound and checksummed
    by the library itself, is refused at load (a mutation review found the check unpinned)."""
    text = " ".join(f"Clause {i}: the supplier delivers {i} pumps within {i + 3} days." for i in range(40))
    doc = random_engine.ingest_text(text, CompressionConfig(keep=0.25, chunk_size=64))
    assert doc.cache.summaries
    with torch.inference_mode():
        doc.cache.summaries[0].log_counts[0, 0] = float("inf")
    with pytest.raises(CacheStoreError, match="summaries"):
        random_engine.load(doc.save(tmp_path / "cache"))


def test_a_failed_save_leaves_a_users_file_in_the_entry_alone(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """The clean-up after a save the store refused removes a cache's own files only, never a file of the user's."""
    store = CacheStore(tmp_path / "store")
    document = document_from_text("The supplier shall deliver the goods within thirty days of the order date. " * 4)
    entry = store.path_for(random_engine, document)
    entry.mkdir(parents=True)
    (entry / "notes.txt").write_text("a user's own notes")
    with pytest.warns(UserWarning):
        store.ingest(random_engine, document)
    assert (entry / "notes.txt").read_text() == "a user's own notes"


def test_a_stored_entry_reused_sweeps_what_a_killed_save_of_it_left(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """A save killed before its entry was stored leaves its staging directory; the next run stores the entry and every
    later one reuses it, so no save of that key sweeps it again: a reuse sweeps it, once it is an hour old."""
    store = CacheStore(tmp_path / "store")
    document = document_from_text(TEXT_A)
    store.ingest(random_engine, document)
    entry = store.path_for(random_engine, document)
    left = entry.parent / f"{store_module._staging_prefix(entry)}{'0' * 16}"
    shutil.copytree(entry, left)
    young = store.ingest(random_engine, document)
    assert young[1] and left.is_dir()  # it may be a save running in another process
    old = time.time() - 2 * store_module.STALE_SECONDS
    os.utime(left, (old, old))
    assert store.ingest(random_engine, document)[1] and not left.exists() and (entry / "manifest.json").is_file()


def test_prune_removes_the_least_recently_used_caches_and_nothing_else(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    store = CacheStore(tmp_path / "store")
    config = CompressionConfig(keep=0.25)
    texts = {"old": TEXT_A, "middle": TEXT_B, "new": " ".join(CORPUS)}
    paths = {}
    for age, (name, text) in zip((30, 20, 10), texts.items(), strict=True):
        document = replace(document_from_text(text), source=name)
        store.ingest(random_engine, document, config)
        paths[name] = store.path_for(random_engine, document, config)
        stamp = time.time() - age * 86400
        os.utime(paths[name], (stamp, stamp))
    # Reuse is a use: the oldest entry, asked about again, is now the most recent.
    _, reused = store.ingest(random_engine, replace(document_from_text(TEXT_A), source="old"), config)
    assert reused is True
    assert [entry.source for entry in store.entries()] == ["middle", "new", "old"]
    # What is not an entry of the store is never listed nor removed: a user's directory, a file, a save in progress.
    mine = store.root / ("0" * 32)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (store.root / "README").write_text("mine")
    sizes = {entry.source: entry.bytes for entry in store.entries()}
    assert all(size > 0 for size in sizes.values()) and len(sizes) == 3

    with pytest.raises(ConfigError, match="max_bytes or unused_for"):
        store.prune()
    with pytest.raises(ConfigError, match="max_bytes must be a number at least 0"):
        store.prune(max_bytes=-1)
    would = store.prune(unused_for=15 * 86400, dry_run=True)
    assert [entry.source for entry in would] == ["middle"] and paths["middle"].is_dir()
    assert [entry.source for entry in store.prune(unused_for=15 * 86400)] == ["middle"]
    assert not paths["middle"].exists() and paths["new"].is_dir()
    # Down to a size: least recently used first, until the rest fit.
    removed = store.prune(max_bytes=sizes["old"])
    assert [entry.source for entry in removed] == ["new"]
    assert [entry.source for entry in store.entries()] == ["old"]
    # What saves or removals killed left is swept once an hour old, whichever entry it was of; a young one may be a
    # save running now, and a user's directory of such a name that holds other files is never touched.
    key = paths["old"].name
    stale, young = store.root / f".{key}.saving-{'a' * 16}", store.root / f".{'1' * 32}.old-{'b' * 16}"
    photos = store.root / f".{key}.old-{'c' * 16}"
    for leftover in (stale, young, photos):
        shutil.copytree(paths["old"], leftover)
    (photos / "holiday.jpg").write_bytes(b"mine")
    for leftover in (stale, photos):
        os.utime(leftover, (time.time() - STALE_SECONDS - 60,) * 2)
    assert store.prune(max_bytes=0)[0].path == paths["old"] and store.entries() == []
    assert not stale.exists() and young.is_dir() and (photos / "holiday.jpg").is_file()
    shutil.rmtree(young)
    shutil.rmtree(photos)
    assert (mine / "notes.txt").read_text() == "mine" and (store.root / "README").is_file()
    assert sorted(path.name for path in store.root.iterdir()) == sorted([mine.name, "README"])
    # A pruned document is read again, and stored again, the next time it is asked about.
    _, reused = store.ingest(random_engine, replace(document_from_text(TEXT_A), source="old"), config)
    assert reused is False and paths["old"].is_dir()
    assert CacheStore(tmp_path / "no such store").entries() == []
