"""Generation that reads each distinct prompt token once on the HF `generate` path: the keys and values of token
sequences already forwarded are kept within a rollout and reused by every prompt that starts like them.

A rollout's prompts repeat themselves. In conversation mode step t's prompt is step t-1's prompt and answer followed
by what came back, so reading it whole makes a T-turn episode's prefill O(T^2) tokens; and at any turn the rows of a
batch share a prefix (the instructions every prompt starts with; the N copies of a task at its first step share the
whole prompt). `PrefixCache.generate` forwards, for each prompt, only the tokens after the longest prefix it shares
with a kept sequence:

1. the prefixes the prompts share are forwarded once each (the longest common prefix of the batch, then each
   prompt's longest prefix in common with another, reusing the first);
2. the prompts are generated from with a cache laid out per row as [pads | its kept prefix | pads | its new tokens]:
   the attention mask hides the pads and positions are counted over the real tokens (the mask's cumulative sum, as
   `generate` computes them for left padding), so every token sits at the position it has in its own prompt;
3. each row's prompt and the answer tokens fed back are kept until the next call, whose prompts continue them in
   conversation mode; a shared prefix is kept while each call reads it (the instructions every prompt starts with),
   so what is kept stays within about two sequences a row.

Exact up to floating-point summation order: with causal attention a token's keys and values depend only on the
tokens before it, so the first j tokens of any forwarded sequence serve every prompt that starts with the same j
tokens, and pads are masked. Kept sequences belong to the weights they were computed with: the trainer clears the
cache at every rollout's start and end. Where it cannot be exact or cannot run, it is not used
(`prefix_cache_problem`).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gigpo_trl.packing import MASKED_ATTENTION, text_decoder_problem

# per layer (keys, values), each (kv_heads, tokens, head_dim): the cache of one token sequence
KeptLayers = list[tuple[torch.Tensor, torch.Tensor]]


def prefix_cache_problem(config: Any, generation_config: Any, *, continuous_batching: bool = False,
                         sharded: str | None = None) -> str | None:
    """Why `PrefixCache` cannot serve a model's generation, or None where it can.

    It needs a text decoder whose attention honours a 2-D mask with holes in it (`text_decoder_problem`: a sliding
    window would drop kept tokens), `generate`'s dynamic cache, TRL's `generate` path (not continuous batching), and
    forwards that each process may make on its own: a `sharded` model (ZeRO-3, FSDP) runs a collective at every
    forward, even with its parameters gathered for generation, and the shared prefixes' forwards differ from process
    to process.
    """
    problem = text_decoder_problem(config, MASKED_ATTENTION)
    if problem:
        return problem
    if getattr(generation_config, "cache_implementation", None) not in (None, "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r} is not the dynamic cache"
    if continuous_batching:
        return "continuous batching (use_transformers_continuous_batching) generates instead"
    if sharded:
        return f"{sharded} makes every forward of the model collective, and processes forward different prefixes"
    return None


@dataclass
class PrefillCounts:
    """Prompt tokens of the generation calls since the counts were last taken, and how many of them were forwarded
    (the rest were read from kept keys and values), in all and by prompt: `forwarded_by_prompt` holds, for each prompt
    of those calls in order, the tokens forwarded for it (a prefix several prompts of a call share is forwarded once,
    and counted for the first of them), which add up to `forwarded_tokens`."""

    prompt_tokens: int = 0
    forwarded_tokens: int = 0
    forwarded_by_prompt: list[int] = field(default_factory=list)


@dataclass
class _Kept:
    ids: np.ndarray  # (tokens,)
    layers: KeptLayers
    shared: bool  # a prefix shared by several prompts, else a row's prompt and answer
    used: bool = True  # read, or made, by the latest generation call


@dataclass
class PrefixCache:
    """The keys and values of the token sequences forwarded during a rollout, and the generation that reuses them.

    Args:
        min_shared_tokens: the shortest prefix shared by several prompts that is forwarded once for them all.
    """

    min_shared_tokens: int = 16
    counts: PrefillCounts = field(default_factory=PrefillCounts)
    _kept: list[_Kept] = field(default_factory=list)

    def clear(self) -> None:
        """Forget every kept sequence (the weights they were computed with are about to change)."""
        self._kept.clear()

    def take_counts(self) -> PrefillCounts:
        """The counts since the last call, and reset them."""
        counts, self.counts = self.counts, PrefillCounts()
        return counts

    def generate(self, model, prompt_ids: Sequence[Sequence[int]], generation_config,
                 pad_token_id: int) -> torch.Tensor:
        """`model.generate` over the prompts (lists of ids, no padding), forwarding only the prompt tokens no kept
        sequence holds. Returns the generated ids (B, new tokens) as `generate` returns them after the prompt (a row
        that ended early is followed by pads). Call under `torch.no_grad()`, with the model set up for generation."""
        prompts = [np.asarray(ids, dtype=np.int64) for ids in prompt_ids]
        if not prompts or min(map(len, prompts)) == 0:
            raise ValueError("PrefixCache.generate needs at least one prompt, each of at least one token")
        self.counts.prompt_tokens += sum(map(len, prompts))
        for kept in self._kept:
            kept.used = False
        shared = self._forward_shared_prefixes(model, prompts, pad_token_id)
        inputs, attention_mask, cache, own = self._layout(prompts, pad_token_id, model.device)
        self.counts.forwarded_by_prompt += [tokens + more for tokens, more in zip(own, shared)]
        generation_config = copy.copy(generation_config)
        generation_config.return_dict_in_generate = True
        output = model.generate(input_ids=inputs, attention_mask=attention_mask, past_key_values=cache,
                                generation_config=generation_config)
        generated = output.sequences[:, inputs.size(1):]
        fed = generated.size(1) - 1  # the last token sampled is not forwarded
        eos = _eos_ids(generation_config)
        self._kept = [kept for kept in self._kept if kept.shared and kept.used]
        for row, ids in enumerate(prompts):
            answer = until_eos(generated[row, :fed].tolist(), eos)
            self._kept.append(_Kept(np.concatenate([ids, np.asarray(answer, dtype=np.int64)]),
                                    _row_layers(output.past_key_values, row, attention_mask[row], len(answer)), False))
        return generated

    def _forward_shared_prefixes(self, model, prompts: list[np.ndarray], pad_token_id: int) -> list[int]:
        """Forward, once each, the prefixes the prompts share that are not kept yet: the longest common prefix of them
        all, then each prompt's longest prefix in common with another (one batched forward each, the second reusing
        the first). Returns the tokens forwarded for each prompt: a prefix's, counted for the first prompt that starts
        with it."""
        forwarded = [0] * len(prompts)
        for prefixes in _shared_prefixes(prompts):
            todo = [ids for ids in prefixes
                    if len(ids) >= self.min_shared_tokens and self._longest_kept(ids, len(ids))[0] < len(ids)]
            if not todo:
                continue
            inputs, attention_mask, cache, tokens = self._layout(todo, pad_token_id, model.device)
            for ids, count in zip(todo, tokens):
                first = next(k for k, prompt in enumerate(prompts) if _common_prefix_length(prompt, ids) == len(ids))
                forwarded[first] += count
            new = inputs.size(1) - (cache.get_seq_length() if cache is not None else 0)
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]
            output = model(input_ids=inputs[:, -new:], attention_mask=attention_mask, position_ids=positions,
                           past_key_values=cache, use_cache=True)
            for row, ids in enumerate(todo):
                self._kept.append(_Kept(ids, _row_layers(output.past_key_values, row, attention_mask[row], 0), True))
        return forwarded

    def _longest_kept(self, ids: np.ndarray, limit: int) -> tuple[int, KeptLayers | None]:
        """The longest prefix of `ids`, of at most `limit` tokens, that a kept sequence starts with: (its length, that
        sequence's layers)."""
        best, chosen = 0, None
        for kept in self._kept:
            length = min(_common_prefix_length(ids, kept.ids), limit)
            if length > best:
                best, chosen = length, kept
        if chosen is None:
            return 0, None
        chosen.used = True
        return best, chosen.layers

    def _layout(self, sequences: list[np.ndarray], pad_token_id: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, object | None, list[int]]:
        """The batch of sequences over their longest kept prefixes (each leaves at least one token to forward): input
        ids and attention mask (B, C + N), rows laid out as [pads | kept prefix | pads | new tokens] with C the longest
        kept prefix and N the most new tokens, the `DynamicCache` of the first C columns (None when nothing is kept),
        and each sequence's tokens to forward (counted)."""
        from transformers import DynamicCache

        kept = [self._longest_kept(ids, len(ids) - 1) for ids in sequences]
        new_tokens = [len(ids) - length for ids, (length, _) in zip(sequences, kept)]
        self.counts.forwarded_tokens += sum(new_tokens)
        cached = max(length for length, _ in kept)
        new = max(new_tokens)
        inputs = torch.full((len(sequences), cached + new), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(inputs)
        for row, (ids, (length, _)) in enumerate(zip(sequences, kept)):
            inputs[row, cached - length: cached] = torch.from_numpy(ids[:length])
            inputs[row, cached + new - (len(ids) - length):] = torch.from_numpy(ids[length:])
            attention_mask[row, cached - length: cached] = 1
            attention_mask[row, cached + new - (len(ids) - length):] = 1
        if cached == 0:
            return inputs.to(device), attention_mask.to(device), None, new_tokens
        reference = next(layers for _, layers in kept if layers is not None)
        data = []
        for layer, (keys, values) in enumerate(reference):
            batch_keys = keys.new_zeros((len(sequences), keys.size(0), cached, keys.size(2)))
            batch_values = values.new_zeros((len(sequences), values.size(0), cached, values.size(2)))
            for row, (length, layers) in enumerate(kept):
                if length:
                    batch_keys[row, :, cached - length:] = layers[layer][0][:, :length]
                    batch_values[row, :, cached - length:] = layers[layer][1][:, :length]
            data.append((batch_keys, batch_values))
        return inputs.to(device), attention_mask.to(device), DynamicCache(ddp_cache_data=data), new_tokens


def _shared_prefixes(prompts: list[np.ndarray]) -> list[list[np.ndarray]]:
    """The prefixes a batch of prompts shares, in two levels: [the longest common prefix of them all], then each
    prompt's longest prefix in common with another prompt (a prompt that appears twice: itself), where longer."""
    if len(prompts) < 2:
        return []
    keys = [tuple(ids.tolist()) for ids in prompts]
    ordered = sorted(set(keys))
    repeated = {key for key, count in Counter(keys).items() if count > 1}
    everyone = _common_prefix_length(np.asarray(ordered[0]), np.asarray(ordered[-1]))
    # in lexicographic order a prompt's longest common prefix with any other is one with a neighbour
    shared = set()
    for k, key in enumerate(ordered):
        neighbours = [ordered[j] for j in (k - 1, k + 1) if 0 <= j < len(ordered)]
        length = len(key) if key in repeated else max(
            (_common_prefix_length(np.asarray(key), np.asarray(other)) for other in neighbours), default=0)
        if length > everyone:
            shared.add(key[:length])
    common = [np.asarray(ordered[0][:everyone], dtype=np.int64)] if everyone else []
    return [common, [np.asarray(key, dtype=np.int64) for key in sorted(shared)]]


def _row_layers(cache, row: int, attention_mask: torch.Tensor, answer_tokens: int) -> KeptLayers:
    """One row's keys and values out of a batched cache: those of its real input tokens (the mask's ones), then of
    its first `answer_tokens` generated tokens."""
    columns = torch.cat([attention_mask.nonzero().flatten(), torch.arange(
        attention_mask.numel(), attention_mask.numel() + answer_tokens, device=attention_mask.device)])
    return [(layer.keys[row][:, columns].clone(), layer.values[row][:, columns].clone()) for layer in cache.layers]


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """Generated ids up to their first end token, included."""
    for k, token in enumerate(ids):
        if token in eos:
            return ids[: k + 1]
    return ids
