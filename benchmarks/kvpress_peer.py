"""NVIDIA kvpress presses on the quality benchmarks' exact prompts (started by benchmarks/quality.py and
benchmarks/realdocs_quality.py).

Runs inside `.venv-kvpress` (`make kvpress-env`): kvpress 0.5.5 needs transformers<5.3 while the project
needs >=5.24, so this script imports only torch, transformers and kvpress, never infokv_rag.

    .venv-kvpress/bin/python benchmarks/kvpress_peer.py JOB.json OUT.json
    .venv-kvpress/bin/python benchmarks/kvpress_peer.py JOB.json --check   # verify the shortcuts below
    .venv-kvpress/bin/python benchmarks/kvpress_peer.py --versions         # kvpress, transformers, torch

JOB: {model_dir, dtype, device, presses, keeps, max_new_tokens, eos_token_ids, documents: [{name,
prefix_ids, questions: [{suffix_ids, reference_ids}]}]}; the ids are the project's own prompt tokens, so
both sides see identical prompts. Each document prefix is compressed query-agnostically by each press at
each keep ratio (compression_ratio = 1 - keep, the presses' defaults otherwise); then every question is
answered greedily from that cache with its tokens at positions n, n+1, ... (n: the uncompressed prefix
length, as kvpress's pipeline does), and teacher-forced on suffix + reference_ids for
KL(p_nopress || p_press) over the rows the quality benchmark uses (from len(suffix) - 1 on). OUT gets
one row per (document, question, press, keep) with the answer ids and KL, plus press "none" (no
compression) as a sanity row.

KVzipPress (press "kvzip") is the exception to the shortcuts below: it scores by reconstructing the
context after the prefill, so it runs its own hooked prefill and reconstruction, once per document for
all keep ratios (its scores do not depend on the ratio; `KVzipAtKeeps`), and it masks the evicted keys of
each head instead of removing them (kvpress's attention patch), so its cache keeps every token; its masks
are installed only while its own rows are answered.

Two shortcuts keep this within minutes on 2 CPU cores, and `--check` tests both on the first document:
- One prefill per document. A press compresses a layer's cache in a forward hook after that layer
  attended over the whole prefix, so no press changes the prefill's hidden states. One plain prefill
  records every attention layer's hook call; each press then runs its own `forward_hook` on those calls
  over a copy of the full cache. The check compares that cache with a prefill under `with press(model):`.
- One batch per keep ratio and document. All presses keep the same number of tokens per layer at one
  ratio, so their caches stack into one batch, copied once per question; masked pads align the
  questions' ends. The check compares these answers and logits with those of one press and one
  question at a time, which need no pads and no mask, as in kvpress's pipeline.
For kvzip the check compares the masks of the one reconstruction with KVzipPress's own at each keep
ratio, and batched answers under the masks with one-question answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import torch
from kvpress import BasePress, ExpectedAttentionPress, KnormPress, KVzipPress, SnapKVPress, StreamingLLMPress, TOVAPress
from transformers import AutoModelForCausalLM, DynamicCache

PRESSES: dict[str, type[BasePress]] = {
    "snapkv": SnapKVPress,
    "streaming_llm": StreamingLLMPress,
    "knorm": KnormPress,
    "tova": TOVAPress,
    "expected_attention": ExpectedAttentionPress,
}
NO_PRESS = "none"
KVZIP = "kvzip"
"""KVzipPress: scores by context reconstruction after the prefill (a second pass), so it cannot be replayed
from a plain prefill's hook calls, and it masks evicted keys per head (module.masked_key_indices) instead
of removing them: its rows compare answers, not bytes."""
Masks = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""Per attention layer, KVzipPress's masked key indices (batch, head, position) for a batch of one."""


def log(message: str) -> None:
    print(f"kvpress peer: {message}", file=sys.stderr, flush=True)


@dataclass
class Prefill:
    """A plain (uncompressed) prefill of one document prefix."""

    cache: DynamicCache
    """Full keys and values, (1, kv_heads, n, head_dim) per layer."""
    calls: list[tuple[dict[str, Any], Any]]
    """(kwargs, output) of each attention layer's forward, in layer order: what a press's hook receives."""


def attention_layers(model: Any) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


