"""Cache backends: a local directory, a file:// store and an S3 store (moto's server on loopback).

Each backend publishes atomically (a load sees a whole cache or refuses), survives concurrent publishers of
one key, and keeps small records (the service's ownership records) beside the cache.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from infokv_rag import (
    CacheStoreError,
    CompressedDocument,
    CompressionConfig,
    ConfigError,
    InfoKVEngine,
    cache_backends,
)
from infokv_rag.cache_backends import (
    CACHE,
    CURRENT,
    RETIRED,
    CacheBackend,
    FsspecBackend,
    LocalBackend,
    open_backend,
)
from infokv_rag.store import MANIFEST, STALE_SECONDS, TENSORS, encode_document

from .conftest import CORPUS
from .s3_server import s3_server
from .test_store import assert_same_document

pytest.importorskip("fsspec", reason="the fsspec backend needs the [scale] extra")

TEXT_A = " ".join(CORPUS * 2)
TEXT_B = " ".join(reversed(CORPUS * 3))
QUESTION = "What is the notice period?"
KEY = "documents/doc_1"


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    pytest.importorskip("s3fs", reason="s3:// needs the [scale] extra")
    pytest.importorskip("moto", reason="the S3 tests need moto[server] (extra [dev])")
    with s3_server("infokv-test"):
        yield "s3://infokv-test"


@pytest.fixture(params=["local", "file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> CacheBackend:
    if request.param == "local":
        return open_backend(tmp_path / "store")
    if request.param == "file":
        return open_backend(f"file://{tmp_path}/store")
    bucket = request.getfixturevalue("s3_bucket")
    return open_backend(f"{bucket}/{tmp_path.name}")  # a fresh prefix per test


@pytest.fixture(scope="module")
def doc_a(random_engine: InfoKVEngine) -> CompressedDocument:
    return random_engine.ingest_text(TEXT_A, CompressionConfig(keep=0.25))


@pytest.fixture(scope="module")
def doc_b(random_engine: InfoKVEngine) -> CompressedDocument:
    return random_engine.ingest_text(TEXT_B, CompressionConfig(keep=0.5))


def test_open_backend_picks_by_url(tmp_path: Path) -> None:
    assert isinstance(open_backend(tmp_path), LocalBackend)
    assert isinstance(open_backend(f"file://{tmp_path}"), FsspecBackend)


def test_publish_then_load_gives_the_same_document_and_answer(
    backend: CacheBackend, random_engine: InfoKVEngine, doc_a: CompressedDocument, doc_b: CompressedDocument
) -> None:
    with pytest.raises(CacheStoreError):
        backend.load(random_engine, KEY)  # nothing published yet
    backend.publish(KEY, doc_a)
    loaded = backend.load(random_engine, KEY)
    assert_same_document(loaded, doc_a)
    assert loaded.ask(QUESTION, max_new_tokens=6) == doc_a.ask(QUESTION, max_new_tokens=6)
    backend.publish(KEY, doc_b)  # a new publish replaces the cache
    assert_same_document(backend.load(random_engine, KEY), doc_b)


def test_a_loaded_cold_tier_is_mapped_from_a_file_from_every_store(
    backend: CacheBackend, random_engine: InfoKVEngine
) -> None:
    """A cold tier read from an object store was held in the process's memory, twice what the README says a
    recalling document holds resident; it is mapped from a private temporary copy, as a local one is mapped."""
    document = random_engine.ingest_text(TEXT_A, CompressionConfig(keep=0.25, recall=0.1))
    backend.publish(KEY, document)
    loaded = backend.load(random_engine, KEY)
    assert loaded.cold_tier is not None and loaded.cold_tier.source is not None
    assert loaded.ask(QUESTION, max_new_tokens=6) == document.ask(QUESTION, max_new_tokens=6)
    codes = loaded.cold_tier.layers[0].heads[0]
    mapped = [tensor for tensor in vars(codes).values() if isinstance(tensor, torch.Tensor)]
    assert mapped and all(not tensor.untyped_storage().resizable() for tensor in mapped)


def test_records_beside_the_cache(backend: CacheBackend, doc_a: CompressedDocument) -> None:
    assert backend.children("documents") == []
    backend.put(KEY, "meta.json", b'{"owner": "tenantA"}')
    backend.put(KEY, "meta.json", b'{"owner": "tenantB"}')
    backend.publish(KEY, doc_a)
    backend.put("documents/doc_2", "meta.json", b"{}")
    assert backend.get(KEY, "meta.json") == b'{"owner": "tenantB"}'
    assert backend.children("documents") == ["doc_1", "doc_2"]
    with pytest.raises(FileNotFoundError):
        backend.get(KEY, "absent.json")
    backend.remove(KEY, last="meta.json")
    assert backend.children("documents") == ["doc_2"]
    with pytest.raises(FileNotFoundError):
        backend.get(KEY, "meta.json")


@pytest.fixture(params=["file", "s3"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> FsspecBackend:
    if request.param == "file":
        backend = open_backend(f"file://{tmp_path}/store")
    else:
        backend = open_backend(f"{request.getfixturevalue('s3_bucket')}/{tmp_path.name}")
    assert isinstance(backend, FsspecBackend)
    return backend


def _version_dir(backend: FsspecBackend, name: str) -> str:
    return f"{backend.root}/{KEY}/{CACHE}/{name}"


def test_a_publish_killed_before_its_pointer_is_never_read(
    shared_backend: FsspecBackend, random_engine: InfoKVEngine, doc_a: CompressedDocument, doc_b: CompressedDocument
) -> None:
    fs = shared_backend.fs
    shared_backend.publish(KEY, doc_a)
    # A second publisher died after writing some of its files: no manifest, no new CURRENT.
    files = encode_document(doc_b)
    fs.makedirs(_version_dir(shared_backend, "99999999999999999999-dead"), exist_ok=True)
    fs.pipe_file(f"{_version_dir(shared_backend, '99999999999999999999-dead')}/{TENSORS}", files[TENSORS])
    assert_same_document(shared_backend.load(random_engine, KEY), doc_a)


def test_a_torn_or_damaged_cache_is_refused(
    shared_backend: FsspecBackend, random_engine: InfoKVEngine, doc_a: CompressedDocument
) -> None:
    fs = shared_backend.fs
    shared_backend.publish(KEY, doc_a)
    pointer = json.loads(shared_backend.get(f"{KEY}/{CACHE}", CURRENT))
    version = _version_dir(shared_backend, pointer["version"])
    tensors = fs.cat_file(f"{version}/{TENSORS}")
    fs.pipe_file(f"{version}/{TENSORS}", tensors[: len(tensors) // 2])  # truncated
    with pytest.raises(CacheStoreError, match="sha256"):
        shared_backend.load(random_engine, KEY)
    fs.pipe_file(f"{version}/{TENSORS}", tensors)
    fs.rm(f"{version}/{MANIFEST}")  # a pointer to a version without its manifest
    with pytest.raises(CacheStoreError, match="manifest"):
        shared_backend.load(random_engine, KEY)
    shared_backend.put(f"{KEY}/{CACHE}", CURRENT, b"{not json")
    with pytest.raises(CacheStoreError, match="damaged"):
        shared_backend.load(random_engine, KEY)


def test_concurrent_publishers_never_tear_a_cache(
    shared_backend: FsspecBackend, random_engine: InfoKVEngine, doc_a: CompressedDocument, doc_b: CompressedDocument
) -> None:
    shared_backend.publish(KEY, doc_a)
    stop = threading.Event()
    failures: list[BaseException] = []
    loads: list[int] = []

    def publisher(document: CompressedDocument) -> None:
        try:
            for _ in range(3):
                shared_backend.publish(KEY, document)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    def reader() -> None:
        while not stop.is_set():
            try:
                loaded = shared_backend.load(random_engine, KEY)
                assert loaded.document.text in (TEXT_A, TEXT_B)
                assert_same_document(loaded, doc_a if loaded.document.text == TEXT_A else doc_b)
                loads.append(1)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)
                return

    readers = [threading.Thread(target=reader) for _ in range(2)]
    publishers = [threading.Thread(target=publisher, args=(doc,)) for doc in (doc_a, doc_b, doc_a, doc_b)]
    for thread in readers + publishers:
        thread.start()
    for thread in publishers:
        thread.join(120)
    stop.set()
    for thread in readers:
        thread.join(60)
    assert not failures, failures
    assert loads, "the readers loaded while publishers wrote"
    final = shared_backend.load(random_engine, KEY)
    assert final.document.text in (TEXT_A, TEXT_B)


def test_a_listing_that_lands_late_does_not_hide_a_publishers_own_object(
    s3_bucket: str,
    tmp_path: Path,
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    doc_b: CompressedDocument,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Publishers of one key share a filesystem object. One thread's listing of the cache directory, begun before
    another thread wrote its temporary CURRENT and stored after, must not make that thread's move fail with
    "not found" (seen in CI on s3, where a move reads the object's size from a cached listing; a local
    filesystem reads no listing there)."""
    shared_backend = FsspecBackend(f"{s3_bucket}/{tmp_path.name}")
    shared_backend.publish(KEY, doc_a)
    fs = shared_backend.fs
    directory = f"{shared_backend.root}/{KEY}/{CACHE}"
    listing_begun_before = fs.ls(directory, detail=True)
    write = fs.pipe_file

    def write_then_the_other_listing_lands(path: str, value: bytes, **options: object) -> None:
        write(path, value, **options)
        if path.endswith(".tmp"):
            fs.dircache[directory] = listing_begun_before

    monkeypatch.setattr(fs, "pipe_file", write_then_the_other_listing_lands)
    shared_backend.publish(KEY, doc_b)
    assert_same_document(shared_backend.load(random_engine, KEY), doc_b)


