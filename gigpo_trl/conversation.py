"""Conversation mode's token ids: a step's prompt is the previous step's prompt ids, its completion ids as generated,
and the ids the chat template writes for what came back (the next observation's user message, or the tool messages)
up to the next generation prompt. Nothing already shown is tokenized again, so the model reads its own tokens, and
each prompt extends the one before it token for token (the packed update forwards a trajectory's shared tokens once).

The ids of a turn are found as TRL's tool loop finds them (`GRPOTrainer._get_tool_suffix_ids`): a minimal
conversation is rendered with and without the turn, the one without it cut after the token that ends the assistant's
answer, and the difference is the turn's suffix. That holds only for a chat template that renders earlier messages
the same whatever follows them ("prefix-preserving"); `ChatTurns.check` refuses one that does not.

An answer cut by `max_completion_length` has no end-of-turn token: the next prompt closes it with the one the template
ends an assistant turn with (the model did not generate it; it is part of the prompt, not trained on).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from gigpo_trl.dialogue import ContinuedPrompt, Messages

# (messages, add_generation_prompt) -> the template's token ids
Render = Callable[[Messages, bool], list[int]]

_USER_TURN: Messages = [{"role": "user", "content": "dummy"}]


@dataclass(frozen=True)
class ChatTurns:
    """A chat template's turns as token ids.

    Args:
        render: the template's rendering of a conversation (the trainer's tokenizer, its chat template and kwargs).
        end_of_turn: the ids generation stops at (an answer that ends with none of them was cut short).
    """

    render: Render
    end_of_turn: Collection[int]

    def prompt_ids(self, prompt: ContinuedPrompt) -> list[int]:
        """The ids of a continued prompt: the previous prompt and answer, closed if it was cut short, then the turn.

        Raises:
            ValueError: the template does not render the turn after an answer as a suffix (not prefix-preserving).
        """
        closing, suffix = self.turn_ids(prompt.turn)
        previous = prompt.previous
        answer = previous.completion_ids
        closed = [] if answer and answer[-1] in self.end_of_turn else [closing]
        return [*previous.prompt_ids, *answer, *closed, *suffix]

    def turn_ids(self, turn: Messages) -> tuple[int, list[int]]:
        """(the id that ends an assistant answer, the ids the template writes after it for `turn` up to the next
        generation prompt)."""
        if not turn:
            raise ValueError("a conversation's next turn has no message to render (the environment returned none)")
        answered = [*_USER_TURN, _dummy_answer(turn)]
        before = self.render(answered, False)
        ends = [k for k, token in enumerate(before) if token in self.end_of_turn]
        if not ends:
            raise ValueError("the chat template ends an assistant answer with none of the tokens generation stops at "
                             f"({sorted(self.end_of_turn)}): conversation mode cannot tell where an answer ends; "
                             "show a window of history instead (history_length=K)")
        before = before[: ends[-1] + 1]
        after = self.render([*answered, *turn], True)
        if after[: len(before)] != before:
            raise ValueError(
                f"the chat template is not prefix-preserving: it renders an assistant answer differently once a "
                f"{turn[0]['role']!r} message follows it, so a conversation's ids cannot be extended turn by turn. Use a "
                "prefix-preserving template (TRL ships training templates for the common families: "
                "trl.chat_template_utils.get_training_chat_template) or show a window of history (history_length=K)")
        return before[-1], after[len(before):]

    def check(self, turn_role: str) -> None:
        """Refuse, before any rollout, a template whose turns of `turn_role` ('user' or 'tool') cannot be appended."""
        self.turn_ids(_probe_turn(turn_role))


def _dummy_answer(turn: Messages) -> dict:
    """The assistant message a turn follows: one that calls the turn's tool for tool messages (some templates derive
    the tool response's header from the call), else a plain answer."""
    if turn[0].get("role") == "tool":
        call = {"type": "function", "function": {"name": turn[0].get("name", "dummy"), "arguments": {}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": "dummy"}


def _probe_turn(role: str) -> Messages:
    if role == "tool":
        return [{"role": "tool", "name": "dummy", "content": "dummy"}]
    return [{"role": role, "content": "dummy"}]
