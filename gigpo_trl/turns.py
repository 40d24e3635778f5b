"""The turn: a step's prompts to their finished `Completion`s, in one batched generation call.

`TurnGenerator` is what the turn loop (`gigpo_trl.rollout.collect_rollout`) calls once per turn, with the prompts of
the turn's live environments and the tools each offers. For each prompt it

1. renders the token ids the model reads (`PromptRenderer`): chat messages by the chat template with their tools
   (without tools, as TRL's `_tokenize_prompts` renders them), a prompt with images by the processor with its image
   tensors, and a conversation's continued prompt as its previous prompt and answer ids followed by the template's ids
   for what came back (`gigpo_trl.conversation.ChatTurns`);
2. fits it to the model's context: a prompt of more than `prompt_token_limit` tokens is not generated from
   (`PromptTooLong`; the dummy prompt stands in, which keeps every process's call alike), unless a conversation's
   oldest exchanges can be dropped for it to fit (`drop_oldest_target`, `context_overflow='drop_oldest'`);
3. generates from it through the backend, one call for the whole turn (`Backend`: TRL's generation backends,
   `gigpo_trl.generation.TRLGeneration`, which reads each distinct prompt token of a rollout once through the prefix
   cache on the HF path; or a scripted policy in tests), with its images;
4. builds its `Completion` whole: prompt and answer ids, the answer's text, the sampling log-probs, the exchanges
   dropped, the image inputs every forward pass of the update reads the row with, and the prompt tokens forwarded.

`rollout()` is the scope of one rollout: what the prefix cache keeps belongs to the weights it was computed with.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.chat_template_utils import get_training_chat_template
from trl.data_utils import prepare_multimodal_messages

from gigpo_trl.conversation import ChatTurns
from gigpo_trl.dialogue import (
    DUMMY_PROMPT, Completion, ContinuedPrompt, Messages, Prompt, PromptTooLong, Tools, exchange_count, prompt_messages,
    without_oldest_exchanges,
)
from gigpo_trl.observations import PER_TOKEN_IMAGE_KEYS, message_images
from gigpo_trl.prefix_cache import PrefixCache


@dataclass(frozen=True)
class TurnBatch:
    """What one generation call generates from: the turn's prompts (as the rollout wrote them, with the tools each
    offers), their token ids as the model reads them, and their images as TRL's `_generate_single_turn` takes them
    (`images`, one list per prompt or None, and the processor's tensors, `image_fields`)."""

    prompts: list[Prompt]
    tools: list[Tools | None]
    prompt_ids: list[list[int]]
    images: list[list[Any] | None] | None = None
    image_fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GeneratedTokens:
    """What a backend generated for a `TurnBatch`, one entry per prompt: the answer ids; the sampling log-probs of
    the answer tokens where the backend returns them (vLLM; None stands for a NaN log-prob); and the prompt tokens
    each row forwarded where the backend counts them (None: not counted)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float | None]] | None = None
    prefill_tokens: list[int] | None = None


# One generation call: a turn's prompts in, their answers' tokens out.
Backend = Callable[[TurnBatch], GeneratedTokens]


@dataclass(frozen=True)
class PromptRenderer:
    """A turn's prompts as the token ids the model reads.

    Args:
        processing_class: the tokenizer or processor; it renders prompts with tools or images.
        tokenize_messages: chat messages without tools to their ids, as TRL renders them (`GRPOTrainer._tokenize_prompts`,
            which falls back on a plain tokenizer call for a model without a chat template).
        chat_template, chat_template_kwargs: the template prompts are rendered with, and its arguments.
        reads_images: the model is a vision-language model; a text-only one is refused image observations by name.
        chat_turns: conversation mode's turns, which render a continued prompt; None where no prompt continues another.
        env_name: named in errors.
    """

    processing_class: Any
    tokenize_messages: Callable[[list[Messages]], list[list[int]]]
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reads_images: bool = False
    chat_turns: ChatTurns | None = None
    env_name: str = "environment"

    def __call__(self, prompts: Sequence[Prompt], tools: Sequence[Tools | None]
                 ) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
        """The prompts' token ids, and each one's image inputs (None without images): the processor renders a prompt
        with images alone, its ids holding the image tokens it writes, and keeps its tensors (`Completion.image_inputs`:
        the `pixel_values` and the keys that describe them, with `num_images`)."""
        with_images = {k for k, prompt in enumerate(prompts)
                       if not isinstance(prompt, ContinuedPrompt) and message_images(prompt)}
        if with_images and not self.reads_images:
            raise ValueError(
                f"environment {self.env_name!r} returned image observations, but the model reads text only (its "
                f"processing_class is a {type(self.processing_class).__name__}): train a vision-language model, whose "
                "processor GiGPOTrainer loads with it, or give it the processor (processing_class=AutoProcessor...)")
        ids: dict[int, list[int]] = {}
        image_inputs: list[dict[str, Any] | None] = [None] * len(prompts)
        for k in with_images:  # one at a time: each row keeps its own processor tensors
            rendered = self.processing_class.apply_chat_template(
                [prepare_multimodal_messages(prompts[k])], tools=tools[k] or None, add_generation_prompt=True,
                tokenize=True, return_dict=True, return_tensors="pt", chat_template=self.chat_template,
                **self.chat_template_kwargs)
            ids[k] = rendered["input_ids"][0].tolist()
            image_inputs[k] = {"num_images": len(message_images(prompts[k])),
                               **{key: value for key, value in rendered.items() if key not in ("input_ids", "attention_mask")}}
        written = [k for k, prompt in enumerate(prompts) if not isinstance(prompt, ContinuedPrompt) and k not in with_images]
        if any(tools):
            rendered = [self.processing_class.apply_chat_template(
                prompts[k], tools=tools[k] or None, add_generation_prompt=True, tokenize=True, return_dict=True,
                chat_template=self.chat_template, **self.chat_template_kwargs)["input_ids"] for k in written]
        else:
            rendered = self.tokenize_messages([prompts[k] for k in written]) if written else []
        ids |= {k: list(r) for k, r in zip(written, rendered)}
        return [ids[k] if k in ids else self.chat_turns.prompt_ids(prompt) for k, prompt in enumerate(prompts)], \
            image_inputs

    def ids(self, prompt: Prompt, tools: Tools | None = None) -> list[int]:
        """One prompt's token ids."""
        return self([prompt], [tools])[0][0]


@dataclass
class TurnGenerator:
    """The turn (module docstring): `generator(prompts, tools)` answers each prompt with a `Completion`, or with
    `PromptTooLong` where it did not fit the model's context.

    Args:
        render: the prompts' token ids.
        backend: generates a turn's answers (`TRLGeneration`; a scripted policy plugs in here).
        eos_token_id: what an empty answer becomes (TRL's loss reads the last token of every answer).
        decode: answer ids to the answer's text.
        prompt_token_limit: the most tokens a prompt may have (`prompt_token_limit`); None: no limit is checked.
        drop_oldest_target: under `context_overflow='drop_oldest'`, the share of `prompt_token_limit` a conversation
            is brought down to by dropping its oldest exchanges; None: an over-long prompt ends its episode.
        prefix_cache: the keys and values HF generation keeps within a rollout (`generation_prefix_cache`; the
            backend generates through it), or None.
    """

    render: PromptRenderer
    backend: Backend
    eos_token_id: int
    decode: Callable[[list[int]], str]
    prompt_token_limit: int | None = None
    drop_oldest_target: float | None = None
    prefix_cache: PrefixCache | None = None

    def __call__(self, prompts: list[Prompt], tools: list[Tools | None]) -> list[Completion | PromptTooLong]:
        prompt_ids, image_inputs = self.render(prompts, tools)
        too_long = over_long_prompts(prompt_ids, self.prompt_token_limit)
        dropped: dict[int, int] = {}
        if self.drop_oldest_target is not None:
            for k in [k for k in too_long if isinstance(prompts[k], ContinuedPrompt)]:
                fitted = self._fit_context(prompts[k].messages, tools[k])
                if fitted is not None:
                    dropped[k], prompt_ids[k] = fitted
                    del too_long[k]
        if too_long:
            dummy = self.render.ids(DUMMY_PROMPT)
            prompt_ids = [dummy if k in too_long else ids for k, ids in enumerate(prompt_ids)]
            image_inputs = [None if k in too_long else inputs for k, inputs in enumerate(image_inputs)]
        images, fields = generation_image_inputs(prompts, prompt_ids, image_inputs)
        generated = self.backend(TurnBatch(prompts, tools, prompt_ids, images, fields))
        return [
            PromptTooLong(too_long[k], self.prompt_token_limit) if k in too_long else finished_completion(
                prompt_ids[k], generated.completion_ids[k], None if generated.logprobs is None else generated.logprobs[k],
                eos_token_id=self.eos_token_id, decode=self.decode, dropped_exchanges=dropped.get(k, 0),
                image_inputs=image_inputs[k],
                prefill_tokens=None if generated.prefill_tokens is None else generated.prefill_tokens[k])
            for k in range(len(prompts))
        ]

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """One rollout: the prefix cache starts empty, its counts too, and is emptied after it (what it keeps belongs to
        the weights of this rollout, which the update then changes)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.take_counts()
        try:
            yield
        finally:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def dummy_completion(self, *, nan_logprob: bool) -> Completion:
        """A stand-in sample (zero loss weight) for a process without a sample for the update: its environments all
        failed to start, or dynamic sampling found no group with a signal. `nan_logprob`: it carries a NaN sampling
        log-prob, as the other processes' samples carry theirs (vLLM)."""
        return Completion(self.render.ids(DUMMY_PROMPT), [self.eos_token_id], "",
                          [float("nan")] if nan_logprob else None)

    def _fit_context(self, messages: Messages, tools: Tools | None) -> tuple[int, list[int]] | None:
        """The fewest oldest exchanges dropped from a conversation for its prompt to take at most `drop_oldest_target`
        of the room a prompt has (the fewest that fit the room where none does), and that prompt's ids, rendered from
        its messages; None when even its first messages and its latest exchange do not fit."""
        target = int(self.drop_oldest_target * self.prompt_token_limit)
        fitting = None
        for count in range(1, exchange_count(messages)):
            ids = self.render.ids(without_oldest_exchanges(messages, count), tools)
            if len(ids) <= target:
                return count, ids
            if fitting is None and len(ids) <= self.prompt_token_limit:
                fitting = count, ids
        return fitting


def conversation_turns(processing_class: Any, chat_template: str | None, chat_template_kwargs: dict[str, Any],
                       end_of_turn: Sequence[int], turn_role: str) -> tuple[ChatTurns, str | None]:
    """Conversation mode's turns (`gigpo_trl.conversation`), and the chat template prompts are rendered with: the
    given one where it is prefix-preserving, else TRL's training template of its family where TRL has one (as TRL's
    tool loop does; said in a warning); otherwise refused, naming the problem.

    Args:
        turn_role: what comes back after an answer: "user" (a text environment's observation) or "tool".
    """
    def turns(template: str | None) -> ChatTurns:
        def render(messages: list, add_generation_prompt: bool) -> list[int]:
            return list(processing_class.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
                chat_template=template, **chat_template_kwargs))

        checked = ChatTurns(render, frozenset(end_of_turn))
        checked.check(turn_role)
        return checked

    try:
        return turns(chat_template), chat_template
    except ValueError as refused:
        try:
            training_template = get_training_chat_template(processing_class)
        except ValueError:
            training_template = None
        if training_template is None:
            raise refused from None
    checked = turns(training_template)
    warnings.warn("conversation mode: the chat template is not prefix-preserving; prompts are rendered with TRL's "
                  "training template of its family (trl.chat_template_utils.get_training_chat_template)", stacklevel=4)
    return checked, training_template


