"""What several test modules share: the framework adapters' facts, running an example as a user does, a
document's cache at the model's dtype, a saved cache re-signed, and a Hugging Face hub cache built from a local
model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from infokv_rag import CompressedDocument, CompressionConfig
from infokv_rag.cache import DocumentCache
from infokv_rag.store import MANIFEST, TENSORS, _manifest_checksum

ROOT = Path(__file__).resolve().parents[1]

# The framework adapters (LangChain, LlamaIndex) ----------------------------------------------------

FACT_PAGES = [
    (
        "Service Agreement between Orion Logistics Ltd and Blue Harbor Foods.\n"
        "1. Term. This agreement starts on 1 March 2024 and runs for two years."
    ),
    (
        "2. Contact. The account manager is Maria Lindqvist, phone 555-0142.\n"
        "3. Notice. Either party may terminate this agreement with ninety days written notice."
    ),
    "4. Payment. The customer pays 12,500 EUR per month.\n5. Law. This agreement is governed by the laws of Sweden.",
]
# The fact checks test the adapters, not the compression: the tiny model reads these facts from a full
# cache, while whether a compressed one keeps them moves with every scorer change. The compressed path is
# covered by the standard suites (default config), by the engine-equality tests and the default-model test.
COMPRESSION = CompressionConfig(method="full")
COMPRESSED = CompressionConfig(method="infokv", keep=0.5)
QUESTION = "Question: {question}\nAnswer concisely, using only the document above."


def run_example(script: str, document: Path, question: str) -> list[str]:
    """stdout lines of `python examples/<script>` on the tiny model over `document` (full cache, 12 tokens)."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / script),
            "--model",
            "tiny",
            "--document",
            str(document),
            "--method",
            "full",
            "--max-tokens",
            "12",
            "--question",
            question,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


# A document's cache --------------------------------------------------------------------------------


def document_cache(document: CompressedDocument) -> DocumentCache:
    """`document`'s cache at the model's dtype (`DocumentCache`): what every config but stored bits holds."""
    cache = document.cache
    assert isinstance(cache, DocumentCache), type(cache)
    return cache


def resign(path: Path, tensors: dict[str, torch.Tensor], name: str = TENSORS) -> None:
    """Writes `tensors` as the saved cache's file `name` and re-signs the manifest, as a broken tool would."""
    data = save(tensors)
    (path / name).write_bytes(data)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["checksum"] = _manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def rename_saved_model(path: Path, name: str) -> None:
    """Rewrites the model the saved cache's manifest names and re-signs it: a cache made by a model since moved."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["model"]["name"] = name
    manifest["checksum"] = _manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def record_engine_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names the adapters ask their shared engines for from now on (`integrations._common.get_engine`)."""
    from infokv_rag.integrations import _common

    asked: list[str] = []
    load = _common.get_engine

    def recorded(name: str, device: str | None = None, dtype: str | None = None) -> Any:
        asked.append(name)
        return load(name, device, dtype)

    monkeypatch.setattr(_common, "get_engine", recorded)
    return asked


def record_texts_read_with_one_shared_document(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the engine reads from now on (`InfoKVEngine.ingest_text`), while the adapters' shared cache holds
    one document: what an adapter reads again once other adapters' documents evicted its own."""
    from infokv_rag import InfoKVEngine
    from infokv_rag.integrations import _common
    from infokv_rag.loaded import LoadOnceCache

    read: list[str] = []
    ingest_text = InfoKVEngine.ingest_text

    def recorded(self: InfoKVEngine, text: str, *args: Any, **kwargs: Any) -> CompressedDocument:
        read.append(text)
        return ingest_text(self, text, *args, **kwargs)

    monkeypatch.setattr(InfoKVEngine, "ingest_text", recorded)
    monkeypatch.setattr(_common, "_DOCUMENTS", LoadOnceCache(capacity=1))
    return read


# A Hugging Face hub cache, laid out as huggingface_hub lays it out -----------------------------------


def _blob_name(path: Path) -> str:
    """The name huggingface_hub gives a file's blob: its sha256 for an LFS file (the weights), the git blob
    sha1 for a plain one (configs, tokenizer files)."""
    if path.suffix == ".safetensors":
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        return digest.hexdigest()
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_hub_cache(hub_cache: Path, repo_id: str, source: Path, refs: Sequence[str] = ("main",)) -> str:
    """Lays a model directory out in a hub cache (`$HF_HOME/hub`) as a download of `repo_id` would:
    models--org--name/blobs/<hash> (hard links to `source`'s files where possible), snapshots/<commit>/<file>
    as relative symlinks to the blobs, and refs/<ref> holding the commit. Returns the commit (40 hex digits,
    derived from `refs`, so two calls with other refs make two commits)."""
    storage = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}:{','.join(refs)}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name == "infokv_model.json":  # infokv-rag's own record, not a model file
            continue
        blob = storage / "blobs" / _blob_name(path)
        if not blob.exists():
            try:
                os.link(path, blob)
            except OSError:
                shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return commit
