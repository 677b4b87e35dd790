"""Context reconstruction (KVzip, arXiv 2505.23416): how much the model needs each cached document token
to reproduce the document.

After a chunk of the document is prefilled, the model is asked to repeat that chunk and is fed it
teacher-forced, over the cache as it stands. Each query of the repeated text attends over the sinks, the
chunk's own cached keys and the repeated tokens before it (KVzip normalises the softmax over this subset
only, so a chunk's scores do not depend on how much of the rest of the document is resident), and a
cached key's importance is the largest attention probability it receives over all reconstruction
queries and over the query heads of its KV group. The repeated tokens are rolled back afterwards: the
pass reads the cache and leaves it as it found it. It is one more forward pass over the chunk plus the
attention probabilities recomputed here (about 2.7x a plain prefill on CPU, README "Results").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cache import KVCache
from .prompt import PromptFormat

if TYPE_CHECKING:
    from .model_runner import ModelRunner  # it imports transformers, which reading a saved cache does not need

REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_NEXT = "Repeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8
"""Tokens of the previous chunk quoted in the prompt that asks for a later chunk, as KVzip does."""
QUERY_BLOCK = 256
"""Reconstruction queries scored at a time: bounds the (heads, block, keys) probabilities held."""


class ReconstructionCapture:
    """Fed by the model runner during one reconstruction pass; keeps the per-layer chunk scores.

    The scored chunk is the `scored` entries that end each layer's resident cache before the repeated
    tokens were appended; the first `sinks` entries of each layer are the protected prompt head.
    """

    def __init__(self, scored: int, sinks: int, lengths: list[int]) -> None:
        self.scored = scored
        self.sinks = sinks
        self.lengths = lengths
        self.scores: dict[int, Tensor] = {}
        """layer -> (kv_heads, scored) max attention probability each chunk key received."""

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        """queries: (heads, q, head_dim) of the repeated tokens; keys: (kv_heads, resident + q, head_dim)."""
        resident = self.lengths[layer]
        heads, q, head_dim = queries.shape
        kv_heads = keys.shape[0]
        subset = torch.cat(
            [keys[:, : self.sinks], keys[:, resident - self.scored : resident], keys[:, resident:]], dim=1
        ).float()
        # Scaling the queries, not the (q, keys) logits, is one multiply per query instead of one per logit.
        grouped = queries.reshape(kv_heads, heads // kv_heads, q, head_dim).float() * scaling
        context = self.sinks + self.scored
        best = torch.zeros(kv_heads, self.scored, device=keys.device)
        for first in range(0, q, QUERY_BLOCK):
            block = grouped[:, :, first : first + QUERY_BLOCK]
            logits = torch.einsum("hgqd,hkd->hgqk", block, subset)
            rows = torch.arange(first, first + block.shape[2], device=keys.device)
            # A repeated token sees the repeated tokens up to itself only.
            future = rows[:, None] < torch.arange(q, device=keys.device)[None, :]
            logits[..., context:].masked_fill_(future, float("-inf"))
            probabilities = logits.softmax(dim=-1)[..., self.sinks : context]
            best = torch.maximum(best, probabilities.amax(dim=(1, 2)))
        self.scores[layer] = best

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        """The reconstruction pass needs no layer-change signal."""


def repeat_prompt_ids(prompt: PromptFormat, previous_tail: list[int] | None) -> list[int]:
    """The turn that asks the model to repeat the chunk that follows it (the chunk's ids come after).

    `previous_tail`: the last tokens before the chunk, quoted so the model knows where to start; None for
    the document's first chunk.
    """
    if previous_tail is None:
        request = REPEAT_FIRST
    else:
        request = f"{REPEAT_NEXT} {prompt.tokenizer.decode(previous_tail)}"
    return prompt.conversation_ids([("user", request)])


@torch.inference_mode()
def reconstruction_attention(
    runner: ModelRunner,
    prompt: PromptFormat,
    cache: KVCache,
    ids: Tensor,
    start: int,
    end: int,
    sinks: int,
    while_repeated: Callable[[KVCache], None] | None = None,
) -> list[Tensor]:
    """Per layer (kv_heads, end - start) reconstruction importance of document tokens [start, end).

    ids: (tokens,) the document prefix ids; tokens [start, end) must be the last `end - start` resident
    entries of every layer of `cache`, and its first `sinks` entries the protected head. Tokens before
    `sinks` are not repeated (they are protected) and score 1. `while_repeated` sees the cache while it holds
    the repeated chunk too (the repeat prompt and up to `end - start` tokens more per layer), before the rollback.
    """
    first = max(start, sinks)
    scored = end - first
    lengths = cache.lengths
    if scored <= 0:
        return [torch.ones(runner.kv_heads, end - start, device=ids.device) for _ in lengths]
    best = [torch.zeros(runner.kv_heads, scored, device=ids.device) for _ in lengths]
    piece_start = first
    while piece_start < end:
        # The repetition is read after the document, within the model's window: past it a LongRoPE model rotates
        # with other factors (and dynamic NTK rescales), so its queries would score keys rotated otherwise. A chunk
        # near the window's end is repeated in pieces, each asked for after the text before it (as KVzip chunks
        # its reconstruction); a key keeps the largest attention any piece gives it.
        tail = None if piece_start == sinks else ids[max(sinks, piece_start - PREVIOUS_TAIL) : piece_start].tolist()
        request = repeat_prompt_ids(prompt, tail)
        # At least one token: the engine's reserve for a question and its answer leaves room for the request.
        piece_end = min(end, piece_start + max(1, runner.max_positions - end - len(request)))
        repeated = torch.tensor(request + ids[piece_start:piece_end].tolist(), device=ids.device)
        capture = ReconstructionCapture(scored, sinks, lengths)
        runner.forward(repeated, torch.arange(end, end + len(repeated), device=ids.device), cache, capture)
        if while_repeated is not None:
            while_repeated(cache)
        cache.rollback(lengths)
        best = [torch.maximum(best[layer], capture.scores[layer]) for layer in range(len(lengths))]
        piece_start = piece_end
    protected = torch.ones(runner.kv_heads, first - start, device=ids.device)
    return [torch.cat([protected, best[layer]], dim=1) for layer in range(len(lengths))]
