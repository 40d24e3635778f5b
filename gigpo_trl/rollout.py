"""The multi-turn rollout: G tasks x N copies played in lock-step turns; every step is one sample.

Each turn makes ONE batched generation over all live environments, then steps them all in
parallel. Environments that finished stop generating. Across processes, every process makes the
same number of generation calls (with a dummy prompt where it has no live environment, or as many
prompts as the busiest process when the backend slices results by rank), so collective backends
(ZeRO-3, FSDP, vLLM server) never hang on uneven episode lengths.

How a step's prompt is written and its answer read is the `Dialogue`'s (`gigpo_trl.dialogue`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tqdm.auto import tqdm

from gigpo_trl.dialogue import (
    DUMMY_PROMPT, Completion, ContinuedPrompt, Dialogue, Exchange, Messages, Prompt, PromptTooLong, TextDialogue, Tools,
    prompt_messages, without_oldest_exchanges,
)
from gigpo_trl.env_pool import INFO_ENV_ERROR, EnvPool
from gigpo_trl.envs import INFO_ANCHOR_KIND, INFO_TASK_TYPE, INFO_WON, EnvOutput, info_metrics
from gigpo_trl.loops import EpisodeLoops, episode_loops
from gigpo_trl.observations import readable
from gigpo_trl.tasks import Task

# A turn's generation: (prompts, the tools each offers or None) -> one `Completion` (or `PromptTooLong`) per prompt.
# The trainer's is a `gigpo_trl.turns.TurnGenerator`; any callable of this shape plays a rollout (a scripted policy).
GenerateTurn = Callable[[list[Prompt], list[Tools | None]], list[Completion | PromptTooLong]]


@dataclass
class StepColumns:
    """The step samples of a rollout as columns: entry k of every column is sample k, in rollout order (turn by
    turn, environment by environment). Each sample is one (state, action) step of one trajectory, one training
    sample; every consumer (advantages, update batch, metrics, logs, records) reads these columns."""

    group: list[int] = field(default_factory=list)  # task group (index of the task in the batch)
    trajectory: list[int] = field(default_factory=list)  # environment index in the pool
    step: list[int] = field(default_factory=list)  # t, 0-based
    anchor: list[Hashable] = field(default_factory=list)  # state the action was taken in
    observation: list[str] = field(default_factory=list)  # its text, each image as "[image WxH]"
    # The chat messages the answer was generated from (in conversation mode, the conversation so far, the answers as
    # their text: the completion's prompt ids are what the model read)
    prompt: list[Messages] = field(default_factory=list)
    completion: list[Completion] = field(default_factory=list)
    action: list[str] = field(default_factory=list)  # what the environment received
    valid: list[bool] = field(default_factory=list)  # the answer followed the <action> format
    # how the lenient parser found the action among the admissible ones ("exact", "case", "number", "contained"); None
    # where it did not (the answer's text was sent as written)
    action_match: list[str | None] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)  # r_t, the reward received after the action

    def __len__(self) -> int:
        return len(self.group)

    def append(self, **sample: Any) -> None:
        """Add one sample: a value for every column, by name."""
        if sample.keys() != self.__dataclass_fields__.keys():
            raise ValueError(f"a step sample needs exactly the columns {sorted(self.__dataclass_fields__)}")
        for name, value in sample.items():
            getattr(self, name).append(value)

    def rows_of(self, trajectory: int) -> list[int]:
        """The samples of one trajectory, in step order."""
        return [row for row, t in enumerate(self.trajectory) if t == trajectory]


@dataclass
class Episode:
    """What happened to one trajectory."""

    group: int
    trajectory: int
    seed: int | None
    options: dict[str, Any] | None = None  # the task's reset options
    task_type: str | None = None  # the environment's info["task_type"] at reset, if it gives one
    length: int = 0
    episode_return: float = 0.0
    # The latest info["won"] of the episode: None while the environment has not said whether the task is solved (an
    # environment without `won` never does), so that "unknown" is never counted as "lost".
    won: bool | None = None
    done: bool = False  # the episode has ended (on its own or cut off)
    truncated: bool = False  # cut off (max_env_steps, the environment's own limit, or an environment failure)
    env_error: str | None = None  # why the environment failed, if it did
    # Why it ended before a step's generation, if it did: that step's prompt would not fit the model's context
    # (`PromptTooLong`; the episode is truncated there).
    context_overflow: str | None = None
    # The latest value of each of the environment's own metrics (info["metrics"], `gigpo_trl.envs.info_metrics`).
    metrics: dict[str, float] = field(default_factory=dict)
    final_anchor: Hashable = None  # the anchor of the state the last step led to (of the start state before a step)
    anchor_kind: str = "state"  # what the environment said its anchors are on reset (info["anchor_kind"])


@dataclass
class Rollout:
    """The step samples of a rollout, what happened to each trajectory, and the rollout's costs."""

    steps: StepColumns = field(default_factory=StepColumns)
    episodes: list[Episode] = field(default_factory=list)
    generate_calls: int = 0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    env_seconds: float = 0.0

    @property
    def prefill_tokens(self) -> int | None:
        """The prompt tokens the model forwarded to generate the step samples' answers (`Completion.prefill_tokens`;
        HF generation: fewer than their prompts' tokens where the prefix cache held some); None where the generator
        does not say for some answer (vLLM)."""
        counts = [completion.prefill_tokens for completion in self.steps.completion]
        return None if None in counts else sum(counts)

    @property
    def num_groups(self) -> int:
        """The task groups played (groups are numbered 0, 1, ... in the order of the tasks)."""
        return max((episode.group for episode in self.episodes), default=-1) + 1

    def loops(self) -> list[EpisodeLoops | None]:
        """The loop figures of every episode (`gigpo_trl.loops`) from the anchors of its states s_0, ..., s_T: those
        of its steps, then its final anchor. None for an episode whose anchors are not states (anchor_kind
        "history")."""
        anchors: dict[int, list[Hashable]] = defaultdict(list)
        for trajectory, anchor in zip(self.steps.trajectory, self.steps.anchor):
            anchors[trajectory].append(anchor)
        return [episode_loops([*anchors[e.trajectory], e.final_anchor], terminated=not e.truncated,
                              failed=e.env_error is not None) if e.anchor_kind == "state" else None
                for e in self.episodes]


