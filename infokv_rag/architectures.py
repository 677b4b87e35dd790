"""Which transformers models the engine can drive, checked before any weights load, and loading the weights.

`ModelRunner` runs the decoder layers itself (embeddings, rotary table, layers, final norm, LM head)
over a ragged per-layer cache, with its own attention hook. That is exact only for decoders whose
model-level forward does nothing else: no embedding or logit multipliers, no logit soft-capping, no
sliding-window layers. The architectures of `models.SUPPORTED_ARCHITECTURES` are the ones tests run through the
runner, the hook and the ragged cache against the model's own forward (tests/test_models.py); real weights:
`llama` (the tiny model) and `qwen2` (the default model).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .errors import ModelError
from .models import REPLACE_FILES, SUPPORTED_ARCHITECTURES, check_weight_files, missing_weights, supported_list


def check_config(config: Any, source: str, class_name: str | None = None) -> None:
    """Refuses an architecture the runner does not drive exactly, naming the reason."""
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ModelError(
            f"{source}: its config.json names no model_type, which tells its architecture; infokv-rag drives "
            f"{supported_list()}"
        )
    if model_type not in SUPPORTED_ARCHITECTURES:
        names = class_name or ", ".join(getattr(config, "architectures", None) or []) or "class unknown"
        raise ModelError(
            f"{source} is a {model_type!r} model ({names}), which infokv-rag does not support: it drives the "
            f"decoder layers itself, which is tested only for {supported_list()}"
        )
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        sliding = "sliding_attention" in layer_types
    else:
        # A window no shorter than every position read never slides; YaRN reads past max_position_embeddings.
        unbounded = getattr(config, "max_position_embeddings", None) is None
        sliding = window is not None and window > 0 and (unbounded or window < context_window(config))
    if sliding:
        raise ModelError(
            f"{source} uses sliding-window attention (window {window}), which infokv-rag's attention hook and "
            "compressed cache do not implement; use a variant without a sliding window"
        )


def context_window(config: Any) -> int:
    """The positions a model reads: `max_position_embeddings`, or under YaRN rope scaling `factor` times the
    pretraining length. Qwen2.5's recipe for long documents adds YaRN to config.json and leaves
    max_position_embeddings at the pretraining length. Other scalings keep max_position_embeddings: dynamic NTK
    re-scales the rotary frequencies once positions pass it, which keys already cached would not follow. LongRoPE
    (Phi-3.5, Phi-4-mini) reads up to its pretraining length only: past it transformers rotates every position
    of a forward with the long factors instead of the short ones, so the keys of a document's first chunks,
    rotated with the short ones, would be read with the positions of another rotation."""
    positions = int(config.max_position_embeddings)
    rope = getattr(config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", 0)
    if rope.get("rope_type") == "yarn" and rope.get("factor"):
        return max(positions, int(rope["factor"] * int(original or positions)))
    if rope.get("rope_type") == "longrope" and original:
        return min(positions, int(original))
    return positions


def check_tokenizer(tokenizer: Any, source: str) -> None:
    """Refuses a tokenizer without a chat template, or whose template cannot render a question: questions are asked
    as chat turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"{source} has no chat template (a base model rather than an instruction-tuned one?): infokv-rag asks "
            "questions as chat turns; use the model's instruct/chat variant, or set tokenizer.chat_template"
        )
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's errors, and whatever the template raises on purpose
        reason = " ".join(str(exc).split())
        raise ModelError(
            f"{source}: its chat template cannot render a question ({type(exc).__name__}: {reason}); fix the "
            "template (chat_template.jinja, or chat_template in tokenizer_config.json) or use the model's own files"
        ) from exc


