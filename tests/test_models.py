"""Models users bring: hub ids (offline, from a hub cache built here), models in memory, device and dtype,
and the architectures the runner supports. Nothing here reaches a network: hub ids are read with
HF_HUB_OFFLINE=1 from a cache laid out in a temporary HF_HOME, and the hub's error answers come from a
mock transport inside the process.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest
import torch

from infokv_rag import CacheStoreError, CompressionConfig, ConfigError, InfoKVEngine, ModelError
from infokv_rag.architectures import SUPPORTED_ARCHITECTURES
from infokv_rag.models import (
    FINGERPRINT_FILE,
    _config_fingerprint,
    _write_fingerprint,
    cache_root,
    model_fingerprint,
    resolve_model,
)
from infokv_rag.placement import dtype_name, resolve_placement

from .conftest import CORPUS, build_tokenizer
from .helpers import FACT_PAGES, build_hub_cache, document_cache

if TYPE_CHECKING:
    import httpx2
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TEXT = " ".join(CORPUS * 6)
QUESTION = "What is the notice period?"
REPO = "infokv-test/random-llama"


def _install_transport(monkeypatch: pytest.MonkeyPatch, handler: Callable[[httpx2.Request], httpx2.Response]) -> None:
    """Routes every request huggingface_hub makes to `handler` (restored after the test)."""
    import httpx2
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", lambda: httpx2.Client(transport=httpx2.MockTransport(handler)))


def _no_network(request: object) -> NoReturn:
    raise AssertionError(f"a test reached for the network: {request}")


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline; any request huggingface_hub would still make fails the test."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    _install_transport(monkeypatch, _no_network)
    return home


@pytest.fixture
def hub_random(hf_home: Path, random_model_dir: Path) -> dict[str, str]:
    """The random model published as REPO at two commits: main, and v2 (same files)."""
    return {
        "main": build_hub_cache(hf_home / "hub", REPO, random_model_dir, refs=("main",)),
        "v2": build_hub_cache(hf_home / "hub", REPO, random_model_dir, refs=("v2",)),
    }


# Hub ids --------------------------------------------------------------------------------------------


def test_hub_id_loads_offline_from_the_hf_cache(hub_random: dict[str, str], random_engine: InfoKVEngine) -> None:
    engine = InfoKVEngine.from_pretrained(REPO, device="cpu")
    assert engine.name == REPO
    assert engine.model_dir is not None and engine.model_dir.name == hub_random["main"]
    assert engine.model_dir.parent.parent.name == "models--infokv-test--random-llama"
    config = CompressionConfig(keep=0.5)
    expected = random_engine.ingest_text(TEXT, config).ask(QUESTION, max_new_tokens=10)
    assert engine.ingest_text(TEXT, config).ask(QUESTION, max_new_tokens=10) == expected


def test_a_hub_model_whose_weights_download_on_its_first_load_loads(
    hub_random: dict[str, str], hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The download puts the weights in the snapshot directory beside the config read before it: that was taken
    for files changed while the model loaded, and every first load of a hub model failed."""
    import infokv_rag.models as models_module

    snapshot = hf_home / "hub" / "models--infokv-test--random-llama" / "snapshots" / hub_random["main"]
    weights = snapshot / "model.safetensors"
    blob = os.readlink(weights)
    weights.unlink()  # as after the fetch of the metadata files alone

    def download(repo_id: str, revision: str | None, patterns: list[str], label: str) -> Path:
        if "model.safetensors" in patterns:  # the weights (the metadata files are fetched first)
            weights.symlink_to(blob)
        return snapshot

    monkeypatch.setattr(models_module, "hub_snapshot", download)
    engine = InfoKVEngine.from_pretrained(REPO, device="cpu")
    assert engine.model_dir == snapshot and weights.is_symlink()


def test_cache_saved_under_one_revision_is_refused_under_another(hub_random: dict[str, str], tmp_path: Path) -> None:
    main = InfoKVEngine.from_pretrained(REPO, device="cpu")
    v2 = InfoKVEngine.from_pretrained(REPO, device="cpu", revision="v2")
    assert v2.name == f"{REPO}@v2"
    assert v2.model_dir is not None and v2.model_dir.name == hub_random["v2"]
    saved = main.ingest_text(TEXT, CompressionConfig(keep=0.5)).save(tmp_path / "cache")
    with pytest.raises(CacheStoreError, match=f"made by model '{REPO}'.*not by the loaded model '{REPO}@v2'"):
        v2.load(saved)
    # The same commit named by its hash (here in the id) is the same model.
    same = InfoKVEngine.from_pretrained(f"{REPO}@{hub_random['main']}", device="cpu")
    assert same.fingerprint == main.fingerprint
    assert same.load(saved).ask(QUESTION, max_new_tokens=6) == main.load(saved).ask(QUESTION, max_new_tokens=6)


def test_hub_fingerprint_covers_repo_id_commit_and_weights(
    hub_random: dict[str, str], hf_home: Path, random_model_dir: Path, tmp_path: Path
) -> None:
    fingerprint = resolve_model(REPO).fingerprint()
    assert resolve_model(REPO, revision="v2").fingerprint() != fingerprint, "another commit"
    build_hub_cache(hf_home / "hub", "infokv-test/renamed", random_model_dir)
    assert resolve_model("infokv-test/renamed").fingerprint() != fingerprint, "another repo id"
    # Same repo id and commit, other weights (another cache): another fingerprint.
    other = Path(shutil.copytree(random_model_dir, tmp_path / "other"))
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    build_hub_cache(tmp_path / "other-hf" / "hub", REPO, other)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(tmp_path / "other-hf"))
        moved = resolve_model(REPO)
        assert moved.hub == resolve_model(REPO).hub
        assert moved.fingerprint() != fingerprint, "other weights"


