"""Shared fixtures: a random tiny Llama built in code (unit tests) and the real packaged models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from infokv_rag import InfoKVEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The supplier shall deliver the goods within thirty days of the order date.",
    "Either party may terminate this agreement with ninety days written notice.",
    "Payment of 12,500 EUR is due on 2024-03-15 to account 4471-2210.",
    "The manual describes the pump P-301, its valves, filters and safety interlocks.",
    "Question: what is the notice period? Answer concisely, using only the document above.",
    "Read the document below, then answer the question that follows it. Document:",
]


def build_tokenizer(sentencepiece: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2, Qwen, SmolLM) trained on `CORPUS`, or with `sentencepiece` one of the kind
    Llama 2, Mistral and Phi-3 use (its decoder drops the space that begins a text)."""
    import string

    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    special = ["<|im_start|>", "<|im_end|>"]
    if sentencepiece:
        pieces = SentencePieceBPETokenizer(unk_token="<unk>")
        pieces.train_from_iterator(CORPUS * 20 + [string.printable], vocab_size=500, special_tokens=["<unk>", *special])
        trained = pieces._tokenizer
    else:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(CORPUS * 20, vocab_size=400, min_frequency=1, special_tokens=special)
        trained = bpe._tokenizer
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained, eos_token="<|im_end|>", bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_random_model_dir(target: Path, max_positions: int = 4096, sentencepiece: bool = False) -> Path:
    """A 3-layer GQA Llama with random weights, saved like any local HF model directory (`sentencepiece`: with
    that kind of tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(sentencepiece)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Random weights would otherwise end answers at random; an all-zero row makes EOS never the argmax.
        model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model_dir(tmp_path_factory.mktemp("random-llama"))


@pytest.fixture(scope="session")
def random_engine(random_model_dir: Path) -> InfoKVEngine:
    return InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu")


@pytest.fixture(scope="session")
def tiny_engine() -> InfoKVEngine:
    return InfoKVEngine.from_pretrained("tiny", device="cpu")


@pytest.fixture(scope="session")
def default_engine() -> InfoKVEngine:
    return InfoKVEngine.from_pretrained("default", device="cpu")


@pytest.fixture()
def no_document_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapters may not load weights to read a document: for calls that must be refused before that."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a call that cannot be answered loaded weights to read its document")

    from infokv_rag.integrations import _common

    monkeypatch.setattr(_common, "get_engine", refuse)


def pytest_configure(config: pytest.Config) -> None:
    # OMP_NUM_THREADS, when set, wins: on a busy machine one thread is far faster than two that wait on each other.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
