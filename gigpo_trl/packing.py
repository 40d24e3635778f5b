"""The packed update: the rows of a forward pass folded into a prefix trie, so that each token the rows share is
forwarded once.

A GRPOTrainer forward pass reads `(B, L)` rows, each a left-padded prompt followed by a right-padded completion of
`C = logits_to_keep` columns, and returns one log-prob (and entropy) per completion column. Most of those tokens are
repeats: every prompt of a run starts with the same instructions, and without history the copies of a task that reach
the same state have identical prompts (GiGPO's step groups). `pack_rows` inserts each row's real tokens into a trie,
one node per distinct path: rows that agree on their first k tokens share those k nodes. A node's attention sees
exactly its ancestors and itself, and its position is its depth, so each node's hidden state is the one the plain
path computes at that token (under rotary positions, which depend on position differences only).

A node's hidden state scores one next token (`shift_labels`). Where rows that share a node go on with different
completion tokens, each needs the node's hidden state to score its own next token, so such rows part one token
earlier; a node that scores nothing for one row (a prompt position) is shared with a row for which it scores. Every
completion token is scored exactly once per distinct path, its log-prob handed to every row on that path (`unpack`),
its gradient summed over them. Where a step's prompt extends the previous step sample token for token (a
conversation), a trajectory's rows form one path: its tokens are forwarded once, however many steps it has.

The trie is cut into packed rows of at most `capacity` nodes (rows are inserted in sorted order, so rows that share a
prefix sit together); a packed row's attention is dense over its nodes, so `capacity` bounds the attention's cost
against the plain path's. A packed row's nodes are numbered in depth-first order, so a node's ancestors are the nodes
k before it whose subtree it is in (k <= j < subtree_end[k]): the attention is an interval predicate, which
FlexAttention takes as a block mask without the dense (T x T) one (`PackedRows.block_mask`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

IGNORED = -100  # a position whose hidden state scores nothing (TRL's label convention)
# Attention implementations that take a 4-D mask as given (transformers' `create_causal_mask` returns it as is).
MASKED_ATTENTION = ("sdpa", "eager")


def text_decoder_problem(config: Any, attentions: tuple[str, ...]) -> str | None:
    """Why a model is not a text decoder whose every layer attends to the whole context through one of `attentions`,
    or None where it is: what both the packed update and the prefix cache (`gigpo_trl.prefix_cache`) need, since each
    gives the attention a mask of its own with holes in it, and a sliding window would be replaced by it."""
    if config.get_text_config() is not config:
        return f"{config.model_type} is a multimodal model"
    if config._attn_implementation not in attentions:
        return f"attn_implementation={config._attn_implementation!r} takes no 4-D attention mask (use one of {attentions})"
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None) or \
            "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return f"{config.model_type} uses sliding-window attention"
    return None


def packing_problem(config: Any, device_type: str = "cpu") -> str | None:
    """Why a model's forward pass cannot be packed exactly, or None where it can.

    Packing needs a text decoder (`text_decoder_problem`) whose attention takes the trie's 4-D mask as given (or,
    FlexAttention on CUDA, its block mask: FlexAttention's backward runs on CUDA only in torch 2.13), and positions
    that enter only as differences (rotary embeddings: the plain path's left-padded rows start at a later absolute
    position).
    """
    problem = text_decoder_problem(config, (*MASKED_ATTENTION, "flex_attention"))
    if problem:
        return problem
    if config._attn_implementation == "flex_attention" and device_type != "cuda":
        return f"attn_implementation='flex_attention' trains on CUDA only (this model is on {device_type}; use 'sdpa')"
    if getattr(config, "rope_parameters", None) is None and getattr(config, "rope_theta", None) is None:
        return f"{config.model_type}'s positions are not rotary, so a left-padded row's positions would differ"
    return None


@dataclass(frozen=True)
class PackedRows:
    """The rows of a forward pass as packed rows of trie nodes.

    Attributes:
        input_ids: (P, T) the nodes' tokens, in depth-first order; padding nodes hold 0.
        position_ids: (P, T) each node's depth on its path (0 for the first prompt token); 0 for padding.
        subtree_end: (P, T) one past the last node of each node's subtree (a padding node's: itself + 1), so node j
            sees node i (i is j or one of its ancestors) exactly when i <= j < subtree_end[i].
        shift_labels: (P, T) the completion token a node's hidden state scores, IGNORED where it scores none.
        gather: (B, C) where each row's completion token is scored, as an index into the flattened (P * T) outputs;
            P * T (one past the end) for the columns that are not real tokens.
        tokens: the real nodes, summed over packed rows (the plain path forwards B * L positions).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    shift_labels: torch.Tensor
    gather: torch.Tensor
    tokens: int

    @property
    def visible(self) -> torch.Tensor:
        """(P, T, T) bool, visible[p, j, i]: node i is node j or one of its ancestors (padding sees itself)."""
        nodes = torch.arange(self.input_ids.size(1), device=self.input_ids.device)
        query, key = nodes[None, :, None], nodes[None, None, :]
        return (key <= query) & (query < self.subtree_end[:, None, :])

    def block_mask(self):
        """The same visibility as FlexAttention's `BlockMask` (attn_implementation "flex_attention"), from the interval
        predicate: no dense (T x T) mask is held, and blocks no node of which sees another are skipped."""
        from torch.nn.attention.flex_attention import create_block_mask

        subtree_end = self.subtree_end

        def sees(batch, head, query, key):
            return (key <= query) & (query < subtree_end[batch, key])

        rows, width = self.input_ids.shape
        return create_block_mask(sees, B=rows, H=None, Q_LEN=width, KV_LEN=width, device=self.input_ids.device)

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The 4-D mask a transformers model takes as given: (P, 1, T, T), bool (True: attend; SDPA) or, with a
        floating `dtype`, additive (0 where visible, the dtype's minimum elsewhere; eager attention)."""
        if dtype is None:
            return self.visible[:, None]
        bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
        return bias.masked_fill(~self.visible, torch.finfo(dtype).min)[:, None]


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> list[tuple[list[int], int]]:
    """Each row's real tokens (the attended prompt tokens, then the attended completion tokens) and its prompt length.

    Args:
        input_ids: (B, L) prompt columns then `completion_length` completion columns.
        attention_mask: (B, L) 1 on real tokens: a contiguous run at the end of the prompt columns (left padding) and
            at the start of the completion columns (right padding), as GRPOTrainer builds them.
    Raises:
        ValueError: a row whose mask is not of that shape, or that has completion tokens but no prompt token to score
            the first of them from.
    """
    rows = []
    prompt_columns = input_ids.size(1) - completion_length
    for index, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist(), strict=True)):
        prompt_mask, completion_mask = mask[:prompt_columns], mask[prompt_columns:]
        prompt_length, completion_real = sum(prompt_mask), sum(completion_mask)
        if prompt_mask != [0] * (prompt_columns - prompt_length) + [1] * prompt_length or \
                completion_mask != [1] * completion_real + [0] * (completion_length - completion_real):
            raise ValueError(f"row {index}: its attention mask is not a left-padded prompt followed by a right-padded "
                             "completion; it cannot be packed")
        if completion_real and not prompt_length:
            raise ValueError(f"row {index}: a completion without a prompt token; it cannot be packed")
        rows.append((ids[prompt_columns - prompt_length:prompt_columns] + ids[prompt_columns:prompt_columns + completion_real],
                     prompt_length))
    return rows


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
              capacity: int | None = None) -> PackedRows:
    """The rows of a GRPOTrainer forward pass folded into a prefix trie (see the module docstring).

    Args:
        input_ids: (B, L) prompt columns (left-padded) then `completion_length` completion columns (right-padded).
        attention_mask: (B, L) 1 on real tokens.
        completion_length: C, the completion columns (GRPOTrainer's `logits_to_keep`).
        capacity: the most nodes of a packed row; a row longer than it gets a packed row of its own. None: 2 * L,
            so that no packed row's attention costs more than twice a plain row's per token.
    Returns:
        `PackedRows`, on the device of `input_ids`.
    """
    capacity = capacity or 2 * input_ids.size(1)
    rows = real_tokens(input_ids, attention_mask, completion_length)
    bins: list[dict] = []
    gather = [[None] * completion_length for _ in rows]
    for index in sorted(range(len(rows)), key=lambda r: rows[r][0]):
        sequence, prompt_length = rows[index]
        if len(sequence) == prompt_length:
            continue  # no completion token: nothing to score
        # each token but the last, with the token its hidden state scores: the next one, where that is an answer's
        # (the last token's hidden state scores nothing: it is not forwarded)
        keys = [(token, sequence[i + 1] if i + 1 >= prompt_length else IGNORED) for i, token in enumerate(sequence[:-1])]
        if not bins or len(bins[-1]["tokens"]) + new_nodes(bins[-1], keys) > capacity:
            bins.append({"tokens": [], "parents": [], "scores": [], "children": {}})
        trie = bins[-1]
        parent = -1
        for position, (token, score) in enumerate(keys):
            node = matching_node(trie, parent, token, score)
            if node is None:
                node = len(trie["tokens"])
                trie["children"].setdefault((parent, token), []).append(node)
                trie["tokens"].append(token)
                trie["scores"].append(score)
                trie["parents"].append(parent)
            elif score != IGNORED:
                trie["scores"][node] = score
            if position + 1 >= prompt_length:
                gather[index][position + 1 - prompt_length] = (len(bins) - 1, node)
            parent = node
    return packed_tensors(bins, gather, input_ids.device)