def concatenate_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """Rollouts played one after the other, as one (the rounds of dynamic sampling): the groups and trajectories of each
    part are numbered on after those of the parts before it; step samples and episodes keep the part order, costs add up."""
    merged = Rollout()
    groups = trajectories = 0
    for part in parts:
        offsets = {"group": groups, "trajectory": trajectories}
        for column in fields(StepColumns):
            values = getattr(part.steps, column.name)
            if column.name in offsets:
                values = [value + offsets[column.name] for value in values]
            getattr(merged.steps, column.name).extend(values)
        merged.episodes += [replace(episode, group=episode.group + groups, trajectory=episode.trajectory + trajectories)
                            for episode in part.episodes]
        merged.generate_calls += part.generate_calls
        merged.generated_tokens += part.generated_tokens
        merged.generation_seconds += part.generation_seconds
        merged.env_seconds += part.env_seconds
        groups, trajectories = groups + part.num_groups, trajectories + len(part.episodes)
    return merged


def collect_rollout(
    pool: EnvPool,
    tasks: Sequence[Task],
    generate: GenerateTurn,
    *,
    max_env_steps: int,
    dialogue: Dialogue = TextDialogue(),
    max_across_processes: Callable[[int], int] = lambda n: n,
    equal_prompt_counts: bool = False,
    show_progress: bool = True,
) -> Rollout:
    """Play `pool.group_size` copies of each task until every episode ends or `max_env_steps`.

    Args:
        pool: the environments, `len(tasks) * group_size` of them.
        tasks: one (seed, options) per group; or none, for a process that sits a round out (dynamic sampling): it
            plays nothing and only makes the generation calls of the turns the other processes play.
        generate: turns chat prompts (and the tools each offers) into one `Completion` each.
        max_env_steps: turns after which live episodes are cut off (truncated).
        dialogue: how prompts are written and answers read (default: `TextDialogue()`).
        max_across_processes: the maximum of an int over all processes (identity on one process);
            a turn happens while any process has a live environment.
        equal_prompt_counts: pad every generation call to the busiest process's prompt count
            (vLLM server mode and tensor-parallel colocate slice results by rank).
        show_progress: a progress bar over turns.

    Returns:
        The step samples (as columns), one `Episode` per environment, and timing and token counts.
    """
    rollout = Rollout()
    started = time.perf_counter()
    current = pool.reset(tasks) if tasks else []
    start = list(current)
    rollout.env_seconds += time.perf_counter() - started
    episodes = [
        Episode(pool.group_of(i), i, tasks[pool.group_of(i)].seed, tasks[pool.group_of(i)].options,
                current[i].info.get(INFO_TASK_TYPE), final_anchor=current[i].anchor,
                anchor_kind=current[i].info.get(INFO_ANCHOR_KIND, "state"))
        for i in range(len(current))
    ]
    for episode, output in zip(episodes, current):
        _end_if_done(episode, output, pool.name)
    histories: list[list[Exchange]] = [[] for _ in current]
    shown: list[Messages] = [[] for _ in current]  # the messages of each episode's latest prompt

    turns = tqdm(range(max_env_steps), desc="rollout turns", leave=False, disable=not show_progress)
    for t in turns:
        live = [i for i, episode in enumerate(episodes) if not episode.done]
        busiest = max_across_processes(len(live))
        if busiest == 0:
            break
        turns.set_postfix(live=len(live))
        prompts = [_prompt(dialogue, start[i], current[i], histories[i], shown[i], t) for i in live]
        tools = [dialogue.tools(start[i]) for i in live]
        num_prompts = busiest if equal_prompt_counts else max(1, len(live))
        tools += [None] * (num_prompts - len(prompts))
        prompts += [DUMMY_PROMPT] * (num_prompts - len(prompts))

        started = time.perf_counter()
        answers = generate(prompts, tools)[: len(live)]
        rollout.generation_seconds += time.perf_counter() - started
        rollout.generate_calls += 1
        for i, answer in zip(live, answers):
            if isinstance(answer, PromptTooLong):  # no room left in the context: the episode ends here
                episodes[i].done = episodes[i].truncated = True
                episodes[i].context_overflow = (f"the prompt of step {t} has {answer.tokens} tokens, more than the "
                                                f"{answer.limit} the model's context leaves it")
        playing = [(i, prompt, answer) for i, prompt, answer in zip(live, prompts, answers)
                   if isinstance(answer, Completion)]
        rollout.generated_tokens += sum(len(completion.completion_ids) for _, _, completion in playing)

        parsed = {i: dialogue.read(completion, start[i], current[i]) for i, _, completion in playing}
        started = time.perf_counter()
        results = pool.step({i: p.action for i, p in parsed.items()}) if parsed else {}
        rollout.env_seconds += time.perf_counter() - started

        for i, prompt, completion in playing:
            result, episode = results[i], episodes[i]
            # what the model was shown: less the exchanges the generator dropped for the prompt to fit the context
            shown[i] = without_oldest_exchanges(prompt_messages(prompt), completion.dropped_exchanges)
            rollout.steps.append(
                group=episode.group, trajectory=i, step=t, anchor=current[i].anchor,
                observation=readable(current[i].observation, current[i].images), prompt=shown[i], completion=completion,
                action=parsed[i].action, valid=parsed[i].valid, action_match=parsed[i].match, reward=result.reward,
            )
            histories[i].append(Exchange(current[i], parsed[i], result, completion))
            episode.length += 1
            episode.episode_return += result.reward
            episode.final_anchor = result.anchor
            current[i] = result
            _end_if_done(episode, result, pool.name)
    turns.close()

    for episode in episodes:
        if not episode.done:  # cut off by max_env_steps: a failure with the reward it collected
            episode.done = episode.truncated = True
    rollout.episodes = episodes
    return rollout


def _prompt(dialogue: Dialogue, start: EnvOutput, current: EnvOutput, history: list[Exchange], shown: Messages,
            step: int) -> Prompt:
    """A step's prompt: written from messages with a window of history; in conversation mode (`history_length`
    None) the first one so, then each the continuation of the previous prompt (its messages `shown`) by its answer
    and what came back."""
    if dialogue.history_length is not None or not history:
        return dialogue.prompt(start, current, history, step)
    past = history[-1]
    turn = dialogue.turn(past, step)
    return ContinuedPrompt(past.completion, turn, [*shown, dialogue.reply(past), *turn])


def _end_if_done(episode: Episode, output: EnvOutput, env_name: str) -> None:
    try:
        episode.metrics.update(info_metrics(output.info))
    except ValueError as exc:
        raise ValueError(f"environment {env_name!r}, task seed {episode.seed}: {exc}") from None
    if output.info.get(INFO_WON) is not None:  # an output that does not say (a failure's) keeps what the last one said
        episode.won = bool(output.info[INFO_WON])
    if output.done:
        episode.done = True
        episode.truncated = output.truncated and not output.terminated
        episode.env_error = output.info.get(INFO_ENV_ERROR)
