"""The chat messages of one step: task, the last K (observation, action) pairs, the current
observation, the admissible actions, and the answer-format instruction.

The prompt of a step never holds the whole episode: GiGPO trains on one sample per step, and the
history window K keeps the prompt length bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptTemplate:
    """The wording of a step's prompt; every field is a `str.format` template.

    Fields: `system` (no placeholders; empty: no system message), `task` ({task}), `history_step`
    ({step}, {observation}, {action}), `current` ({step}, {observation}), `action_line` ({number},
    {action}), `instruction` (no placeholders). Headers are plain text.
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


SOKOBAN_TEMPLATE = PromptTemplate(
    system="You are solving a Sokoban puzzle: push every box onto a target. Boxes can be pushed but never pulled.",
    current="Current grid (step {step}):\n{observation}",
)

# Default template of each shipped environment; any other environment gets `PromptTemplate()`.
ENV_TEMPLATES: dict[str, PromptTemplate] = {"sokoban": SOKOBAN_TEMPLATE, "textworld": PromptTemplate()}


def template_for(env_name: str | None) -> PromptTemplate:
    """The default template of an environment name (the generic one for unknown names)."""
    return ENV_TEMPLATES.get(env_name or "", PromptTemplate())


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
        `[{"role": "system", ...}, {"role": "user", ...}]` (no system message if `template.system` is empty).
    """
    if history_length < 0:
        raise ValueError(f"history_length must be >= 0, got {history_length}")
    template = template or PromptTemplate()
    sections = []
    if task:
        sections.append(template.task.format(task=task))
    shown = list(history)[len(history) - history_length :] if history_length else []
    if shown:
        first = step - len(shown)
        steps = [
            template.history_step.format(step=first + k, observation=past_observation, action=past_action)
            for k, (past_observation, past_action) in enumerate(shown)
        ]
        sections.append("\n".join([template.history_header, *steps]))
    sections.append(template.current.format(step=step, observation=observation))
    if admissible_actions:
        lines = [template.action_line.format(number=k, action=a) for k, a in enumerate(admissible_actions, start=1)]
        sections.append("\n".join([template.actions_header, *lines]))
    sections.append(template.instruction)
    user = {"role": "user", "content": "\n\n".join(sections)}
    return [{"role": "system", "content": template.system}, user] if template.system else [user]
