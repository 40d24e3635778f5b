"""A GiGPOTrainer whose answers come from a script: real generation still runs every turn (so the
lock-step and batching paths are exercised), but the answer text is replaced by a fixed rule, which
makes the trajectories known in advance."""

from __future__ import annotations

import json
import random
import re

from gigpo_trl.dialogue import Completion, prompt_messages
from gigpo_trl.trainer import GiGPOTrainer


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


class ScriptedTrainer(GiGPOTrainer):
    """Corridor tasks (their observation: "You are in cell k ...") follow `corridor_answer` (or the class's
    `corridor`); any other environment gets `numbered_choice_answer` (the rooms task also speaks of a corridor)."""

    corridor = staticmethod(corridor_answer)

    def _generate_turn(self, prompts, tools):
        generated = super()._generate_turn(prompts, tools)  # the real backend, in lock-step
        eos = self._tokenizer.eos_token_id
        completions = []
        for position, (prompt, real) in enumerate(zip(prompts, generated)):
            text = prompt_messages(prompt)[-1]["content"]
            answer = self.corridor(text, position) if "You are in cell" in text else numbered_choice_answer(text, position)
            ids = self._tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            completions.append(Completion(real.prompt_ids, ids, answer))
        return completions


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


class ScriptedToolTrainer(GiGPOTrainer):
    """Tool-calling replies from `counter_answer` (or the class's `answer`), generated after the real backend ran in
    lock-step, tokenized with the answer's EOS."""

    answer = staticmethod(counter_answer)

    def _generate_turn(self, prompts, tools):
        generated = super()._generate_turn(prompts, tools)
        eos = self._tokenizer.eos_token_id
        completions = []
        for position, (prompt, real) in enumerate(zip(prompts, generated)):
            answer = self.answer(prompt_messages(prompt), position) if tools[position] else "."
            ids = self._tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            completions.append(Completion(real.prompt_ids, ids, answer))
        return completions
