"""Trainers whose answers come from a script, plugged in as the backend of their turns: real generation still runs
every turn (so the lock-step and batching paths are exercised), but the answer text is replaced by a fixed rule,
which makes the trajectories known in advance."""

from __future__ import annotations

import json
import random
import re

from gigpo_trl.dialogue import prompt_messages
from gigpo_trl.trainer import GiGPOTrainer
from gigpo_trl.turns import GeneratedTokens, TurnBatch


def corridor_answer(prompt_text: str, position: int) -> str:
    """The rule, on Corridor (tests/toy_envs.py): walk right, except
    - at step 0, the copy at an odd position of the batch answers "left" (it stays in cell 0);
    - at step 1 in cell 1, the answer breaks the format ("I go right": invalid, but mapped onto "right")."""
    step = int(re.search(r"Current observation \(step (\d+)\)", prompt_text).group(1))
    cell = int(re.findall(r"You are in cell (\d+)", prompt_text)[-1])
    if step == 0 and position % 2:
        return "<action>left</action>"
    if step == 1 and cell == 1:
        return "I go right"
    return "<think>keep going</think><action>right</action>"


def numbered_choice_answer(prompt_text: str, position: int) -> str:
    """Answer the number of one of the listed admissible actions, drawn from the prompt text and the
    batch position (copies of a task diverge; the same prompt at the same position repeats its answer)."""
    count = len(re.findall(r"^\d+\. ", prompt_text, flags=re.MULTILINE))
    return f"<action>{random.Random(f'{prompt_text}|{position}').randint(1, count)}</action>" if count else "look"


class ScriptedBackend:
    """A turn backend (`gigpo_trl.turns.Backend`) whose answers come from a script: the trainer's real backend still
    generates every turn, in lock-step, then each answer is replaced by `answer(prompt, tools, position)` tokenized with
    the EOS token (the prompt as the rollout wrote it, the tools it offers, its position in the batch)."""

    def __init__(self, real, answer, tokenizer):
        self.real, self.answer, self.tokenizer = real, answer, tokenizer

    def __call__(self, batch: TurnBatch) -> GeneratedTokens:
        generated = self.real(batch)
        eos = self.tokenizer.eos_token_id
        answers = [self.answer(prompt, tools, position)
                   for position, (prompt, tools) in enumerate(zip(batch.prompts, batch.tools))]
        ids = [self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos] for answer in answers]
        return GeneratedTokens(ids, None, generated.prefill_tokens)


def text_answer(corridor=corridor_answer):
    """Corridor tasks (their observation: "You are in cell k ...") follow `corridor`; any other environment gets
    `numbered_choice_answer` (the rooms task also speaks of a corridor)."""

    def answer(prompt, tools, position: int) -> str:
        text = prompt_messages(prompt)[-1]["content"]
        return corridor(text, position) if "You are in cell" in text else numbered_choice_answer(text, position)

    return answer


def scripted(trainer: GiGPOTrainer, answer) -> GiGPOTrainer:
    """`trainer` with its turns answered by `answer(prompt, tools, position)` (`ScriptedBackend`), the async
    producer's (`async_staleness`) with its own tokenizer."""
    trainer.turns.backend = ScriptedBackend(trainer.turns.backend, answer, trainer.processing_class)
    trainer.wrap_producer_backend = lambda backend, tokenizer: ScriptedBackend(backend, answer, tokenizer)
    return trainer


def scripted_trainer(*args, corridor=corridor_answer, **kwargs) -> GiGPOTrainer:
    """A `GiGPOTrainer` on text environments whose answers follow `text_answer(corridor)`."""
    return scripted(GiGPOTrainer(*args, **kwargs), text_answer(corridor))


def tool_call(name: str, **arguments) -> str:
    """A tool call as Qwen2.5's chat template writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def counter_answer(messages: list[dict], position: int) -> str:
    """IncrementEnv (tests/toy_tool_envs.py): add 1 until the target, then answer without a tool call; the copy at an
    odd position of the batch first adds 2 (and may overshoot)."""
    target = int(re.search(r"Bring the counter to (\d+)", messages[0]["content"]).group(1))
    results = [m["content"] for m in messages if m["role"] == "tool"]
    counter = int(re.search(r"Counter is (\d+)", results[-1]).group(1)) if results else 0
    if counter >= target:
        return "Done."
    return tool_call("increment", step=2 if position % 2 and counter == 0 else 1)


def tool_answer(answer=counter_answer):
    """Tool-calling replies from `answer(messages, position)` where the prompt offers tools, "." otherwise (a dummy
    prompt)."""

    def reply(prompt, tools, position: int) -> str:
        return answer(prompt_messages(prompt), position) if tools else "."

    return reply


def scripted_tool_trainer(*args, answer=counter_answer, **kwargs) -> GiGPOTrainer:
    """A `GiGPOTrainer` on TRL environment classes whose replies follow `tool_answer(answer)`."""
    return scripted(GiGPOTrainer(*args, **kwargs), tool_answer(answer))