def matching_node(trie: dict, parent: int, token: int, score: int) -> int | None:
    """A child of `parent` holding `token` whose hidden state can score `score` too: one that scores the same token
    or none (a prompt position of another row), or any, where `score` is IGNORED. None: the path needs a new node."""
    for node in trie["children"].get((parent, token), ()):
        if score in (IGNORED, trie["scores"][node]) or trie["scores"][node] == IGNORED:
            return node
    return None


def new_nodes(trie: dict, keys: list[tuple[int, int]]) -> int:
    """How many nodes a path of (token, scored token) keys adds to a trie."""
    parent = -1
    for matched, (token, score) in enumerate(keys):
        parent = matching_node(trie, parent, token, score)
        if parent is None:
            return len(keys) - matched
    return 0


def depth_first(parents: list[int]) -> tuple[list[int], list[int]]:
    """A trie's nodes (each one's parent, -1 for a root; parents before children) in depth-first preorder, children
    in the order they were made: (the node at each new position, one past each new position's subtree)."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for node, parent in enumerate(parents):
        (children[parent] if parent >= 0 else roots).append(node)
    order, subtree_end, position = [], [0] * len(parents), [0] * len(parents)
    stack = [(node, False) for node in reversed(roots)]
    while stack:
        node, left = stack.pop()
        if left:
            subtree_end[position[node]] = len(order)
            continue
        position[node] = len(order)
        order.append(node)
        stack += [(node, True), *((child, False) for child in reversed(children[node]))]
    return order, subtree_end


def packed_tensors(bins: list[dict], gather: list[list], device: torch.device) -> PackedRows:
    """`PackedRows` from the packed rows' tries and the (packed row, node) scoring each completion column, the nodes
    renumbered in depth-first order."""
    width = max((len(trie["tokens"]) for trie in bins), default=1)
    input_ids = torch.zeros(len(bins), width, dtype=torch.long)
    position_ids = torch.zeros(len(bins), width, dtype=torch.long)
    subtree_end = torch.arange(1, width + 1).repeat(len(bins), 1)
    shift_labels = torch.full((len(bins), width), IGNORED, dtype=torch.long)
    renumbered = []  # per packed row: node -> its depth-first position
    for row, trie in enumerate(bins):
        order, ends = depth_first(trie["parents"])
        position = {node: k for k, node in enumerate(order)}
        renumbered.append(position)
        size = len(order)
        input_ids[row, :size] = torch.tensor([trie["tokens"][node] for node in order])
        shift_labels[row, :size] = torch.tensor([trie["scores"][node] for node in order])
        subtree_end[row, :size] = torch.tensor(ends)
        depth = [0] * size
        for k, node in enumerate(order):  # a parent comes before its children in depth-first order too
            parent = trie["parents"][node]
            depth[k] = depth[position[parent]] + 1 if parent >= 0 else 0
        position_ids[row, :size] = torch.tensor(depth)
    past_the_end = len(bins) * width
    gather_index = torch.tensor([[past_the_end if at is None else at[0] * width + renumbered[at[0]][at[1]]
                                  for at in columns] for columns in gather], dtype=torch.long).reshape(len(gather), -1)
    return PackedRows(input_ids.to(device), position_ids.to(device), subtree_end.to(device), shift_labels.to(device),
                      gather_index.to(device), sum(len(trie["tokens"]) for trie in bins))


def unpack(values: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """Per-node outputs of the packed rows, (P, T), as the plain path's per-row completion outputs, (B, C): each
    column's value from the node that scores it, 0 on the columns that are not real tokens (as TRL's fused head gives
    for an ignored label). Differentiable: a node shared by several rows gets the sum of their gradients."""
    flat = torch.cat([values.reshape(-1), values.new_zeros(1)])
    return flat[gather]


def rows_by_prompt(batch: dict[str, Any]) -> dict[str, Any]:
    """A GRPOTrainer batch with its rows sorted by their prompts' real tokens: rows that share a prompt, or a start of
    one, become neighbours, so that the micro-batches TRL splits the batch into share more (see `pack_rows`).

    Every value with a row dimension is permuted alike ((B, ...) tensors, lists of B); anything else (the 0-dim
    `num_items_in_batch`, None) is kept.
    """
    rows = batch["prompt_ids"].size(0)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    order = sorted(range(rows), key=prompts.__getitem__)
    index = torch.tensor(order, device=batch["prompt_ids"].device)
    return {key: value[index] if isinstance(value, torch.Tensor) and value.dim() else
            [value[k] for k in order] if isinstance(value, list) and len(value) == rows else value
            for key, value in batch.items()}


def joined(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The micro-batches TRL split a batch into (`split_tensor_dict`), joined again: row values concatenated, the
    shared ones (0-dim tensors, None) taken from the first."""
    first = batches[0]
    return {key: torch.cat([batch[key] for batch in batches]) if isinstance(value, torch.Tensor) and value.dim() else
            [item for batch in batches for item in batch[key]] if isinstance(value, list) else value
            for key, value in first.items()}