def finished_completion(prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float | None] | None,
                        *, eos_token_id: int, decode: Callable[[list[int]], str], dropped_exchanges: int = 0,
                        image_inputs: dict[str, Any] | None = None, prefill_tokens: int | None = None) -> Completion:
    """A `Completion` from what a backend generated for one prompt.

    vLLM reports a token whose log-prob is NaN as None: it becomes NaN again (no importance-sampling correction for
    it). An empty answer becomes the EOS token alone (TRL's loss reads the last token of every answer), with a NaN
    log-prob.
    """
    lps = None if logprobs is None else [float("nan") if lp is None else float(lp) for lp in logprobs]
    ids = list(completion_ids)
    if not ids:
        ids = [eos_token_id]
        lps = None if lps is None else [float("nan")]
    return Completion(list(prompt_ids), ids, decode(ids), lps, dropped_exchanges, image_inputs, prefill_tokens)


def generation_image_inputs(prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                            image_inputs: Sequence[dict[str, Any] | None]
                            ) -> tuple[list[list[Any] | None] | None, dict[str, Any]]:
    """What TRL's `_generate_single_turn` takes with a turn's prompt ids for their images: `images`, each prompt's
    images (vLLM's `multi_modal_data`; None for a prompt without, and None in all without any), and the processor's
    tensors of the prompts that have images, concatenated in prompt order (HF generation's `pixel_values`, ...); a
    per-token key (`gigpo_trl.observations.PER_TOKEN_IMAGE_KEYS`) as one list per prompt, 0s for a prompt without
    images, which TRL left-pads with the prompts."""
    if not any(image_inputs):
        return None, {}
    images = [message_images(prompt_messages(prompt)) if inputs else None
              for prompt, inputs in zip(prompts, image_inputs)]
    rows = [inputs for inputs in image_inputs if inputs]
    fields = {}
    for key in rows[0]:
        if key in PER_TOKEN_IMAGE_KEYS:
            fields[key] = [inputs[key].reshape(-1).tolist() if inputs else [0] * len(ids)
                           for ids, inputs in zip(prompt_ids, image_inputs)]
        elif key != "num_images":
            fields[key] = torch.cat([inputs[key] for inputs in rows])
    return images, fields


def prompt_token_limit(max_position_embeddings: int | None, vllm_max_model_length: int | None,
                       max_completion_length: int) -> int | None:
    """The most tokens a prompt may have so that its answer, up to `max_completion_length` tokens, fits the model's
    context: vLLM's `max_model_len` where one is set (`vllm_max_model_length`, under vLLM), else the model's
    `max_position_embeddings`; None where neither is known (no limit is checked)."""
    context = vllm_max_model_length or max_position_embeddings
    return None if context is None else context - max_completion_length


def over_long_prompts(prompt_ids: Sequence[Sequence[int]], limit: int | None) -> dict[int, int]:
    """{position: token count} of the prompts of more than `limit` tokens (none without a limit)."""
    if limit is None:
        return {}
    return {k: len(ids) for k, ids in enumerate(prompt_ids) if len(ids) > limit}