def test_a_listings_cache_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot keep a listings cache"):
        FsspecBackend(f"file://{tmp_path}/store", use_listings_cache=True)


def test_a_chained_url_is_refused(tmp_path: Path) -> None:
    # Through simplecache:: one process kept reading the first CURRENT after another had replaced it.
    for chain in ("simplecache", "filecache"):
        with pytest.raises(ConfigError, match="chained URL"):
            open_backend(f"{chain}::file://{tmp_path}/store")


def test_a_replaced_version_stays_an_hour_after_it_was_replaced_however_old(
    shared_backend: FsspecBackend,
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    doc_b: CompressedDocument,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A version made two hours ago and current until now may have a reader that has just followed CURRENT to it:
    the publish that replaces it must not remove it before STALE_SECONDS have passed since."""
    made_long_ago = _publish_long_ago(shared_backend, doc_a, monkeypatch)
    followed = json.loads(shared_backend.get(f"{KEY}/{CACHE}", CURRENT))["version"]
    assert followed == made_long_ago
    shared_backend.publish(KEY, doc_b)  # replaces it, and sweeps
    assert followed in shared_backend.children(f"{KEY}/{CACHE}"), "removed under its reader"
    # Once STALE_SECONDS have passed since it was replaced, the next publish removes it.
    retired = f"{KEY}/{CACHE}/{followed}"
    shared_backend.put(retired, RETIRED, str(time.time() - STALE_SECONDS - 1).encode())
    shared_backend.publish(KEY, doc_a)
    assert followed not in shared_backend.children(f"{KEY}/{CACHE}")
    assert_same_document(shared_backend.load(random_engine, KEY), doc_a)


def _publish_long_ago(backend: FsspecBackend, document: CompressedDocument, monkeypatch: pytest.MonkeyPatch) -> str:
    """Publishes `document` as a version made two STALE_SECONDS ago (current until now); returns its name."""
    made_long_ago = f"{time.time_ns() - int(2 * STALE_SECONDS * 1e9):020d}-{'a' * 12}"
    with monkeypatch.context() as patch:
        patch.setattr(cache_backends, "_version_name", lambda: made_long_ago)
        backend.publish(KEY, document)
    return made_long_ago


def test_a_sweep_just_after_current_moved_keeps_the_version_it_replaced(
    shared_backend: FsspecBackend,
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    doc_b: CompressedDocument,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another publisher's sweep runs just after this publish moved CURRENT off an old version: that version
    is already marked retired (now), so the sweep keeps it for the reader that had just followed CURRENT to
    it, and this publish succeeds."""
    followed = _publish_long_ago(shared_backend, doc_a, monkeypatch)
    other = FsspecBackend(shared_backend.url)  # another process
    replace = shared_backend._replace

    def replace_then_other_publishes(path: str, data: bytes) -> None:
        replace(path, data)
        if path.endswith(f"/{CURRENT}"):
            other.publish(KEY, doc_b)

    monkeypatch.setattr(shared_backend, "_replace", replace_then_other_publishes)
    shared_backend.publish(KEY, doc_a)
    files = cache_backends._StoredFiles(shared_backend.fs, _version_dir(shared_backend, followed), "the reader's")
    assert_same_document(random_engine.load_files(files), doc_a)


def test_a_version_removed_before_it_is_marked_retired_fails_no_publish(
    shared_backend: FsspecBackend, doc_a: CompressedDocument, monkeypatch: pytest.MonkeyPatch
) -> None:
    replaced = _publish_long_ago(shared_backend, doc_a, monkeypatch)
    pipe_file = shared_backend.fs.pipe_file

    def removed_first(path: str, data: bytes, **options: object) -> None:
        if path.endswith(f"{replaced}/{RETIRED}"):  # another publisher's sweep took it a moment before
            shared_backend.fs.rm(_version_dir(shared_backend, replaced), recursive=True)
        pipe_file(path, data, **options)

    monkeypatch.setattr(shared_backend.fs, "pipe_file", removed_first)
    shared_backend.publish(KEY, doc_a)
    assert json.loads(shared_backend.get(f"{KEY}/{CACHE}", CURRENT))["version"] != replaced


def test_a_sweep_never_removes_the_current_version(
    shared_backend: FsspecBackend,
    random_engine: InfoKVEngine,
    doc_a: CompressedDocument,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publish that marked the current version retired and then failed to move CURRENT leaves it marked; once
    that mark is old, a sweep still keeps it while CURRENT names it."""
    current = _publish_long_ago(shared_backend, doc_a, monkeypatch)
    shared_backend.put(f"{KEY}/{CACHE}/{current}", RETIRED, str(time.time() - STALE_SECONDS - 1).encode())
    FsspecBackend(shared_backend.url)._sweep(KEY, keep="another-version")
    assert_same_document(shared_backend.load(random_engine, KEY), doc_a)


def _remove_at_once(backend: CacheBackend, key: str, start: threading.Barrier, failures: list[BaseException]) -> None:
    start.wait()
    try:
        backend.remove(key, last="meta.json")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        failures.append(exc)


@pytest.mark.parametrize("kind", ["local", "file"])
def test_two_removals_of_one_key_at_once_both_succeed(kind: str, tmp_path: Path, doc_a: CompressedDocument) -> None:
    """Two replicas deleting one document at once (or a delete meeting the other's cleanup): whichever removes
    an entry first, neither fails, and nothing is left."""
    backend = open_backend(tmp_path / "store" if kind == "local" else f"file://{tmp_path}/store")
    for trial in range(20):
        key = f"documents/doc_{trial}"
        backend.publish(key, doc_a)
        for name in ("meta.json", "document.json", "extra.json"):
            backend.put(key, name, b"{}")
        failures: list[BaseException] = []
        start = threading.Barrier(2)
        threads = [threading.Thread(target=_remove_at_once, args=(backend, key, start, failures)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not failures, (trial, failures)
        assert not (tmp_path / "store" / "documents" / f"doc_{trial}").exists()


class EndpointConnectionError(Exception):
    """Stands for botocore's, which s3fs re-raises once its retries are spent: not an OSError."""


EndpointConnectionError.__module__ = "botocore.exceptions"


def test_a_transport_error_of_the_store_is_an_oserror(tmp_path: Path) -> None:
    """An unreachable S3 store raised botocore's EndpointConnectionError through every `except OSError`: the service
    answered 500 where a store that cannot be read answers 503 to retry. Other errors pass unchanged."""
    backend = open_backend(f"file://{tmp_path}/store")
    assert isinstance(backend, FsspecBackend)
    fs = backend.fs._fs

    def unreachable(*args: Any, **kwargs: Any) -> bytes:
        raise EndpointConnectionError('Could not connect to the endpoint URL: "http://s3.invalid/"')

    fs.cat_file = unreachable
    with pytest.raises(ConnectionError, match="EndpointConnectionError: Could not connect"):
        backend.get(KEY, "meta.json")

    def broken(*args: Any, **kwargs: Any) -> bytes:
        raise KeyError("a bug, not the transport")

    fs.cat_file = broken
    with pytest.raises(KeyError):
        backend.get(KEY, "meta.json")


def test_a_version_whose_retirement_cannot_be_read_is_not_swept(
    tmp_path: Path, doc_a: CompressedDocument, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced version whose RETIRED mark could not be read was dated by its creation: one made long ago but
    replaced a moment ago was removed under its readers. It is left to a later sweep."""
    backend = open_backend(f"file://{tmp_path}/store")
    assert isinstance(backend, FsspecBackend)
    backend.publish(KEY, doc_a)
    first = backend.children(f"{KEY}/cache")
    monkeypatch.setattr(cache_backends, "_version_time", lambda name: 0.0)  # every version made long ago
    get = backend.get

    def mark_unreadable(key: str, name: str) -> bytes:
        if name == "RETIRED":
            raise OSError(errno.EIO, "SlowDown (simulated)")
        return get(key, name)

    monkeypatch.setattr(backend, "get", mark_unreadable)
    backend.publish(KEY, doc_a)
    backend.publish(KEY, doc_a)
    left = set(backend.children(f"{KEY}/cache"))
    assert set(first) - {"CURRENT"} <= left, "the first version, replaced a moment ago, was removed"