def test_offline_without_a_cached_copy_names_the_id(hf_home: Path) -> None:
    with pytest.raises(ModelError, match=r"Qwen/Qwen2.5-7B-Instruct is not in the local Hugging Face cache") as error:
        InfoKVEngine.from_pretrained("Qwen/Qwen2.5-7B-Instruct", device="cpu")
    assert str(hf_home / "hub") in str(error.value) and "HF_HUB_OFFLINE" in str(error.value)


def test_offline_unknown_revision_is_named(hub_random: dict[str, str]) -> None:
    with pytest.raises(ModelError, match=rf"{REPO}@nope is not in the local .* at revision 'nope'"):
        resolve_model(f"{REPO}@nope")


@pytest.mark.parametrize(
    ("repo", "status", "code", "message"),
    [
        ("infokv-test/gated", 403, "GatedRepo", "is a gated model on the Hugging Face hub: accept its terms"),
        ("infokv-test/missing", 404, "RepoNotFound", "is missing: the Hugging Face hub has no model"),
        ("infokv-test/no-revision", 404, "RevisionNotFound", "has no revision 'main'"),
    ],
)
def test_hub_answers_become_clear_errors(
    repo: str, status: int, code: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, the hub's answers (from a mock transport: no network) name the id and the cause."""
    import httpx2
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    requests: list[str] = []

    def hub(request: httpx2.Request) -> httpx2.Response:
        requests.append(request.url.path)
        return httpx2.Response(status, headers={"X-Error-Code": code}, request=request)

    _install_transport(monkeypatch, hub)
    revision = "main" if code == "RevisionNotFound" else None
    with pytest.raises(ModelError, match=message) as error:
        InfoKVEngine.from_pretrained(repo, device="cpu", revision=revision)
    assert repo in str(error.value)
    assert any(path.startswith(f"/api/models/{repo}/revision/") for path in requests), requests


def test_unreachable_hub_without_a_cached_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx2
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def down(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("no route to host", request=request)

    _install_transport(monkeypatch, down)
    with pytest.raises(ModelError, match="infokv-test/anything could not be downloaded .* unreachable"):
        resolve_model("infokv-test/anything")


def test_names_that_are_not_hub_ids(hub_random: dict[str, str], random_model_dir: Path) -> None:
    with pytest.raises(ModelError, match="cannot resolve model 'tinyy'.*org/name"):
        resolve_model("tinyy")  # a bare name is never looked up on the hub
    with pytest.raises(ModelError, match="cannot resolve model '/no/such/model'"):
        resolve_model(Path("/no/such/model"))  # a path object, as from_pretrained takes: not an AttributeError
    as_path, as_text = resolve_model(random_model_dir), resolve_model(str(random_model_dir))
    assert as_path.weights_directory() == as_text.weights_directory()
    with pytest.raises(ModelError, match="names revision 'v2' but revision='v3'"):
        resolve_model(f"{REPO}@v2", revision="v3")
    with pytest.raises(ModelError, match="applies to hub ids only"):
        resolve_model(str(random_model_dir), revision="main")
    with pytest.raises(ModelError, match="directory without config.json"):
        resolve_model(str(random_model_dir.parent))


@pytest.mark.tiny
def test_tiny_model_loads_by_hub_id_from_a_hub_layout_cache(hf_home: Path, tiny_engine: InfoKVEngine) -> None:
    from infokv_rag.models import resolve_model_dir

    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    commit = build_hub_cache(hf_home / "hub", repo, resolve_model_dir("tiny"))
    engine = InfoKVEngine.from_pretrained(repo, device="cpu")
    assert engine.name == repo and engine.model_dir is not None and engine.model_dir.name == commit
    assert engine.runner.num_layers == 30 and engine.runner.dtype == torch.float32
    text = "\n".join(FACT_PAGES)
    config = CompressionConfig(method="full")
    question = "Who is the account manager?"
    expected = tiny_engine.ingest_text(text, config).ask(question, max_new_tokens=12)
    assert engine.ingest_text(text, config).ask(question, max_new_tokens=12) == expected
    assert engine.fingerprint != tiny_engine.fingerprint, "a hub model's identity includes its repo id and commit"


def test_a_config_edit_that_changes_the_computation_is_another_model(
    random_engine: InfoKVEngine, random_model_dir: Path, tmp_path: Path
) -> None:
    """The same weights and tokenizer under another norm epsilon (or rotary scaling: Qwen2.5's YaRN is an edit
    of config.json) compute something else: saved caches must not pass from one to the other."""
    copy = shutil.copytree(random_model_dir, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"  # names and versions change nothing
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) == model_fingerprint(random_model_dir)
    config["partial_rotary_factor"] = 0.5  # top level, as in Phi-3's config.json: rotates half of each head
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) != model_fingerprint(random_model_dir)
    del config["partial_rotary_factor"]
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (copy / "config.json").write_text(json.dumps(config))
    edited = InfoKVEngine.from_pretrained(str(copy), device="cpu")
    assert edited.fingerprint != random_engine.fingerprint
    saved = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.5)).save(tmp_path / "cache")
    with pytest.raises(CacheStoreError, match="made by model"):
        edited.load(saved)

    # A converted model's recorded fingerprint holds while its config is the one converted, and only then.
    record = {"fingerprint": "f" * 64, "config_sha256": _config_fingerprint(copy)}
    (copy / FINGERPRINT_FILE).write_text(json.dumps(record))
    assert model_fingerprint(copy) == "f" * 64
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) not in ("f" * 64, edited.fingerprint)
    (copy / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": "f" * 64}))  # converted before it was recorded
    assert model_fingerprint(copy) == "f" * 64

    # In memory, the same.
    model, tokenizer = _load(random_model_dir)
    reference = InfoKVEngine.from_model(model, tokenizer).fingerprint
    model, tokenizer = _load(random_model_dir)
    model.config.rms_norm_eps *= 10
    assert InfoKVEngine.from_model(model, tokenizer).fingerprint != reference


def test_an_engine_signs_caches_as_the_weights_it_loaded_not_those_written_over_them_since(
    random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fingerprint was computed from the directory at the first save: weights written over it meanwhile (a new
    checkpoint) signed the old weights' caches as the new model's, and an engine of the new weights answered from
    them. It is computed as the weights load, and a directory that changes while they load is refused."""
    copy = shutil.copytree(random_model_dir, tmp_path / "model")
    old = InfoKVEngine.from_pretrained(str(copy), device="cpu")
    model, _ = _load(copy)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    model.save_pretrained(copy)
    saved = old.ingest_text(TEXT, CompressionConfig(keep=0.5)).save(tmp_path / "cache")
    new = InfoKVEngine.from_pretrained(str(copy), device="cpu")
    assert new.fingerprint != old.fingerprint
    with pytest.raises(CacheStoreError, match="made by model .*the same name: other weights, files or config"):
        new.load(saved)

    import infokv_rag.engine as engine_module

    load_weights = engine_module.load_weights

    def written_over_while_loading(directory: Path, *args: Any) -> PreTrainedModel:
        loaded = load_weights(directory, *args)
        (directory / "model.safetensors").touch()
        return loaded

    monkeypatch.setattr(engine_module, "load_weights", written_over_while_loading)
    with pytest.raises(ModelError, match="changed while it loaded; load it again"):
        InfoKVEngine.from_pretrained(str(copy), device="cpu")


def test_a_converted_model_edited_since_its_conversion_is_another_model(random_model_dir: Path, tmp_path: Path) -> None:
    """A converted directory's recorded fingerprint holds only while its tokenizer files and weights are the
    ones converted: another chat template or a fine-tune saved over the copy is another model."""
    from safetensors.torch import load_file, save_file

    converted = Path(shutil.copytree(random_model_dir, tmp_path / "converted"))
    _write_fingerprint(converted, "a" * 64, source="test.gguf")
    recorded = json.loads((converted / FINGERPRINT_FILE).read_text())["fingerprint"]
    assert model_fingerprint(converted) == recorded
    template = converted / "chat_template.jinja"
    original = template.read_text()
    template.write_text("{{ 'You are a pirate.' }}" + original)
    assert model_fingerprint(converted) != recorded, "another chat template"
    template.write_text(original)
    assert model_fingerprint(converted) == recorded
    weights = converted / "model.safetensors"
    os.utime(weights, ns=(1, 1))  # a new stamp, the same content (a copy without -p): as converted
    assert model_fingerprint(converted) == recorded
    tensors = load_file(weights)
    save_file({k: v * 1.5 for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    edited = model_fingerprint(converted)
    assert edited not in (recorded, model_fingerprint(random_model_dir)), "other weights"

    # A record written before weights were recorded: weights written after it are read again.
    record = json.loads((converted / FINGERPRINT_FILE).read_text())
    legacy = {key: record[key] for key in ("format", "source", "weights_sha256", "tokenizer_sha256", "fingerprint")}
    (converted / FINGERPRINT_FILE).write_text(json.dumps(legacy))
    os.utime(weights, ns=(1, 1))
    assert model_fingerprint(converted) == recorded, "weights older than the record: as converted"
    save_file(tensors, weights, metadata={"format": "pt"})
    assert model_fingerprint(converted) != recorded


def _template_as_json(directory: Path) -> None:
    template = directory / "chat_template.jinja"
    (directory / "chat_template.json").write_text(
        json.dumps({"chat_template": "SYSTEM: be terse\n" + template.read_text()})
    )
    template.unlink()


def _added_tokens(directory: Path) -> None:
    (directory / "added_tokens.json").write_text(json.dumps({"12,500": 400}))


def _additional_default_template(directory: Path) -> None:
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "default.jinja").write_text("{{ 'In French.' }}")


@pytest.mark.parametrize("edit", [_template_as_json, _added_tokens, _additional_default_template])
def test_every_tokenizer_file_the_tokenizer_reads_is_in_the_fingerprint(
    edit: Callable[[Path], None], random_model_dir: Path, tmp_path: Path
) -> None:
    """Each edit changes the token ids or the chat template the loaded tokenizer uses: another model."""
    from transformers import AutoTokenizer

    edited = Path(shutil.copytree(random_model_dir, tmp_path / "edited"))
    edit(edited)
    before, after = AutoTokenizer.from_pretrained(random_model_dir), AutoTokenizer.from_pretrained(edited)
    text = "Payment of 12,500 EUR is due."
    assert (before.chat_template, before.encode(text)) != (after.chat_template, after.encode(text))
    assert model_fingerprint(edited) != model_fingerprint(random_model_dir)


# Models in memory -----------------------------------------------------------------------------------


def _load(directory: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype), AutoTokenizer.from_pretrained(directory)


def test_from_model_answers_equal_from_pretrained(random_engine: InfoKVEngine, random_model_dir: Path) -> None:
    model, tokenizer = _load(random_model_dir)
    engine = InfoKVEngine.from_model(model, tokenizer, name="in-memory")
    assert engine.name == "in-memory" and engine.model_dir is None
    for config in (CompressionConfig(method="full"), CompressionConfig(keep=0.25)):
        ours, theirs = engine.ingest_text(TEXT, config), random_engine.ingest_text(TEXT, config)
        for mine, reference in zip(document_cache(ours).layers, document_cache(theirs).layers, strict=True):
            assert torch.equal(mine.positions, reference.positions), config.method
        assert ours.ask(QUESTION, max_new_tokens=12) == theirs.ask(QUESTION, max_new_tokens=12), config.method


def test_from_model_saves_and_loads_its_own_caches(random_model_dir: Path, tmp_path: Path) -> None:
    engine = InfoKVEngine.from_model(*_load(random_model_dir))
    doc = engine.ingest_text(TEXT, CompressionConfig(keep=0.5))
    loaded = engine.load(doc.save(tmp_path / "cache"))
    assert loaded.ask(QUESTION, max_new_tokens=8) == doc.ask(QUESTION, max_new_tokens=8)
    again = InfoKVEngine.from_model(*_load(random_model_dir))
    assert again.fingerprint == engine.fingerprint, "the same weights in memory are the same model"
    half = InfoKVEngine.from_model(*_load(random_model_dir, torch.bfloat16))
    assert half.fingerprint != engine.fingerprint, "the weights as they are in memory: another dtype, another model"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_model_in_any_dtype(dtype: torch.dtype, random_model_dir: Path) -> None:
    engine = InfoKVEngine.from_model(*_load(random_model_dir, dtype))
    assert engine.runner.dtype == dtype
    doc = engine.ingest_text(" ".join(CORPUS * 2), CompressionConfig(keep=0.25, chunk_size=64))
    assert all(layer.keys.dtype == dtype for layer in document_cache(doc).layers)
    assert doc.ask(QUESTION, max_new_tokens=6)


def test_from_model_refuses_what_it_cannot_drive(random_model_dir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model, tokenizer = _load(random_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(ModelError, match="has no chat template .* instruct"):
        InfoKVEngine.from_model(model, tokenizer)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=400))
    with pytest.raises(ModelError, match=r"is a 'gpt2' model \(GPT2LMHeadModel\).*does not support.*llama"):
        InfoKVEngine.from_model(gpt2, build_tokenizer())
    with pytest.raises(ModelError, match="not a causal LM with a language-model head"):
        InfoKVEngine.from_model(model.model, build_tokenizer())
    # A tokenizer of more tokens than the weights embed: from_pretrained's check, which from_model lacked (the first
    # prefill failed with a bare IndexError).
    narrow, _ = _load(random_model_dir)
    narrow.resize_token_embeddings(len(build_tokenizer()) - 1)
    with pytest.raises(ModelError, match=r"tokenizer has \d+ tokens but its weights embed \d+: pass the tokenizer"):
        InfoKVEngine.from_model(narrow, build_tokenizer())
    model.lm_head.to("meta")
    with pytest.raises(ModelError, match="not loaded .*meta"):
        InfoKVEngine.from_model(model, build_tokenizer())


def test_from_pretrained_refuses_before_the_weights_load(random_model_dir: Path, tmp_path: Path) -> None:
    base = Path(shutil.copytree(random_model_dir, tmp_path / "base"))
    for template in base.glob("chat_template*"):
        template.unlink()
    (base / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(ModelError, match=f"{base} has no chat template"):
        InfoKVEngine.from_pretrained(str(base), device="cpu")
    sliding = Path(shutil.copytree(random_model_dir, tmp_path / "sliding"))
    config = (sliding / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "mistral"')
    (sliding / "config.json").write_text(config.replace("{", '{"sliding_window": 512,', 1))
    (sliding / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(ModelError, match="sliding-window attention .window 512."):
        InfoKVEngine.from_pretrained(str(sliding), device="cpu")
    other = Path(shutil.copytree(random_model_dir, tmp_path / "other"))
    config = (other / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "granite"')
    (other / "config.json").write_text(config)
    with pytest.raises(ModelError, match="is a 'granite' model .*does not support"):
        InfoKVEngine.from_pretrained(str(other), device="cpu")
    # A field of the wrong type, a template that cannot render, a tokenizer of another model: each named before
    # the weights load (a traceback, a jinja2 error after the load, an IndexError at the first prefill).
    typed = Path(shutil.copytree(random_model_dir, tmp_path / "typed"))
    fields = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**fields, "num_hidden_layers": str(fields["num_hidden_layers"])}))
    broken = Path(shutil.copytree(random_model_dir, tmp_path / "broken"))
    for template in broken.glob("chat_template*"):
        template.unlink()
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}}{% endfor %")
    wider = Path(shutil.copytree(random_model_dir, tmp_path / "wider"))
    (wider / "config.json").write_text(json.dumps({**fields, "vocab_size": 100}))
    untyped = Path(shutil.copytree(random_model_dir, tmp_path / "untyped"))
    (untyped / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if k != "model_type"}))
    for model_dir, refusal in (
        (untyped, "its config.json names no model_type"),
        (typed, "its config.json cannot be read"),
        (broken, "its chat template cannot render a question"),
        (wider, "its tokenizer has [0-9]+ tokens but its weights embed 100"),
    ):
        (model_dir / "model.safetensors").write_bytes(b"never read")
        with pytest.raises(ModelError, match=refusal):
            InfoKVEngine.from_pretrained(str(model_dir), device="cpu")


def test_a_checkpoint_that_lacks_a_weight_is_refused(random_model_dir: Path, tmp_path: Path) -> None:
    """transformers initialises a missing weight at random: served, each load would be another model under one
    fingerprint, and a cache saved by one load would pass in the next."""
    from safetensors.torch import load_file, save_file

    incomplete = Path(shutil.copytree(random_model_dir, tmp_path / "incomplete"))
    weights = load_file(incomplete / "model.safetensors")
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, incomplete / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"lacks 1 weight\(s\) .*model.layers.1.self_attn.q_proj.weight"):
        InfoKVEngine.from_pretrained(str(incomplete), device="cpu")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "model.safetensors").unlink(), "{d} holds no weights"),
        (lambda d: _truncate(d / "model.safetensors"), "{d}/model.safetensors is damaged .* truncated"),
        (lambda d: (d / "model.safetensors").write_bytes(bytes(100)), "{d}/model.safetensors is damaged .*header"),
        (lambda d: (d / "tokenizer.json").unlink(), "the tokenizer in {d} cannot be loaded"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "the tokenizer in {d} cannot be loaded"),
    ],
)
def test_a_damaged_model_directory_is_a_model_error_naming_the_file(
    damage: Callable[[Path], None], message: str, random_model_dir: Path, tmp_path: Path
) -> None:
    damaged = Path(shutil.copytree(random_model_dir, tmp_path / "damaged"))
    damage(damaged)
    with pytest.raises(ModelError, match=message.format(d=re.escape(str(damaged))) + ".*complete copy"):
        InfoKVEngine.from_pretrained(str(damaged), device="cpu")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path, random_model_dir: Path) -> None:
    (tmp_path / "BAD.GGUF").write_bytes(bytes(range(256)) * 4)  # the suffix in any case
    with pytest.raises(ModelError, match="BAD.GGUF is not a GGUF file"):
        InfoKVEngine.from_pretrained(str(tmp_path / "BAD.GGUF"), device="cpu")
    with pytest.raises(ModelError, match="GGUF file not found"):
        InfoKVEngine.from_pretrained(str(tmp_path / "missing.gguf"), device="cpu")
    # A model directory named like a GGUF file is a model directory (it was "GGUF file not found").
    named = Path(shutil.copytree(random_model_dir, tmp_path / "Mistral-7B.gguf"))
    assert resolve_model(str(named)).directory == named


def test_a_gguf_of_an_unsupported_architecture_is_refused_before_its_conversion(tmp_path: Path) -> None:
    """It was refused once converted (for a 7B model, tens of GB dequantised first), and the copy stayed behind."""
    import gguf

    from infokv_rag import models

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="mamba.gguf is a 'mamba' model, which infokv-rag does not support"):
        models.convert_gguf(path, tmp_path / "converted", "a" * 64)
    assert not (tmp_path / "converted").exists()


def test_a_gguf_conversion_that_lacks_a_weight_saves_nothing(
    tmp_path: Path, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers left a weight the GGUF lacks at random and only logged it: the conversion saved that as the model,
    and every later load found every weight in place."""
    import transformers

    from infokv_rag import models

    model, tokenizer = _load(random_model_dir)
    lacking = {"missing_keys": ["model.layers.1.mlp.up_proj.weight"]}
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_, **__: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *_, **__: (model, lacking))
    monkeypatch.setattr(models, "_gguf_architecture", lambda _: "llama")
    with pytest.raises(ModelError, match=r"lacks 1 weight\(s\) the model needs \(model.layers.1.mlp.up_proj.weight\)"):
        models.convert_gguf(tmp_path / "model.gguf", tmp_path / "converted", "a" * 64)
    assert not (tmp_path / "converted").exists()


def test_a_gguf_cut_in_its_metadata_is_refused_naming_it(tmp_path: Path) -> None:
    """Five metadata entries announced, the first one's key cut short: the reader's struct.error was a traceback."""
    from infokv_rag import models

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 5, 40) + b"general.arch")
    with pytest.raises(ModelError, match="cut.gguf cannot be read as a GGUF model .*download it again"):
        models.convert_gguf(cut, tmp_path / "converted", "a" * 64)
    assert not (tmp_path / "converted").exists()