def check_loaded_model(model: Any, source: str) -> None:
    """Refuses a model in memory that the runner cannot drive: unsupported, incomplete or spread out."""
    config = getattr(model, "config", None)
    if config is None:
        raise ModelError(f"{source} is not a transformers model (it has no config): pass a *ForCausalLM model")
    check_config(config, source, type(model).__name__)
    backbone = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "layers", "norm")
    if getattr(model, "lm_head", None) is None or backbone is None or any(not hasattr(backbone, p) for p in parts):
        raise ModelError(
            f"{source} is a {type(model).__name__}, not a causal LM with a language-model head: pass the "
            f"*ForCausalLM model (e.g. AutoModelForCausalLM.from_pretrained(...))"
        )
    devices = {parameter.device for parameter in model.parameters()}
    if any(device.type == "meta" for device in devices):
        raise ModelError(
            f"{source} has weights that are not loaded (on the meta device, e.g. offloaded by a device_map): "
            "load it fully onto one device"
        )
    if len(devices) > 1:
        listed = ", ".join(sorted(str(device) for device in devices))
        raise ModelError(f"{source} is spread over several devices ({listed}): move it onto one with model.to(device)")


def load_checked(directory: Path, source: str, remedy: str = REPLACE_FILES) -> tuple[Any, Any]:
    """(config, tokenizer) of a model directory, checked before its weights are read (or downloaded).
    `remedy`: what to do when its files are damaged."""
    from huggingface_hub import errors as hub_errors
    from transformers import AutoConfig, AutoTokenizer

    # transformers 5 checks a config's field types with huggingface_hub's strict dataclasses ("3" for a count).
    unreadable = (
        OSError,
        ValueError,
        KeyError,
        AttributeError,
        TypeError,
        getattr(hub_errors, "StrictDataclassError", ValueError),
    )
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        # The model type first: transformers cannot even parse the config of an architecture it lacks.
        if raw.get("model_type") not in SUPPORTED_ARCHITECTURES:
            check_config(SimpleNamespace(**raw), source)
        config = AutoConfig.from_pretrained(directory)
    except unreadable as exc:
        raise ModelError(f"{source}: its config.json cannot be read ({exc})") from exc
    check_config(config, source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # transformers and tokenizers raise anything from ValueError to a bare Exception
        reason = " ".join(str(exc).split())  # on one line: some of transformers' messages list options on several
        raise ModelError(
            f"{source}: the tokenizer in {directory} cannot be loaded ({type(exc).__name__}: {reason}); "
            f"it needs tokenizer.json (or the tokenizer files of its model) and tokenizer_config.json: {remedy}"
        ) from exc
    check_tokenizer(tokenizer, source)
    check_vocabulary(tokenizer, int(config.vocab_size), source, f"the tokenizer files are another model's; {remedy}")
    return config, tokenizer


def check_vocabulary(tokenizer: Any, embedded: int, source: str, remedy: str) -> None:
    """Refuses a tokenizer with more tokens than the weights embed: such a token would fail the first prefill with a
    bare IndexError (on a GPU, a device-side assert that breaks the process's CUDA context)."""
    if len(tokenizer) > embedded:
        raise ModelError(
            f"{source}: its tokenizer has {len(tokenizer)} tokens but its weights embed {embedded}: {remedy}"
        )


def load_weights(directory: Path, config: Any, dtype: Any, source: str, remedy: str = REPLACE_FILES) -> Any:
    """The causal LM of `directory` under `config` in `dtype`, refused (with `remedy`) when its weights files
    are missing or damaged, or its checkpoint lacks a weight.

    transformers initialises a weight the checkpoint lacks at random and only logs it: every load would then
    compute something else under the same fingerprint, and caches saved by one load would pass in the next.
    Its `missing_keys` already leave out tied weights (an LM head tied to the embeddings) and non-persistent
    buffers, which are not in a checkpoint by design. Unexpected keys are allowed: transformers ignores them,
    so they change nothing that is computed (a checkpoint may carry extras, e.g. a speculative-decoding head).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    check_weight_files(directory, remedy)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, output_loading_info=True
        )
    except (SafetensorError, RuntimeError, ValueError) as exc:  # e.g. a tensor of another shape than the config's
        raise ModelError(f"{source}: the weights in {directory} cannot be loaded ({exc}): {remedy}") from exc
    model, info = loaded
    missing = missing_weights(info)
    if missing:
        raise ModelError(
            f"{source}: the checkpoint in {directory} lacks {missing}; it is incomplete or for another "
            "architecture: replace it with the model's complete weights"
        )
    return model