def packed_logps_and_entropies(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                               batch_size: int | None, *, compute_entropy: bool, attention: str, dtype: torch.dtype,
                               autocast: Callable[[], AbstractContextManager]) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """`GRPOTrainer._get_per_token_logps_and_entropies`, packed: each pass of `batch_size` rows (all rows: None) folded
    into a prefix trie (`pack_rows`), each shared token forwarded once, the outputs handed back to the rows (`unpack`):
    the same (B, C) log-probs (and entropies) within fp32 rounding, and None for the auxiliary loss, as the parent's.

    Args:
        model: the model TRL's forward pass calls (wrapped by accelerate or not).
        input_ids, attention_mask: (B, L) left-padded prompts and right-padded completions of C = `logits_to_keep`.
        attention: the model's attention implementation: FlexAttention takes the trie's block mask, the others its
            dense 4-D mask (`dtype`, the model's, for an additive one).
        autocast: the training's autocast context (`accelerator.autocast`).
    """
    batch_size = batch_size or input_ids.size(0)
    log_probs, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        packed = pack_rows(input_ids[start:start + batch_size], attention_mask[start:start + batch_size], logits_to_keep)
        mask = packed.block_mask() if attention == "flex_attention" else \
            packed.attention_mask(None if attention == "sdpa" else dtype)
        with autocast():
            outputs = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                            shift_labels=packed.shift_labels, fused_lm_head=True)
        log_probs.append(unpack(outputs.log_probs, packed.gather))
        if compute_entropy:
            entropies.append(unpack(outputs.entropy, packed.gather))
    return torch.cat(log_probs), torch.cat(entropies) if compute_entropy else None, None
