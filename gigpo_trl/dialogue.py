"""How a step is put to the model and its answer read back: the chat messages a step's prompt is, the generated
`Completion`, and the `Dialogue` that writes a step's prompt and turns an answer into the environment's action.

Two dialogues ship: `TextDialogue` for text environments (the prompt of `gigpo_trl.prompts.build_messages`: task,
recent history, observation, admissible actions; the answer read by `gigpo_trl.parsing.parse_action`), and the
tool-calling dialogue of TRL's `environment_factory` classes (`gigpo_trl.trl_environment.ToolCallDialogue`). The turn
loop (`gigpo_trl.rollout`) only speaks to the protocol.

A dialogue shows either a window of history (`history_length` K: each step's prompt is written anew from messages,
with the last K exchanges) or the whole conversation (`history_length` None): the first step's prompt is written from
messages, and every later one is a `ContinuedPrompt`, the previous step's prompt and completion ids as generated
followed by the messages of what came back (`Dialogue.turn`), which the generator renders as the next turn
(`gigpo_trl.conversation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_TASK, EnvOutput
from gigpo_trl.observations import content_blocks
from gigpo_trl.parsing import ParsedAction, parse_action
from gigpo_trl.prompts import PromptTemplate, build_messages, continued_turn, history_window

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]]  # JSON schemas of the tools a prompt offers, as `apply_chat_template(tools=...)` takes them
# Sent by a process that has no live environment in a turn where others still play.
DUMMY_PROMPT: Messages = [{"role": "user", "content": "."}]


@dataclass
class Completion:
    """One generated answer: token ids of the rendered prompt and of the answer, its text, and the
    sampling log-probs of the answer tokens when the backend returns them (vLLM). Built whole by the turn
    (`gigpo_trl.turns`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    # Conversation mode's context management (`context_overflow` 'drop_oldest'): the oldest exchanges dropped from
    # the conversation for this answer's prompt to fit the model's context (`without_oldest_exchanges`).
    dropped_exchanges: int = 0
    # A prompt with images: the processor's image tensors of this prompt alone (`pixel_values` and the keys that
    # describe them, such as `image_sizes` or `image_grid_thw`, one entry per image on their first dimension, or per
    # patch with `image_grid_thw`), with `num_images`: what the answer was generated from, and what every forward
    # pass of the update reads this row with (`gigpo_trl.batch.image_batch`).
    image_inputs: dict[str, Any] | None = None
    # The prompt tokens the model forwarded to generate this answer, where the generator counts them (HF generation:
    # fewer than the prompt's where the prefix cache held some; a prefix shared by a turn's prompts is counted for the
    # first of them); None where it does not (vLLM).
    prefill_tokens: int | None = None


@dataclass(frozen=True)
class PromptTooLong:
    """What a generator answers for a prompt it did not generate from: its `tokens` exceed the `limit` the model's
    context leaves a prompt (the context less `max_completion_length`). The turn loop ends its episode, truncated."""

    tokens: int
    limit: int


@dataclass(frozen=True)
class ContinuedPrompt:
    """A step's prompt in conversation mode: the previous step's prompt ids and completion ids, exactly as they were
    generated from and generated, then `turn`, the messages of what came back (the next observation, or the tool
    messages), to be rendered as the next turn of the chat. `messages` is the whole conversation as chat messages (the
    answers as their decoded text), for logs: the ids, not a rendering of these messages, are what the model reads."""

    previous: Completion
    turn: Messages
    messages: Messages


Prompt = Messages | ContinuedPrompt


def prompt_messages(prompt: Prompt) -> Messages:
    """A prompt's chat messages (a continued prompt's: the whole conversation so far)."""
    return prompt.messages if isinstance(prompt, ContinuedPrompt) else prompt

def without_oldest_exchanges(messages: Messages, dropped: int) -> Messages:
    """A conversation less its `dropped` oldest exchanges: an exchange is an assistant message and the messages that
    follow it up to the next one (what came back: the next observation, or the tool messages). The messages before
    the first answer (the system message, the task and the first observation) are kept.

    Raises:
        ValueError: `dropped` is negative, or would drop the conversation's latest exchange.
    """
    answers = [k for k, message in enumerate(messages) if message.get("role") == "assistant"]
    if not 0 <= dropped < max(len(answers), 1):
        raise ValueError(f"cannot drop {dropped} of the {len(answers)} exchanges of a conversation: its latest one "
                         "(the answer before the prompt and what came back) is kept")
    if dropped == 0:
        return list(messages)
    return [*messages[: answers[0]], *messages[answers[dropped]:]]


def exchange_count(messages: Messages) -> int:
    """The exchanges of a conversation (`without_oldest_exchanges`): its assistant messages."""
    return sum(message.get("role") == "assistant" for message in messages)


@dataclass(frozen=True)
class Exchange:
    """One past step of a trajectory, as later prompts may show it."""

    state: EnvOutput  # what the agent saw: the environment's output the answer was given in
    action: ParsedAction  # what its answer became
    result: EnvOutput  # what the environment returned
    completion: Completion  # the answer as generated


class Dialogue(Protocol):
    """How a step's prompt is written and how an answer becomes the environment's action. `start` is what the
    environment's reset returned, `current` the state the action is taken in, `history` the episode's past steps.
    `history_length` is the number of past exchanges a prompt shows, None for the whole conversation (every prompt
    after the first continues the one before it: `reply` and `turn` write what is appended)."""

    history_length: int | None

    def prompt(self, start: EnvOutput, current: EnvOutput, history: Sequence[Exchange], step: int) -> Messages: ...

    def reply(self, past: Exchange) -> dict[str, Any]:
        """The assistant message a past answer is shown as."""
        ...

    def turn(self, past: Exchange, step: int) -> Messages:
        """The messages of what came back after a past answer, shown before the answer of `step`."""
        ...

    def tools(self, start: EnvOutput) -> Tools | None: ...

    def read(self, completion: Completion, start: EnvOutput, current: EnvOutput) -> ParsedAction: ...

    @property
    def answer_format(self) -> str:
        """What a well-formed answer is, as the run report says it ("exactly one <action> block")."""
        ...


NO_IMAGES_IN_CONVERSATIONS = (
    "conversation mode (history_length 'conversation') does not take image observations yet (each prompt extends the "
    "previous one's token ids, and an image's tokens come from the processor with its pixels): show a window of "
    "history instead (history_length K, 0 for none)")


@dataclass(frozen=True)
class TextDialogue:
    """Text environments: `build_messages` prompts (task, the last `history_length` (observation, action) pairs, the
    observation, the admissible actions, the answer format) and answers read by `parse_action`; no tools. In
    conversation mode (`history_length` None) the first prompt is `build_messages`'s without history, each answer is
    shown as the assistant's message and each later observation as a user message that carries what is new
    (`continued_turn`): the observation, and the admissible actions only where they changed; the task, the answer format
    and the demonstration stay in the first turn.

    Observations with images (`gigpo_trl.observations`): the step's user message is content blocks, each image where
    the template shows its observation (the history's shown observations, then the current one)."""

    template: PromptTemplate | None = None
    history_length: int | None = 2

    def prompt(self, start: EnvOutput, current: EnvOutput, history: Sequence[Exchange], step: int) -> Messages:
        history_length = self.history_length or 0
        messages = build_messages(
            current.observation,
            step=step,
            task=current.info.get(INFO_TASK),
            history=[(past.state.observation, past.action.action) for past in history],
            admissible_actions=current.info.get(INFO_ADMISSIBLE_ACTIONS),
            history_length=history_length,
            template=self.template,
        )
        shown = history_window(history, history_length)
        images = (*(image for past in shown for image in past.state.images), *current.images)
        if images and self.history_length is None:
            raise ValueError(NO_IMAGES_IN_CONVERSATIONS)
        return [*messages[:-1], {**messages[-1], "content": content_blocks(messages[-1]["content"], images)}]

    def reply(self, past: Exchange) -> dict[str, Any]:
        return {"role": "assistant", "content": past.completion.text}

    def turn(self, past: Exchange, step: int) -> Messages:
        if past.result.images:
            raise ValueError(NO_IMAGES_IN_CONVERSATIONS)
        actions = past.result.info.get(INFO_ADMISSIBLE_ACTIONS)
        changed = None if actions == past.state.info.get(INFO_ADMISSIBLE_ACTIONS) else actions
        return [{"role": "user", "content": continued_turn(past.result.observation, step=step,
                                                           admissible_actions=changed, template=self.template)}]

    def tools(self, start: EnvOutput) -> None:
        return None

    def read(self, completion: Completion, start: EnvOutput, current: EnvOutput) -> ParsedAction:
        template = self.template or PromptTemplate()
        return parse_action(completion.text, current.info.get(INFO_ADMISSIBLE_ACTIONS), template.action_tags,
                            template.max_action_chars)

    @property
    def answer_format(self) -> str:
        tags = (self.template or PromptTemplate()).action_tags
        return f"exactly one {' or '.join(f'<{tag}>' for tag in tags)} block"
