"""Runs a transformers decoder over our ragged cache and feeds the signal capture.

We drive the decoder layers ourselves instead of calling the model's forward: layers then see our
per-layer cache (lengths may differ), positions continue at the uncompressed length, and the residual
stream around each layer is at hand for the layer-change signal without storing hidden states.
Attention goes through a registered implementation that uses a bottom-right causal mask (queries are
the newest tokens) and reports the attention the scorers need; other callers of the same model (e.g.
`model.generate`) fall through to transformers' own SDPA path unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .architectures import context_window
from .cache import EvictedSummary, KVCache
from .recall import Recall, attend_over_cold
from .signals import ForwardCapture

ATTENTION_NAME = "infokv_sdpa"


def _attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """query: (1, heads, q, head_dim); key, value: (1, kv_heads, length, head_dim) -> (1, q, heads, head_dim)."""
    if not kwargs.pop("infokv_forward", False):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer_index = cast(int, module.layer_idx)
    recall: Recall | None = kwargs.get("infokv_recall")
    if recall is not None:
        recalled = recall.attend(layer_index, query, scaling or query.shape[-1] ** -0.5)
        if recalled is not None:
            return recalled.transpose(1, 2).contiguous(), None
    cache: KVCache = kwargs["infokv_cache"]
    base = cache.layers[layer_index].base
    side = cache.summaries[layer_index] if cache.summaries is not None else None
    if base is not None or (side is not None and side.length):
        beside = (
            side.materialised()
            if side is not None and side.length
            else EvictedSummary.empty(key.shape[1], key.shape[3], key.dtype, key.device)
        )
        output, _ = attend_over_cold(
            query[0],
            beside.keys,
            beside.values,
            key[0],
            value[0],
            scaling or query.shape[-1] ** -0.5,
            beside.log_counts,
            document=base.entries() if base is not None else None,
        )
        return output.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = None
    if 1 < q_len < kv_len:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=q_len == kv_len and q_len > 1, scale=scaling, enable_gqa=True
    )
    capture: ForwardCapture | None = kwargs.get("infokv_capture")
    if capture is not None:
        capture.record_attention(cast(int, module.layer_idx), query[0], key[0], scaling or query.shape[-1] ** -0.5)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


class ModelRunner:
    """Forward passes of a causal LM over a `KVCache` at explicit positions."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.backbone = model.model
        self.lm_head = model.lm_head
        config = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.kv_heads = int(config.num_key_value_heads)
        self.heads = int(config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.max_positions = context_window(config)
        model.set_attn_implementation(ATTENTION_NAME)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        capture: ForwardCapture | None = None,
        token_scores: Tensor | None = None,
        recall: Recall | None = None,
    ) -> Tensor:
        """input_ids, positions: (q,) -> final normalised hidden states (q, hidden).

        Appends the tokens to every layer of `cache` (with `token_scores` (q,) as their eviction priority),
        and with `recall`, ahead of them the cold entries their queries recall; the tokens attend to the
        cache's summaries too, when it has them and no recall reads the cold tier itself. A `capture` sees
        whole layers, so the layers' bases are copied in first (`KVCache.materialise`).
        """
        if capture is not None:
            cache.materialise()
        cache.pending_positions = positions
        cache.pending_scores = (
            token_scores if token_scores is not None else torch.zeros(len(positions), device=self.device)
        )
        hidden = self.backbone.embed_tokens(input_ids.unsqueeze(0))
        position_ids = positions.unsqueeze(0)
        rotary = self.backbone.rotary_emb(hidden, position_ids=position_ids)
        for index, layer in enumerate(self.backbone.layers[: self.num_layers]):
            updated = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=rotary,
                infokv_forward=True,
                infokv_capture=capture,
                infokv_recall=recall,
                infokv_cache=cache,
            )
            if capture is not None:
                capture.record_layer_change(index, hidden[0], updated[0])
            hidden = updated
        return self.backbone.norm(hidden)[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """(hidden,) or (q, hidden) -> float32 logits over the vocabulary."""
        return self.lm_head(hidden).float()
