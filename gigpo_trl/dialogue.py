"""How a step is put to the model and its answer read back: the chat messages a step's prompt is, the generated
`Completion`, and the `Dialogue` that writes a step's prompt and turns an answer into the environment's action.

Two dialogues ship: `TextDialogue` for text environments (the prompt of `gigpo_trl.prompts.build_messages`: task,
recent history, observation, admissible actions; the answer read by `gigpo_trl.parsing.parse_action`), and the
tool-calling dialogue of TRL's `environment_factory` classes (`gigpo_trl.trl_environment.ToolCallDialogue`). The turn
loop (`gigpo_trl.rollout`) only speaks to the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_TASK, EnvOutput
from gigpo_trl.parsing import ParsedAction, parse_action
from gigpo_trl.prompts import PromptTemplate, build_messages

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]]  # JSON schemas of the tools a prompt offers, as `apply_chat_template(tools=...)` takes them
# Sent by a process that has no live environment in a turn where others still play.
DUMMY_PROMPT: Messages = [{"role": "user", "content": "."}]


@dataclass
class Completion:
    """One generated answer: token ids of the rendered prompt and of the answer, its text, and the
    sampling log-probs of the answer tokens when the backend returns them (vLLM)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float] | None = None


# (chat prompts, the tools each offers or None) -> one `Completion` per prompt
TurnGenerator = Callable[[list[Messages], list[Tools | None]], list[Completion]]


@dataclass(frozen=True)
class Exchange:
    """One past step of a trajectory, as later prompts may show it."""

    observation: str  # what the agent saw
    action: ParsedAction  # what its answer became
    result: EnvOutput  # what the environment returned


class Dialogue(Protocol):
    """How a step's prompt is written and how an answer becomes the environment's action. `start` is what the
    environment's reset returned, `current` the state the action is taken in, `history` the episode's past steps."""

    def prompt(self, start: EnvOutput, current: EnvOutput, history: Sequence[Exchange], step: int) -> Messages: ...

    def tools(self, start: EnvOutput) -> Tools | None: ...

    def read(self, completion: Completion, start: EnvOutput, current: EnvOutput) -> ParsedAction: ...


@dataclass(frozen=True)
class TextDialogue:
    """Text environments: `build_messages` prompts (task, the last `history_length` (observation, action) pairs, the
    observation, the admissible actions, the answer format) and answers read by `parse_action`; no tools."""

    template: PromptTemplate | None = None
    history_length: int = 2

    def prompt(self, start: EnvOutput, current: EnvOutput, history: Sequence[Exchange], step: int) -> Messages:
        return build_messages(
            current.observation,
            step=step,
            task=current.info.get(INFO_TASK),
            history=[(past.observation, past.action.action) for past in history],
            admissible_actions=current.info.get(INFO_ADMISSIBLE_ACTIONS),
            history_length=self.history_length,
            template=self.template,
        )

    def tools(self, start: EnvOutput) -> None:
        return None

    def read(self, completion: Completion, start: EnvOutput, current: EnvOutput) -> ParsedAction:
        return parse_action(completion.text, current.info.get(INFO_ADMISSIBLE_ACTIONS))
