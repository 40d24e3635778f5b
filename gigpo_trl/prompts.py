"""The chat messages of one step: task, the last K (observation, action) pairs, the current
observation, the admissible actions, and the answer-format instruction.

The prompt of a step never holds the whole episode: GiGPO trains on one sample per step, and the
history window K keeps the prompt length bounded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

from gigpo_trl.envs import env_prompt_template, prompt_template_envs
from gigpo_trl.parsing import DEFAULT_ACTION_TAGS, MAX_ACTION_CHARS

T = TypeVar("T")


@dataclass(frozen=True)
class PromptTemplate:
    """The wording of a step's prompt; every field is a `str.format` template.

    Fields: `system` (no placeholders; empty: no system message), `task` ({task}), `history_step`
    ({step}, {observation}, {action}), `current` ({step}, {observation}), `action_line` ({number},
    {action}), `instruction` (no placeholders), `examples`: (user text, assistant answer) pairs shown
    before the step as a demonstration of the answer format (small models follow a format they were
    shown far more often than one they were told). Headers are plain text. `action_tags`: the tags an
    answer puts its action in (no template: `gigpo_trl.parsing.parse_action` reads them), one per kind of
    action, e.g. `("search", "answer")`. `max_action_chars`: the longest action text sent to the environment
    (a rambling answer is cut there; WebShop's searches of a whole instruction need more than the default 100).
    """

    system: str = (
        "You are an agent in a text-based environment. Read the observation, reason briefly, then act."
    )
    task: str = "Your task: {task}"
    history_header: str = "Your most recent steps:"
    history_step: str = "[Step {step}] Observation: {observation}\n[Step {step}] Your action: {action}"
    current: str = "Current observation (step {step}):\n{observation}"
    actions_header: str = "Admissible actions:"
    action_line: str = "{number}. {action}"
    instruction: str = (
        "First think step by step inside <think> </think>. Then give exactly one action inside "
        "<action> </action>, e.g. <action>look</action>. You may also answer with the number of an admissible action."
    )
    examples: tuple[tuple[str, str], ...] = ()
    action_tags: tuple[str, ...] = DEFAULT_ACTION_TAGS
    max_action_chars: int = MAX_ACTION_CHARS


_NUMBERED_INSTRUCTION = "Answer with <action>N</action>, where N is the number of one admissible action."

# For small models: answer with a number, shown once in a demonstration exchange.
NUMBERED_ONE_SHOT_TEMPLATE = PromptTemplate(
    instruction=_NUMBERED_INSTRUCTION,
    examples=(
        (
            "Current observation (step 0):\nYou are in a hall. There is a door to the north.\n\n"
            f"Admissible actions:\n1. go north\n2. look\n\n{_NUMBERED_INSTRUCTION}",
            "<action>1</action>",
        ),
    ),
)

_ACTION_INSTRUCTION = "Answer with <action>...</action> holding one admissible action, written exactly as listed."

# For small models: no system message, answer with the action's text, shown once in a demonstration exchange
# (models of 135M parameters copy a listed command far more readily than they map it to its number).
ACTION_ONE_SHOT_TEMPLATE = PromptTemplate(
    system="",
    instruction=_ACTION_INSTRUCTION,
    examples=(
        (
            "Current observation (step 0):\nYou are in a hall. There is a door to the north.\n\n"
            f"Admissible actions:\n1. look\n2. go north\n\n{_ACTION_INSTRUCTION}",
            "<action>go north</action>",
        ),
    ),
)

# Short prompts for tiny models: no system message, answer with a number.
NUMBERED_TEMPLATE = PromptTemplate(system="", instruction=_NUMBERED_INSTRUCTION)

# Templates by name, for `GiGPOConfig.prompt_template`. An environment's own wording is registered with it
# (`register_env(..., prompt_template=...)`) and named by the environment's name (`template_for`).
TEMPLATES: dict[str, PromptTemplate] = {
    "default": PromptTemplate(),
    "numbered": NUMBERED_TEMPLATE,
    "numbered_one_shot": NUMBERED_ONE_SHOT_TEMPLATE,
    "action_one_shot": ACTION_ONE_SHOT_TEMPLATE,
}


def template_for(env_name: str | None) -> PromptTemplate:
    """The default template of an environment name: the one registered with it, else the generic one."""
    return env_prompt_template(env_name or "") or PromptTemplate()


def load_template(name_or_path: str) -> PromptTemplate:
    """A template by name (`TEMPLATES`, or an environment's name for its registered template) or from a JSON file of
    `PromptTemplate` fields (the others keep their defaults; `examples` is a list of [user, assistant] pairs,
    `action_tags` a list of tag names)."""
    if name_or_path in TEMPLATES:
        return TEMPLATES[name_or_path]
    if name_or_path in prompt_template_envs():
        return template_for(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"prompt template {name_or_path!r} is neither a template name {sorted(TEMPLATES)}, an "
                         f"environment's {prompt_template_envs()}, nor a JSON file")
    values = json.loads(path.read_text())
    unknown = set(values) - {f.name for f in fields(PromptTemplate)}
    if unknown:
        raise ValueError(f"{path}: unknown prompt template fields {sorted(unknown)}")
    if "examples" in values:
        values["examples"] = tuple((str(user), str(answer)) for user, answer in values["examples"])
    if "action_tags" in values:
        values["action_tags"] = tuple(values["action_tags"])
    return PromptTemplate(**values)


def history_window(history: Sequence[T], length: int | None) -> list[T]:
    """The last `length` entries of an episode's history, the ones a prompt shows (all of a shorter history; none for 0
    or None)."""
    return list(history)[max(len(history) - length, 0):] if length else []


def build_messages(
    observation: str,
    *,
    step: int = 0,
    task: str | None = None,
    history: Sequence[tuple[str, str]] = (),
    admissible_actions: Sequence[str] | None = None,
    history_length: int = 2,
    template: PromptTemplate | None = None,
) -> list[dict[str, str]]:
    """Chat messages for the action at `step`.

    Args:
        observation: the current observation.
        step: the 0-based step index of the action to choose.
        task: the goal text (`info["task"]`), if the environment gives one.
        history: all previous (observation, action) pairs of the episode, oldest first; only the
            last `history_length` are shown.
        admissible_actions: shown as a numbered list (numbers start at 1, as `parse_action` expects).
        history_length: K, the number of past steps in the prompt (0: none).
        template: the wording; default `PromptTemplate()`.

    Returns:
        `[{"role": "system", ...}, (the template's example exchanges,) {"role": "user", ...}]` (no system
        message if `template.system` is empty).
    """
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    template = template or PromptTemplate()
    sections = []
    if task:
        sections.append(template.task.format(task=task))
    shown = history_window(history, history_length)
    if shown:
        first = step - len(shown)
        steps = [
            template.history_step.format(step=first + k, observation=past_observation, action=past_action)
            for k, (past_observation, past_action) in enumerate(shown)
        ]
        sections.append("\n".join([template.history_header, *steps]))
    if observation != task:  # an environment whose first observation is its task (a question) shows it once
        sections.append(template.current.format(step=step, observation=observation))
    if admissible_actions:
        sections.append(_actions_section(admissible_actions, template))
    sections.append(template.instruction)
    demonstration = []
    for example_user, example_answer in template.examples:
        demonstration += [{"role": "user", "content": example_user}, {"role": "assistant", "content": example_answer}]
    system = [{"role": "system", "content": template.system}] if template.system else []
    return [*system, *demonstration, {"role": "user", "content": "\n\n".join(section for section in sections if section)}]


def continued_turn(observation: str, *, step: int, admissible_actions: Sequence[str] | None = None,
                   template: PromptTemplate | None = None) -> str:
    """The user message of a conversation's later turn (conversation mode): the observation in the template's wording,
    and the admissible actions where they are given (the caller gives them only where they changed since the turn
    before). The task, the answer format and the demonstration were in the conversation's first turn."""
    template = template or PromptTemplate()
    sections = [template.current.format(step=step, observation=observation)]
    if admissible_actions:
        sections.append(_actions_section(admissible_actions, template))
    return "\n\n".join(sections)


def _actions_section(admissible_actions: Sequence[str], template: PromptTemplate) -> str:
    """The admissible actions as a numbered list (numbers start at 1, as `parse_action` expects)."""
    lines = [template.action_line.format(number=k, action=a) for k, a in enumerate(admissible_actions, start=1)]
    return "\n".join([template.actions_header, *lines])
