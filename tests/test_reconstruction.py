"""Context reconstruction (KVzip scores) on the random model: exact against eager attention, side-effect free."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from infokv_rag import InfoKVEngine
from infokv_rag.cache import KVCache
from infokv_rag.reconstruction import reconstruction_attention, repeat_prompt_ids
from infokv_rag.selection import global_budgets, per_head_budgets, protected_mask, select_per_head, select_tokens

TEXT = "The supplier shall deliver the goods within thirty days of the order date. " * 6


def _prefill(engine: InfoKVEngine, ids: torch.Tensor) -> KVCache:
    cache = engine.runner.new_cache()
    engine.runner.forward(ids, torch.arange(len(ids)), cache)
    return cache


def test_reconstruction_scores_equal_eager_attention_of_the_repeated_document(
    random_engine: InfoKVEngine, random_model_dir: Path
) -> None:
    ids = torch.tensor(random_engine.prompt.document_ids(TEXT))
    n, head = len(ids), random_engine.prompt.head_tokens
    scores = reconstruction_attention(
        random_engine.runner, random_engine.prompt, _prefill(random_engine, ids), ids, 0, n, head
    )
    # One chunk: KVzip's key subset (sinks, chunk, repeated tokens) is the whole sequence, so its
    # scores are the plain causal attention of the repeated tokens over the document's keys.
    repeated = repeat_prompt_ids(random_engine.prompt, None) + ids[head:].tolist()
    eager = AutoModelForCausalLM.from_pretrained(random_model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = eager(torch.cat([ids, torch.tensor(repeated)])[None], output_attentions=True).attentions
    kv_heads = random_engine.runner.kv_heads
    for layer, probabilities in enumerate(attentions):
        rows = probabilities[0, :, n:, head:n]  # (heads, repeated, document tokens after the head)
        expected = rows.reshape(kv_heads, -1, *rows.shape[1:]).amax(dim=(1, 2))
        torch.testing.assert_close(scores[layer][:, head:], expected, atol=1e-5, rtol=1e-4)
        assert bool((scores[layer][:, :head] == 1).all())


def test_reconstruction_leaves_the_cache_as_it_found_it(random_engine: InfoKVEngine) -> None:
    ids = torch.tensor(random_engine.prompt.document_ids(TEXT))
    cache = _prefill(random_engine, ids)
    before = [(layer.live("keys").clone(), layer.live("positions").clone()) for layer in cache.layers]
    half = len(ids) // 2
    reconstruction_attention(random_engine.runner, random_engine.prompt, cache, ids, half, len(ids), 4)
    for layer, (keys, positions) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.live("keys"), keys) and torch.equal(layer.live("positions"), positions)


def test_global_budgets_follow_the_scores_and_keep_the_total() -> None:
    high, low = torch.full((2, 100), 0.9), torch.full((2, 100), 0.1)
    budgets = global_budgets([high, low, high], total=3 * 40, minimum=10)
    assert sum(budgets) == 120
    assert budgets[1] == 10 and budgets[0] == budgets[2] == 55
    mixed = [torch.rand(2, 50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    assert sum(global_budgets(mixed, total=4 * 20, minimum=8)) == 80
    assert global_budgets(mixed, total=10_000, minimum=8) == [50] * 4


def test_a_layer_floor_is_taken_from_the_layers_above_it_in_proportion() -> None:
    # Layers 0 and 1 hold every token that passes; 2 and 3 none.
    scores = [torch.full((2, 120), 0.9), torch.full((2, 60), 0.8), torch.zeros(2, 100), torch.zeros(2, 100)]
    assert global_budgets(scores, total=4 * 45, minimum=10) == [110, 50, 10, 10]
    # Lifting 2 and 3 to 30 costs 60 tokens: 45 from layer 0 (90 above the floor), 15 from 1 (30 above).
    assert global_budgets(scores, total=4 * 45, minimum=10, floor=30) == [75, 45, 30, 30]
    assert global_budgets(scores, total=4 * 45, minimum=10, floor=45) == [45] * 4
    assert global_budgets(scores, total=4 * 45, minimum=10, floor=5) == [110, 50, 10, 10]  # below the minimum


def test_neediest_head_budgets_give_a_layer_what_its_neediest_head_wants() -> None:
    # Layer 0: one head wants every token, the other none; layer 1: both want a quarter.
    wanting = torch.stack([torch.full((100,), 0.9), torch.full((100,), 0.1)])
    quarter = torch.cat([torch.full((2, 25), 0.8), torch.full((2, 75), 0.2)], dim=1)
    assert global_budgets([wanting, quarter], total=2 * 60, minimum=10) == [35, 85]  # the mean cuts layer 0
    assert global_budgets([wanting, quarter], total=2 * 60, minimum=10, per_layer="max") == [100, 20]
    mixed = [torch.rand(2, 50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    assert sum(global_budgets(mixed, total=4 * 20, minimum=8, per_layer="max")) == 80
    assert global_budgets(mixed, total=10_000, minimum=8, per_layer="max") == [50] * 4


def test_per_head_budgets_give_each_head_what_passes_and_keep_the_total() -> None:
    # Layer 0: one head wants every token, the other none; layer 1: both want a quarter, then fewer and fewer.
    wanting = torch.stack([torch.full((100,), 0.9), torch.full((100,), 0.1)])
    quarter = torch.cat([torch.full((25,), 0.8), torch.linspace(0.5, 0.2, 75)]).expand(2, -1)
    # Of 2 x 120 tokens, 100 go to layer 0's first head, none to its second (the per-layer mean would give both
    # 50), 2 x 70 to layer 1.
    assert per_head_budgets([wanting, quarter], total=2 * 60, minimum=0) == [[100, 0], [70, 70]]
    assert per_head_budgets([wanting, quarter], total=2 * 40, minimum=0) == [[100, 0], [30, 30]]
    assert global_budgets([wanting, quarter], total=2 * 60, minimum=0) == [50, 70]
    # A floor of 30 per (layer, head) costs 30 tokens, taken in proportion from the cells above it (70, 40, 40).
    assert per_head_budgets([wanting, quarter], total=2 * 60, minimum=0, floor=30) == [[86, 30], [62, 62]]
    mixed = [torch.rand(2, 50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    budgets = per_head_budgets(mixed, total=4 * 20, minimum=8)
    assert sum(map(sum, budgets)) == 2 * 80 and min(map(min, budgets)) >= 8
    assert per_head_budgets(mixed, total=10_000, minimum=8) == [[50, 50]] * 4


def test_select_per_head_splits_each_heads_best_into_a_common_part_and_the_rest() -> None:
    scores = torch.rand(2, 40, generator=torch.Generator().manual_seed(3))
    protected = protected_mask(torch.arange(40).expand(2, -1), 40, sink_tokens=2, window=4)
    common, rest = select_per_head(scores, protected, [9, 21])
    assert common.shape == (2, 9) and [len(r) for r in rest] == [0, 12]
    for head, budget in enumerate([9, 21]):
        alone = select_tokens(scores[head : head + 1], protected[head : head + 1], budget)[0]
        union = torch.cat([common[head], rest[head]]).sort().values
        assert torch.equal(union, alone), "the head keeps exactly its own best"
        assert bool((common[head][1:] > common[head][:-1]).all()) and bool(protected[head, common[head]].sum() == 6)