@pytest.fixture
def conversions(random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """GGUF conversions into a temporary INFOKV_CACHE_DIR made by copying the random model (a real one takes a
    minute): the targets converted, in order."""
    from infokv_rag import models

    monkeypatch.setenv("INFOKV_CACHE_DIR", str(tmp_path / "cache"))
    converted: list[Path] = []

    def convert(gguf_path: Path, target: Path, weights_sha256: str) -> None:
        converted.append(target)
        time.sleep(0.3)  # a conversion takes a while: room for another process to race it
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(random_model_dir, target)
        models._write_fingerprint(target, weights_sha256, source=gguf_path.name)

    monkeypatch.setattr(models, "convert_gguf", convert)
    return converted


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    """A file that passes for GGUF up to its conversion (see `conversions`)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    return path


def test_a_damaged_converted_copy_is_refused_and_fetch_converts_it_again(conversions: list[Path], gguf: Path) -> None:
    """A truncated model.safetensors in the converted-weights cache names the remedy; `fetch` repairs it."""
    from infokv_rag import cli

    target = resolve_model(str(gguf)).directory
    assert conversions == [target]
    _truncate(target / "model.safetensors")
    remedy = f"delete {target} or run `infokv-rag fetch {gguf}`"
    with pytest.raises(ModelError, match=f"{re.escape(str(target))}/model.safetensors is damaged.*{re.escape(remedy)}"):
        InfoKVEngine.from_pretrained(str(gguf), device="cpu")
    assert cli.main(["fetch", str(gguf)]) == 0
    assert conversions == [target, target]
    assert InfoKVEngine.from_pretrained(str(gguf), device="cpu").fingerprint == model_fingerprint(target)
    # Damaged tokenizer files too: the remedy named (fetch) converts the copy again.
    (target / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match=re.escape(remedy)):
        InfoKVEngine.from_pretrained(str(gguf), device="cpu")
    assert cli.main(["fetch", str(gguf)]) == 0
    assert conversions == [target, target, target]
    assert cli.main(["fetch", str(gguf)]) == 0 and len(conversions) == 3, "a sound copy is not converted again"
    # A record of the conversion without its fingerprint: named (it was a bare KeyError at the first save), and fetch
    # converts the copy again (it left it as it was).
    record = json.loads((target / "infokv_model.json").read_text())
    (target / "infokv_model.json").write_text(json.dumps({k: v for k, v in record.items() if k != "fingerprint"}))
    with pytest.raises(ModelError, match="infokv_model.json is damaged .*infokv-rag fetch"):
        model_fingerprint(target)
    assert cli.main(["fetch", str(gguf)]) == 0 and len(conversions) == 4
    assert model_fingerprint(target)


def test_concurrent_conversions_of_one_model_take_turns(conversions: list[Path], gguf: Path) -> None:
    """Two processes loading a GGUF not yet converted: one converts, the other waits and uses its result."""
    with ThreadPoolExecutor(2) as pool:  # flock excludes another open() of the lock file in the same process too
        sources = list(pool.map(lambda _: resolve_model(str(gguf)), range(2)))
    assert len(conversions) == 1
    assert sources[0].directory == sources[1].directory == conversions[0]
    assert (
        model_fingerprint(conversions[0]) == json.loads((conversions[0] / FINGERPRINT_FILE).read_text())["fingerprint"]
    )


def test_a_gguf_under_another_name_uses_the_conversion_of_its_content(
    conversions: list[Path], gguf: Path, tmp_path: Path
) -> None:
    """A copy or a link of a GGUF under another name was converted again (minutes and gigabytes each)."""
    target = resolve_model(str(gguf)).directory
    renamed = Path(shutil.copy(gguf, tmp_path / "renamed.gguf"))
    linked = tmp_path / "linked.gguf"
    linked.symlink_to(gguf)
    assert resolve_model(str(renamed)).directory == resolve_model(str(linked)).directory == target
    assert conversions == [target]
    renamed.write_bytes(gguf.read_bytes() + b"other content")
    assert resolve_model(str(renamed)).directory != target and len(conversions) == 2


def test_a_conversion_removes_what_killed_conversions_left(conversions: list[Path], gguf: Path) -> None:
    target = resolve_model(str(gguf)).directory
    leftover = target.parent / f"{target.name}.k1ll3d"  # the staging directory of a conversion killed mid-way
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(bytes(1000))
    old_temporary, new_temporary = target.parent / "tmpkilled", target.parent / "tmpbusy"
    for directory in (old_temporary, new_temporary):
        directory.mkdir()
    os.utime(old_temporary, (time.time() - 7200,) * 2)
    shutil.rmtree(target)  # converted again
    assert resolve_model(str(gguf)).directory == target and len(conversions) == 2
    assert not leftover.exists() and not old_temporary.exists(), "left by killed conversions"
    assert new_temporary.exists(), "perhaps another conversion's, in progress"
    assert (target / FINGERPRINT_FILE).is_file()


def test_a_full_disk_while_converting_is_an_os_error() -> None:
    """safetensors reports a failed write as a SafetensorError; the command line shows OSErrors (a full disk,
    a file-size limit) as one line with the reason, so the conversion's write turns it into one."""
    script = (
        "import resource, tempfile, torch\n"
        "from pathlib import Path\n"
        "from infokv_rag.models import _save_weights\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    _save_weights(torch.nn.Linear(64, 64), Path(tempfile.mkdtemp()) / 'model.safetensors')\n"
        "except OSError as exc:\n"
        "    print(exc.errno, exc.filename)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    code, filename = result.stdout.split()
    assert int(code) == errno.EFBIG and filename.endswith("model.safetensors"), result.stderr


# Architectures ----------------------------------------------------------------------------------------


def _random_model(model_type: str, vocab_size: int, **overrides: Any) -> PreTrainedModel:
    """A 3-layer GQA model of `model_type` with random weights; `overrides`: config fields over the defaults."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"sliding_window": None} if model_type in ("mistral", "phi3") else {}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        **{**extra, **overrides},
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


def _reads_as_the_model(model: PreTrainedModel, tokenizer: Any, ids: torch.Tensor, split: int) -> InfoKVEngine:
    """An engine over `model`, checked to give the logits of the model's own forward over `ids` read in two chunks
    (`split` tokens, then the rest): its attention hook, ragged cache and positions across chunks."""
    with torch.inference_mode():
        expected = model(ids[None]).logits[0]
    engine = InfoKVEngine.from_model(model, tokenizer)
    runner, cache = engine.runner, engine.runner.new_cache()
    with torch.inference_mode():
        first = runner.logits(runner.forward(ids[:split], torch.arange(split), cache))
        rest = runner.logits(runner.forward(ids[split:], torch.arange(split, len(ids)), cache))
    torch.testing.assert_close(torch.cat([first, rest]), expected, rtol=1e-4, atol=1e-4)
    return engine


@pytest.mark.parametrize("model_type", list(SUPPORTED_ARCHITECTURES))
def test_supported_architectures_run_exactly_through_the_hook_and_ragged_cache(model_type: str) -> None:
    """The runner (its attention hook, the ragged cache, positions across chunks) gives the logits of the
    model's own forward; then a compressed document (per-layer lengths differ) answers."""
    tokenizer = build_tokenizer()
    model = _random_model(model_type, len(tokenizer))
    ids = torch.randint(2, len(tokenizer), (48,), generator=torch.Generator().manual_seed(1))
    engine = _reads_as_the_model(model, tokenizer, ids, split=30)
    doc = engine.ingest_text(" ".join(CORPUS * 2), CompressionConfig(keep=0.3, chunk_size=96))
    assert len(set(doc.stats.kept_tokens_per_layer)) > 1, "per-layer lengths differ"
    assert isinstance(doc.ask(QUESTION, max_new_tokens=4), str)


def test_yarn_rope_scaling_widens_the_context_window() -> None:
    """Qwen2.5's recipe for long documents adds YaRN to config.json and leaves max_position_embeddings at the
    pretraining length: the window is factor times that, and the runner reads past it exactly as the model does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from infokv_rag.architectures import context_window

    tokenizer = build_tokenizer()
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    plain = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), max_position_embeddings=64, **shape)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    scaled = AutoConfig.for_model(
        "qwen2", vocab_size=len(tokenizer), max_position_embeddings=64, rope_scaling=yarn, **shape
    )
    dynamic = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        rope_scaling={"type": "dynamic", "factor": 4.0},
        **shape,
    )
    assert (context_window(plain), context_window(scaled), context_window(dynamic)) == (64, 256, 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(scaled).eval().requires_grad_(False)
    ids = torch.randint(2, len(tokenizer), (200,), generator=torch.Generator().manual_seed(1))
    assert _reads_as_the_model(model, tokenizer, ids, split=100).context_window == 256


def test_longrope_reads_up_to_its_pretraining_length_as_the_model_does() -> None:
    """LongRoPE (Phi-3.5, Phi-4-mini) rotates a forward's every position with its long factors once the forward
    reaches past the pretraining length: a document's first chunks, cached with the short ones, would be read
    wrongly. Its window is the pretraining length, within which the runner's chunks give the model's logits."""
    from infokv_rag.architectures import context_window

    tokenizer = build_tokenizer()
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 96,
        "short_factor": [1.0] * 8,
        "long_factor": [1.0 + i for i in range(8)],
    }
    model = _random_model("phi3", len(tokenizer), original_max_position_embeddings=96, rope_parameters=rope)
    assert context_window(model.config) == 96
    ids = torch.randint(2, len(tokenizer), (96,), generator=torch.Generator().manual_seed(1))
    assert _reads_as_the_model(model, tokenizer, ids, split=40).context_window == 96


def _positions_read(engine: InfoKVEngine) -> list[int]:
    """The last position of each forward pass `engine`'s runner makes from now on, as it makes them."""
    read: list[int] = []
    forward = engine.runner.forward

    def recorded(ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        read.append(int(positions.max()))
        return forward(ids, positions, *args, **kwargs)

    engine.runner.forward = recorded  # type: ignore[assignment]
    return read


def test_a_reconstruction_pass_reads_within_the_window() -> None:
    """`kvzip` and the quality mode repeat each chunk after the document: near the window's end the repetition is
    read in pieces, within the window, so that a LongRoPE model's long factors (used past its window only, where
    nothing else of a document or question is read) change no cache."""
    tokenizer = build_tokenizer()
    text = str(tokenizer.decode(tokenizer(TEXT)["input_ids"][:600]))
    kept: dict[str, list[list[int]]] = {}
    for method in ("kvzip", "infokv_quality"):
        for long_factor in ([1.0] * 8, [1.0 + i for i in range(8)]):
            rope = {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 1024,
                "short_factor": [1.0] * 8,
                "long_factor": long_factor,
            }
            model = _random_model("phi3", len(tokenizer), original_max_position_embeddings=1024, rope_parameters=rope)
            engine = InfoKVEngine.from_model(model, tokenizer)
            read = _positions_read(engine)
            doc = engine.ingest_text(text, CompressionConfig(method=method, keep=0.25))
            assert engine.context_window == 1024 and doc.stats.document_tokens > 600 and max(read) < 1024
            cells = [positions.tolist() for layer in range(3) for positions in doc.cache.kept_positions(layer)]
            assert kept.setdefault(method, cells) == cells, method


def test_sliding_window_variants_are_refused() -> None:
    from transformers import AutoConfig

    from infokv_rag.architectures import check_config

    check_config(AutoConfig.for_model("mistral", sliding_window=None), "mistral-full")
    check_config(AutoConfig.for_model("qwen2"), "qwen2")
    with pytest.raises(ModelError, match="sliding-window attention"):
        check_config(AutoConfig.for_model("mistral", sliding_window=4096), "mistral-v0.1")
    windowed = AutoConfig.for_model(
        "qwen2", use_sliding_window=True, sliding_window=256, num_hidden_layers=4, max_window_layers=2
    )
    with pytest.raises(ModelError, match="sliding-window attention"):
        check_config(windowed, "qwen2-windowed")
    # A window as long as max_position_embeddings slides once YaRN reads past it.
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
    check_config(AutoConfig.for_model("mistral", sliding_window=128, max_position_embeddings=128), "mistral-128")
    widened = AutoConfig.for_model("mistral", sliding_window=128, max_position_embeddings=128, rope_parameters=yarn)
    with pytest.raises(ModelError, match="sliding-window attention"):
        check_config(widened, "mistral-yarn")


# Device and dtype -------------------------------------------------------------------------------------


def test_dtype_names_and_default_placement() -> None:
    assert dtype_name("bf16") == dtype_name("BFloat16") == dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name("fp16") == "float16" and dtype_name("fp32") == "float32"
    assert dtype_name(None) is None and dtype_name("auto") is None
    with pytest.raises(ConfigError, match="unknown dtype 'int4'"):
        dtype_name("int4")
    assert resolve_placement("cpu") == (torch.device("cpu"), torch.float32), "fp32 on CPU by default"
    assert resolve_placement("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve_placement("cpu", torch.float16)[1] == torch.float16
    with pytest.raises(ConfigError, match="unknown device 'gpu0'"):
        resolve_placement("gpu0")
    with pytest.raises(ConfigError, match="device 'meta' cannot run a model"):
        resolve_placement("meta")
    with pytest.raises(ConfigError, match="dtype 16 is neither a torch dtype nor a name"):
        resolve_placement("cpu", 16)  # type: ignore[arg-type]
    for unfit in (torch.int8, torch.float64):  # failed only once loaded, telling to delete good weights; or ran
        with pytest.raises(ConfigError, match=f"dtype {unfit} cannot run a model: use auto, float32"):
            resolve_placement("cpu", unfit)
    if torch.cuda.is_available():
        device, dtype = resolve_placement(None)
        assert device.type == "cuda" and dtype in (torch.bfloat16, torch.float16), "bf16/fp16 on CUDA by default"
    else:
        assert resolve_placement(None) == (torch.device("cpu"), torch.float32)
        with pytest.raises(ConfigError, match="sees no CUDA GPU"):
            resolve_placement("cuda")


def test_from_pretrained_takes_device_and_dtype_names(random_model_dir: Path) -> None:
    engine = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu", dtype="bf16")
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.device == torch.device("cpu")
    assert engine.ingest_text(TEXT, CompressionConfig(keep=0.5)).ask(QUESTION, max_new_tokens=4)


def test_service_settings_take_device_and_dtype(hub_random: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app
    from infokv_rag.service.settings import Settings

    env = {"INFOKV_DEVICE": "cpu", "INFOKV_DTYPE": "bf16", "INFOKV_MODEL": REPO, "INFOKV_ALLOW_ANONYMOUS": "1"}
    settings = Settings.from_env(env, data_dir=tmp_path / "data", warmup=False)
    assert (settings.device, settings.dtype, settings.model) == ("cpu", "bfloat16", REPO)
    with pytest.raises(ConfigError, match="unknown dtype"):
        Settings.from_env({"INFOKV_DTYPE": "fp8"})
    app = create_app(settings)
    with TestClient(app) as client:
        engine = app.state.service.engine
        assert engine.runner.dtype == torch.bfloat16 and engine.name == REPO
        assert [model["id"] for model in client.get("/v1/models").json()["data"]] == [REPO]


@pytest.fixture
def fresh_adapters() -> Iterator[None]:
    from infokv_rag.integrations import _common

    saved = dict(_common._ENGINES)
    yield
    _common._ENGINES.clear()
    _common._ENGINES.update(saved)


def test_adapters_take_device_and_dtype(random_model_dir: Path, fresh_adapters: None) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from pydantic import ValidationError

    from infokv_rag.integrations.langchain import ChatInfoKV
    from infokv_rag.integrations.llama_index import InfoKV

    # pydantic types __init__ by the validated field (str); the field's before-validator takes a torch dtype too.
    chat = ChatInfoKV(model=str(random_model_dir), document_text=TEXT, device="cpu", dtype=torch.bfloat16, max_tokens=4)  # type: ignore[arg-type]
    assert chat.dtype == "bfloat16"
    assert chat.compressed_document().engine.runner.dtype == torch.bfloat16
    llm = InfoKV(model=str(random_model_dir), document_text=TEXT, device="cpu", dtype="fp16", max_tokens=4)
    assert llm.compressed_document().engine.runner.dtype == torch.float16
    with pytest.raises(ValidationError, match="unknown dtype"):
        ChatInfoKV(model="tiny", dtype="int8")
    with pytest.raises(ValidationError, match="unknown dtype"):
        InfoKV(model="tiny", dtype="int8")


def test_readme_lists_the_supported_architectures() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("**Architectures.**")[1].split("\n## ")[0]
    assert re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE) == list(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("value", ["", "  "])
def test_a_cache_dir_set_to_nothing_is_the_default_not_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("INFOKV_CACHE_DIR", value)
    assert cache_root() == tmp_path / ".cache" / "infokv-rag"
    monkeypatch.setenv("INFOKV_CACHE_DIR", "~/elsewhere")
    assert cache_root() == tmp_path / "elsewhere"