@torch.inference_mode()
def prefill(model: Any, ids: list[int]) -> Prefill:
    """Runs the prefix through the decoder as kvpress's pipeline does (no LM head) and records the hook calls."""
    calls: list[tuple[dict[str, Any], Any]] = []
    hooks = [
        module.register_forward_hook(
            lambda _m, _a, kwargs, output: calls.append((dict(kwargs), output)), with_kwargs=True
        )
        for module in attention_layers(model)
    ]
    try:
        cache = DynamicCache()
        model.model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return Prefill(cache, calls)


@torch.inference_mode()
def replay(model: Any, press: BasePress, full: Prefill) -> DynamicCache:
    """The cache a prefill under `with press(model):` leaves, from the recorded calls of a plain prefill."""
    # DynamicLayer.update concatenates onto an empty tensor, so this cache owns copies of the full one.
    cache = DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in full.cache.layers])
    # The context manager does the press's per-model setup (post_init_from_model, rotary_emb on each
    # attention module); its hooks never fire because no forward runs inside it.
    with press(model):
        for module, (kwargs, output) in zip(attention_layers(model), full.calls, strict=True):
            press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
    return cache


@torch.inference_mode()
def hooked_prefill(model: Any, press: BasePress, ids: list[int]) -> DynamicCache:
    """kvpress's own way: the prefill runs under the press's context manager."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache)
    return cache


@dataclass
class KVzipAtKeeps(KVzipPress):
    """KVzipPress that reconstructs once and then runs its own `compress_post` at each keep ratio (< 1).

    The reconstruction's scores do not depend on the ratio (only which of them are cut does), so one
    pass serves every keep; `masks[keep]` are the indices KVzipPress(compression_ratio=1 - keep) masks
    (`--check` compares them).
    """

    keeps: tuple[float, ...] = ()
    masks: dict[float, Masks] = field(default_factory=dict)

    def compress_post(self, model: Any) -> None:
        for keep in self.keeps:
            self.compression_ratio = 1 - keep
            super().compress_post(model)
            self.masks[keep] = [module.masked_key_indices for module in attention_layers(model)]


@torch.inference_mode()
def kvzip_prefill(model: Any, ids: list[int], keeps: list[float]) -> tuple[DynamicCache, dict[float, Masks | None]]:
    """KVzipPress's prefill + one reconstruction: the full cache and, per keep, each layer's masked keys
    (None at keep 1: nothing is masked)."""
    compressing = tuple(keep for keep in keeps if keep < 1)
    press = KVzipAtKeeps(compression_ratio=1 - min(compressing, default=1.0), keeps=compressing)
    cache = hooked_prefill(model, press, ids)
    for module in attention_layers(model):
        module.masked_key_indices = None  # compress_post leaves the last keep's masks installed
    return cache, {keep: press.masks.get(keep) for keep in keeps}


@contextmanager
def masked_keys(model: Any, masks: Masks | None, rows: int) -> Iterator[None]:
    """Installs KVzip's per-head masks for a batch of `rows` copies of one cache (answer() copies the
    cache per question), or none; and removes them afterwards so that no other cache is masked."""
    modules = attention_layers(model)
    for index, module in enumerate(modules):
        module.masked_key_indices = None
        if masks is not None:
            _, heads, positions = masks[index]
            module.masked_key_indices = (
                torch.arange(rows, device=positions.device).repeat_interleave(len(positions)),
                heads.repeat(rows),
                positions.repeat(rows),
            )
    try:
        yield
    finally:
        for module in modules:
            module.masked_key_indices = None


def stack(caches: list[DynamicCache]) -> DynamicCache:
    """Caches of equal per-layer lengths -> one cache with a batch row each."""
    return DynamicCache(
        ddp_cache_data=[
            (torch.cat([c.layers[i].keys for c in caches]), torch.cat([c.layers[i].values for c in caches]))
            for i in range(len(caches[0].layers))
        ]
    )


def forward(
    model: Any, cache: DynamicCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: int
) -> torch.Tensor:
    """ids, positions (batch, q); mask (batch, cached + q) -> float32 logits (batch, rows, vocab) of the last rows.

    Explicit positions continue the uncompressed prefix, as kvpress's pipeline sets them; cache_position
    is left to transformers (it counts the compressed cache), which keeps the causal mask right. Without
    padding no mask is passed, exactly as in kvpress's pipeline.
    """
    out = model(
        input_ids=ids,
        past_key_values=cache,
        position_ids=positions,
        attention_mask=None if bool(mask.all()) else mask,
        logits_to_keep=rows,
    )
    return out.logits.float()


@torch.inference_mode()
def answer(
    model: Any, cache: DynamicCache, start: int, questions: list[dict[str, Any]], job: dict[str, Any]
) -> list[list[tuple[list[int], torch.Tensor]]]:
    """Answers every question from every row of `cache` in one batch (each question gets its own copy).

    cache: (variants, kv_heads, m, head_dim) per layer. Returns [question][variant] -> (greedy answer ids,
    stop token excluded; teacher-forced logits (len(reference) + 1, vocab)).

    Row (question, variant) reads [cache][pads][suffix][reference][pads]: the pads, masked, align the
    questions' ends, so one forward gives every row's teacher-forced logits and, from its first kept
    row (the suffix's last position, which the reference cannot see), the first answer token. Greedy
    decoding then continues from the cache cut back to the suffix.
    """
    variants, m = cache.layers[0].keys.shape[0], cache.get_seq_length()
    suffix_len = max(len(q["suffix_ids"]) for q in questions)
    reference_len = max(len(q["reference_ids"]) for q in questions)
    ids, positions, masks, ends = [], [], [], []
    for q in questions:
        suffix, reference = q["suffix_ids"], q["reference_ids"]
        pad, tail = suffix_len - len(suffix), reference_len - len(reference)
        ids.append([0] * pad + suffix + reference + [0] * tail)
        # Pads sit at any position: they are masked as keys and their outputs are never read.
        positions.append([start] * pad + list(range(start, start + len(suffix) + reference_len)))
        masks.append([0] * pad + [1] * (len(suffix) + len(reference)) + [0] * tail)
        ends.append(start + len(suffix))
    device = model.device

    def per_row(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=device).repeat_interleave(variants, dim=0)

    batch = len(questions) * variants
    # Every row gets its own copy of its variant's cache, so questions never see each other.
    cache = DynamicCache(
        ddp_cache_data=[
            (layer.keys.repeat(len(questions), 1, 1, 1), layer.values.repeat(len(questions), 1, 1, 1))
            for layer in cache.layers
        ]
    )
    mask = torch.cat([torch.ones(batch, m, dtype=torch.long, device=device), per_row(masks)], dim=1)
    logits = forward(model, cache, per_row(ids), per_row(positions), mask, reference_len + 1)
    cache.crop(m + suffix_len)
    mask = mask[:, : m + suffix_len]
    position = per_row([[end] for end in ends])
    stop = set(job["eos_token_ids"])
    answers: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    tokens = logits[:, 0].argmax(dim=-1)
    for step in range(job["max_new_tokens"]):
        if step:
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
            tokens = forward(model, cache, tokens.unsqueeze(1), position, mask, 1)[:, -1].argmax(dim=-1)
            position = position + 1
        for row, token in enumerate(tokens.tolist()):
            done[row] = done[row] or token in stop
            if not done[row]:
                answers[row].append(token)
        if all(done):
            break
    return [
        [(answers[i * variants + v], logits[i * variants + v, : len(q["reference_ids"]) + 1]) for v in range(variants)]
        for i, q in enumerate(questions)
    ]


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """(rows, vocab) logits -> mean over rows of KL(p_reference || p)."""
    p_log = torch.log_softmax(reference, dim=-1)
    return float((p_log.exp() * (p_log - torch.log_softmax(logits, dim=-1))).sum(dim=-1).mean())


def compressed_caches(model: Any, full: Prefill, job: dict[str, Any]) -> dict[tuple[str, float], DynamicCache]:
    return {
        (name, keep): replay(model, PRESSES[name](compression_ratio=1 - keep), full)
        for keep in job["keeps"]
        for name in job["presses"]
        if name != KVZIP
    }


def batches(caches: dict[tuple[str, float], DynamicCache]) -> list[tuple[list[tuple[str, float]], DynamicCache]]:
    """Groups variants whose caches have equal per-layer lengths (all presses at one keep) into stacked caches."""
    groups: dict[tuple[int, ...], list[tuple[str, float]]] = defaultdict(list)
    for variant, cache in caches.items():
        groups[tuple(layer.get_seq_length() for layer in cache.layers)].append(variant)
    return [(variants, stack([caches[v] for v in variants])) for variants in groups.values()]


def run_document(
    model: Any, document: dict[str, Any], job: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """All presses, keeps and questions of one document -> (output rows, timing record)."""
    prefix, questions = document["prefix_ids"], document["questions"]
    n = len(prefix)
    clock = time.perf_counter()
    full = prefill(model, prefix)
    timing: dict[str, Any] = {
        "document": document["name"],
        "prefix_tokens": n,
        "prefill_s": time.perf_counter() - clock,
    }
    clock = time.perf_counter()
    caches = compressed_caches(model, full, job)
    timing["compress_s"] = time.perf_counter() - clock
    timing["cache_tokens"] = {f"{name}@{keep}": cache.get_seq_length() for (name, keep), cache in caches.items()}
    groups: list[tuple[list[tuple[str, float]], DynamicCache, Masks | None]] = [
        ([(NO_PRESS, 1.0)], full.cache, None),
        *((variants, cache, None) for variants, cache in batches(caches)),
    ]
    del caches, full  # the recorded calls hold every layer's hidden states: not needed any more
    if KVZIP in job["presses"]:
        clock = time.perf_counter()
        cache, kvzip_masks = kvzip_prefill(model, prefix, job["keeps"])
        groups += [([(KVZIP, keep)], cache, masks) for keep, masks in kvzip_masks.items()]
        timing["kvzip_s"] = time.perf_counter() - clock
    clock = time.perf_counter()
    rows: list[dict[str, Any]] = []
    plain: list[list[tuple[list[int], torch.Tensor]]] = []
    for variants, cache, masks in groups:
        with masked_keys(model, masks, len(questions)):
            per_question = answer(model, cache, n, questions, job)
        # The first group is the uncompressed cache: its teacher-forced logits are every KL's reference.
        plain = plain or per_question
        for index, (reference, answers) in enumerate(zip(plain, per_question, strict=True)):
            for (name, keep), (ids, logits) in zip(variants, answers, strict=True):
                kl = mean_kl(reference[0][1], logits)
                rows.append(
                    {"document": document["name"], "question": index, "press": name, "keep": keep, "ids": ids, "kl": kl}
                )
    timing["answer_s"] = time.perf_counter() - clock
    return rows, timing


def check(model: Any, job: dict[str, Any]) -> bool:
    """Replayed vs hooked-prefill caches, batched vs one-at-a-time answers, on the first document."""
    document = job["documents"][0]
    prefix, questions = document["prefix_ids"], document["questions"]
    log(f"check on {document['name']} ({len(prefix)} tokens)")
    caches = compressed_caches(model, prefill(model, prefix), job)
    batched: dict[tuple[str, float], list[tuple[list[int], torch.Tensor]]] = {}
    for variants, cache in batches(caches):
        per_question = answer(model, cache, len(prefix), questions, job)
        batched.update({variant: [answers[v] for answers in per_question] for v, variant in enumerate(variants)})
    passed = True
    print(
        "| press | keep | tokens kept | replay vs hooked prefill: max abs diff K / V | "
        "batched vs alone: same answers | max abs diff of logits |"
    )
    print("|---|---|---|---|---|---|")
    for (name, keep), replayed in caches.items():
        hooked = hooked_prefill(model, PRESSES[name](compression_ratio=1 - keep), prefix)
        pairs = list(zip(replayed.layers, hooked.layers, strict=True))
        if all(a.keys.shape == b.keys.shape for a, b in pairs):
            key_diff = max(float((a.keys - b.keys).abs().max()) for a, b in pairs)
            value_diff = max(float((a.values - b.values).abs().max()) for a, b in pairs)
        else:
            key_diff = value_diff = float("inf")
        alone = [answer(model, replayed, len(prefix), [q], job)[0][0] for q in questions]
        same = sum(a[0] == b[0] for a, b in zip(alone, batched[(name, keep)], strict=True))
        logit_diff = max(float((a[1] - b[1]).abs().max()) for a, b in zip(alone, batched[(name, keep)], strict=True))
        passed &= key_diff <= 1e-5 and value_diff <= 1e-5 and same == len(questions)
        print(
            f"| {name} | {keep} | {replayed.get_seq_length()} of {len(prefix)} | {key_diff:.2g} / {value_diff:.2g} | "
            f"{same} of {len(questions)} | {logit_diff:.2g} |"
        )
    if KVZIP in job["presses"]:
        passed &= check_kvzip(model, prefix, questions, job)
    print("check " + ("passed" if passed else "FAILED"))
    return passed


@torch.inference_mode()
def check_kvzip(model: Any, prefix: list[int], questions: list[dict[str, Any]], job: dict[str, Any]) -> bool:
    """One reconstruction's masks vs KVzipPress's own at each keep; batched vs one-question answers under them."""
    cache, all_masks = kvzip_prefill(model, prefix, job["keeps"])
    passed = True
    for keep, masks in all_masks.items():
        if masks is None:
            continue
        hooked_prefill(model, KVzipPress(compression_ratio=1 - keep), prefix)
        own = [module.masked_key_indices for module in attention_layers(model)]
        same_masks = all(
            set(zip(*(t.tolist() for t in ours), strict=True)) == set(zip(*(t.tolist() for t in theirs), strict=True))
            for ours, theirs in zip(masks, own, strict=True)
        )
        with masked_keys(model, masks, len(questions)):
            batched = [answers[0] for answers in answer(model, cache, len(prefix), questions, job)]
        alone = []
        for q in questions:
            with masked_keys(model, masks, 1):
                alone.append(answer(model, cache, len(prefix), [q], job)[0][0])
        same = sum(a[0] == b[0] for a, b in zip(alone, batched, strict=True))
        logit_diff = max(float((a[1] - b[1]).abs().max()) for a, b in zip(alone, batched, strict=True))
        kv_heads = cache.layers[0].keys.shape[1]
        kept = len(prefix) - sum(len(positions) for _, _, positions in masks) / (len(masks) * kv_heads)
        passed &= same_masks and same == len(questions)
        masks_match = "masks equal KVzipPress's own" if same_masks else "masks DIFFER from KVzipPress's own"
        print(
            f"| {KVZIP} | {keep} | {kept:.0f} of {len(prefix)} (mean per head; masked) | {masks_match} | "
            f"{same} of {len(questions)} | {logit_diff:.2g} |"
        )
    return passed


def versions() -> dict[str, str]:
    """The packages whose release decides the answers: realdocs_quality stamps its cached kvpress rows with them."""
    return {package: version(package) for package in ("kvpress", "transformers", "torch")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", nargs="?", help="job JSON written by benchmarks/quality.py")
    parser.add_argument("out", nargs="?", help="where to write the answers (not needed with --check)")
    parser.add_argument("--check", action="store_true", help="verify replay and batching on the first document")
    parser.add_argument("--versions", action="store_true", help="print the versions the answers record, and exit")
    args = parser.parse_args()
    if args.versions:
        print(json.dumps(versions()))
        return 0
    if args.job is None or (not args.check and args.out is None):
        parser.error("give a job and an output path, or a job and --check")
    with open(args.job) as handle:
        job = json.load(handle)
    unknown = set(job["presses"]) - set(PRESSES) - {KVZIP}
    if unknown:
        parser.error(f"unknown presses {sorted(unknown)}; known: {sorted([*PRESSES, KVZIP])}")
    clock = time.perf_counter()
    # sdpa returns no attention weights, so the attention-based presses compute their own from the
    # hidden states, exactly as they do in kvpress's pipeline with the default attention.
    model = (
        AutoModelForCausalLM.from_pretrained(
            job["model_dir"], dtype=getattr(torch, job["dtype"]), attn_implementation="sdpa"
        )
        .to(job["device"])
        .eval()
    )
    log(f"model loaded in {time.perf_counter() - clock:.0f}s (torch threads: {torch.get_num_threads()})")
    if args.check:
        return 0 if check(model, job) else 1
    rows, timings = [], []
    for index, document in enumerate(job["documents"]):
        document_rows, timing = run_document(model, document, job)
        rows += document_rows
        timings.append(timing)
        log(
            f"[{index + 1}/{len(job['documents'])}] {document['name']}: {timing['prefix_tokens']} tokens, "
            f"{len(document['questions'])} questions; prefill {timing['prefill_s']:.0f}s, "
            f"compress {timing['compress_s']:.0f}s, answers {timing['answer_s']:.0f}s"
        )
    with open(args.out, "w") as handle:
        json.dump({"versions": versions(), "timings": timings, "rows": rows}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
