"""TRL's environments, unchanged: classes written for `GRPOTrainer(environment_factory=...)`, trained with step credit.

TRL 1.16's contract, which this module follows:

    class MyEnv:                                 # built with no arguments (a factory or functools.partial otherwise)
        def reset(self, **row) -> str | None:    # every column of the dataset row, `prompt` included
            ...                                  # the str is appended to the row's last user message
        def some_tool(self, x: int) -> str:      # every public method is a tool: typed, with a docstring that
            '''What it does.                     # describes each argument (transformers' get_json_schema)

            Args:
                x: what x is.
            '''
        def get_reward(self) -> float: ...       # optional: the episode's reward (else reward_funcs(environments=...))

TRL plays a whole conversation as one sample. Here **a step is one assistant turn**: the prompt holds the row's
messages (with what `reset` returned) and the last K (assistant, tool) exchanges, rendered with the tools' schemas
by the chat template; the reply is parsed with TRL's `parse_response`; each tool call runs on the environment
instance (an exception becomes the result `{'error': ...}`, as in TRL); the tool messages are the next observation.
The episode ends on a reply without a tool call (TRL's rule), when the instance sets `done = True`, or at
`max_env_steps` (`max_tool_calling_iterations` + 1 turns when that is set).

Rewards per step: with `get_reward()`, a step's reward is the change of `get_reward()` it caused (the first step's
is its value after the step), so an episode's rewards sum to `get_reward()` at its end, TRL's reward. With
`reward_funcs` taking `environments=`, their sum comes as the reward of the episode's last step. Both add up when
both are given.

Success (`info["won"]`, the success rate `env/success_rate`): the instance's `won`, read on reset and after every
step: a bool, or None while unknown. The class defines it, as an attribute its tools and `reset` set or a property
computed from its state (neither is a tool, for TRL or here); a reward function that scores success reads it from the
instances it is given, as the recipe's game and its `won` reward function do. A class without `won` has no success
rate (rather than a rate of 0).

The N copies of a task start alike: Python's and numpy's global random generators are seeded with the task's seed
before `reset` (each environment runs in its own worker process, so the seeding is its own), and the trainer checks
that the copies start in the same state.

Anchors (`anchor`):
- "state" (default): the class's own `anchor` property, or its `gigpo_anchor()` method, when it defines one; else a
  sha1 of the instance's plain-data attributes (`attribute_anchor`): public attributes holding None, bools, numbers,
  strings and lists, tuples, sets and dicts of them. Skipped: private attributes (a leading `_`), clients, callables,
  other objects. What breaks it: a public attribute that changes while the state does not (a counter of calls, a
  timestamp, a random id) splits equal states; state kept in a private attribute or an object (a client, a game
  engine) is invisible and merges different states: then define `anchor`. TRL's `GRPOTrainer` shows every public
  method to the model as a tool, `gigpo_anchor()` too: a class meant for both trainers defines the `anchor`
  property, which TRL skips.
- "tool_calls": the (tool, arguments) calls made so far, for environments whose state cannot be read. Such an anchor
  is a history, which never repeats within an episode: reset says so (`info["anchor_kind"] = "history"`) and the loop
  metrics (`loops/*`, revisits of a state) are left out.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.envs import INFO_ANCHOR, INFO_ANCHOR_KIND, INFO_TASK, INFO_TASK_TYPE, INFO_WON, EnvOutput
from gigpo_trl.dialogue import NO_IMAGES_IN_CONVERSATIONS, Completion, Exchange, Messages, Tools
from gigpo_trl.observations import message_images
from gigpo_trl.options import TOOL_ANCHOR_MODES
from gigpo_trl.parsing import ParsedAction
from gigpo_trl.prompts import history_window

# Methods of an environment class that are not tools: TRL's two, and GiGPO's anchor hook.
NOT_TOOLS = ("reset", "get_reward", "gigpo_anchor")
INFO_PROMPT = "prompt"  # on reset: the row's messages with what `reset` returned appended
INFO_TOOLS = "tools"  # on reset: the JSON schemas of the environment's tools
INFO_TOOL_MESSAGES = "tool_messages"  # on step: the role "tool" messages of the step's calls
EMPTY_PROMPT: Messages = [{"role": "user", "content": ""}]  # TRL's prompt for a row without one
# Templates whose tool calls TRL can parse (`add_response_schema`), as `trl.chat_template_utils` names them.
TOOL_TEMPLATES = ("qwen2_5", "qwen3", "qwen3_5", "llama3_1", "llama3_2", "glm4moe", "gptoss", "gemma4", "nemotron_3",
                  "lfm2_2_5")

EnvironmentFactory = Callable[[], Any]


def tool_names(environment_type: type) -> list[str]:
    """The tools of an environment class, as TRL's `GRPOTrainer` finds them: its public plain functions (inherited
    ones and static methods included; properties and class methods not), sorted by name, less `NOT_TOOLS`."""
    return [name for name, _ in inspect.getmembers(environment_type, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


def tool_schemas(environment: Any) -> Tools:
    """The JSON schemas of an environment's tools (transformers' `get_json_schema` of each bound method).

    Raises:
        ValueError: a tool's docstring or type hints do not describe its arguments, naming the tool.
    """
    from transformers.utils import get_json_schema  # noqa: PLC0415

    schemas = []
    for name in tool_names(type(environment)):
        try:
            schemas.append(get_json_schema(getattr(environment, name)))
        except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"the tool {type(environment).__name__}.{name} cannot be described to the model: {exc}. A tool needs "
                "a docstring with an `Args:` line for every argument and a type hint on every argument (TRL's rule); "
                "a method that is not a tool must be private (a leading `_`)"
            ) from None
    return schemas


def attribute_anchor(environment: Any) -> str:
    """sha1 of the instance's public plain-data attributes (see the module docstring)."""
    state = {name: _plain(value) for name, value in sorted(vars(environment).items())
             if not name.startswith("_") and _is_plain(value)}
    return hashlib.sha1(json.dumps(state, sort_keys=True).encode()).hexdigest()


def check_environment_factory(environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
                              columns: Collection[str]) -> dict[str | None, type]:
    """Build one instance of each environment (as TRL does at start) and check it fits: a `reset`, at least one
    tool, tools the model can be told about, and dataset `columns` that `reset(**row)` accepts.

    Returns:
        The environment class of each name (None: a single factory).

    Raises:
        ValueError: naming the environment and what is wrong.
    """
    factories = _factories(environment_factory)
    if isinstance(environment_factory, Mapping) and "environment" not in columns:
        raise ValueError(f"a dict environment_factory routes each row by its 'environment' column (one of "
                         f"{sorted(factories)}), but the dataset has only {sorted(columns)}")
    classes = {}
    for name, factory in factories.items():
        environment = factory()
        kind = type(environment).__name__
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(f"{kind} (from environment_factory) has no reset(**row) method")
        if not tool_names(type(environment)):
            raise ValueError(f"{kind} has no tools: its public methods (other than {', '.join(NOT_TOOLS)}) are the "
                             "tools the model calls, and it has none")
        tool_schemas(environment)
        row_columns = set(columns) - ({"environment"} if isinstance(environment_factory, Mapping) else set())
        _check_reset_arguments(environment.reset, row_columns, kind)
        classes[name] = type(environment)
    return classes


def checked_trainer_arguments(environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
                              reward_funcs: Any, train_dataset: Any, eval_dataset: Any, tasks_per_rollout: int,
                              max_steps: int) -> tuple[Any, list[Callable[..., Any]]]:
    """`GiGPOTrainer`'s arguments that come with an `environment_factory`, checked as TRL checks them: the training
    rows (TRL's rows of empty prompts when there is no dataset, which needs `max_steps > 0`) and the reward
    functions (callables; TRL's reward models are not supported). Returns (training rows, reward functions)."""
    from datasets import Dataset  # noqa: PLC0415

    if train_dataset is None:
        if max_steps <= 0:
            raise ValueError("without a train_dataset, an environment_factory run needs max_steps > 0 (as in TRL)")
        train_dataset = Dataset.from_dict({"prompt": [EMPTY_PROMPT] * tasks_per_rollout})
    for dataset in (train_dataset, eval_dataset):
        if dataset is not None:
            check_environment_factory(environment_factory, dataset.column_names)
    reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs or [])
    if not all(callable(function) for function in reward_funcs):
        raise ValueError("reward_funcs must be callables taking environments= (reward models are not supported)")
    return train_dataset, reward_funcs


def check_tool_chat_template(processing_class: Any) -> None:
    """The tokenizer's chat template must render tool calls and TRL must know how to parse them; TRL's
    `add_response_schema` then sets the parser on the tokenizer (unless it has one).

    Raises:
        ValueError: saying which templates work.
    """
    from trl.chat_template_utils import add_response_schema, supports_tool_calling  # noqa: PLC0415

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    working = (f"templates that work: TRL's {', '.join(TOOL_TEMPLATES)} families (e.g. Qwen2.5/Qwen3 instruct models); "
               "a ChatML tokenizer can take `trl.chat_template_utils.qwen2_5_chat_template`")
    if not supports_tool_calling(tokenizer):
        raise ValueError(f"the tokenizer's chat template cannot render tool calls (user -> assistant with tool_calls "
                         f"-> tool), which an environment_factory class needs; {working}")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise ValueError(f"the tokenizer's chat template renders tool calls, but TRL cannot parse them from the "
                             f"model's replies (no response template for it); {working}") from None


class TRLEnvironment(BaseTextEnv):
    """An environment class of TRL's `environment_factory` behind the text contract of `gigpo_trl.envs`, one
    assistant turn a step (see the module docstring). It runs in an `EnvPool` worker.

    Args:
        environment_factory: TRL's: a zero-argument callable returning an environment, or a dict of them routed by
            the row's `environment` column.
        reward_funcs: TRL reward functions called with `environments=[the instance]` at the end of an episode
            (also `prompts`, `completions` and the row's other columns, one entry each, as TRL calls them).
        anchor: "state" or "tool_calls" (see the module docstring).
        max_steps: as `BaseTextEnv`'s (the trainer passes `max_env_steps`, so the last step's reward includes the
            reward functions'.

    `reset(seed=s, options=row)`: seeds Python's and numpy's generators with `s`, then calls the instance's
    `reset(**row)`. `step(action)`: `action` is the assistant message as JSON (`ToolCallDialogue.read`).
    `info` on reset: `anchor`, `prompt`, `tools`, `task_type` (the environment's name), `anchor_kind` "history" with
    the "tool_calls" anchor; on step: `anchor`,
    `tool_messages`, `task_type`; both `won` when the instance's `won` attribute is a bool (see the module docstring).
    """

    def __init__(self, environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory], *,
                 reward_funcs: Sequence[Callable[..., Any]] = (), anchor: str = "state",
                 max_steps: int | None = None) -> None:
        super().__init__(max_steps=max_steps)
        if anchor not in TOOL_ANCHOR_MODES:
            raise ValueError(f"anchor must be one of {TOOL_ANCHOR_MODES}, got {anchor!r}")
        self._factories = _factories(environment_factory)
        self._routed = isinstance(environment_factory, Mapping)
        self.reward_funcs, self.anchor_mode = list(reward_funcs), anchor
        self._instances: dict[str | None, Any] = {}  # one per environment name, reset for every episode (as TRL's pool)
        self._loop = asyncio.new_event_loop()  # for async tools and rewards
        self.environment: Any = None
        self._row: dict[str, Any] = {}
        self._name: str | None = None
        self._prompt: Messages = []
        self._completion: Messages = []
        self._calls: list[tuple[str, str]] = []
        self._reward_so_far = 0.0

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str | Messages, dict[str, Any]]:
        row = dict(options or {})
        self._name = row.pop("environment", None) if self._routed else None
        if self._name not in self._factories:
            raise ValueError(f"the row's environment {self._name!r} is none of {sorted(self._factories)}")
        if self._name not in self._instances:
            self._instances[self._name] = self._factories[self._name]()
        self.environment = self._instances[self._name]
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed % 2**32)
        observation = self._resolved(self.environment.reset(**row))
        prompt = [dict(message) for message in row.get("prompt") or EMPTY_PROMPT]
        if observation is not None:  # appended to the last message, as TRL does (content blocks with blocks)
            content = prompt[-1]["content"]
            if not isinstance(observation, list):
                observation = str(observation)
            if isinstance(observation, list) and isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if isinstance(observation, str) and isinstance(content, list):
                observation = [{"type": "text", "text": observation}]
            prompt[-1] = {**prompt[-1], "content": content + observation}
        self._row, self._prompt, self._completion, self._calls, self._reward_so_far = row, prompt, [], [], 0.0
        info = {**self._info(), INFO_PROMPT: prompt, INFO_TOOLS: tool_schemas(self.environment)}
        if self.anchor_mode == "tool_calls":  # a history of calls, never repeated: no loop metrics (gigpo_trl.loops)
            info[INFO_ANCHOR_KIND] = "history"
        if isinstance(prompt[-1]["content"], str):
            info[INFO_TASK] = prompt[-1]["content"]
        return prompt[-1]["content"], info

    def _step(self, action: str) -> tuple[str | Messages, float, bool, dict[str, Any]]:
        message = json.loads(action)
        calls = message.get("tool_calls") or []
        tool_messages = [self._call(call) for call in calls]
        self._completion += [message, *tool_messages]
        reward = 0.0
        if callable(getattr(self.environment, "get_reward", None)):
            value = float(self._resolved(self.environment.get_reward()))
            reward, self._reward_so_far = value - self._reward_so_far, value
        terminated = not calls or bool(getattr(self.environment, "done", False))
        return _tool_observation(tool_messages), reward, terminated, {**self._info(), INFO_TOOL_MESSAGES: tool_messages}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """`BaseTextEnv.step`, with the reward functions' reward added to an episode's last step."""
        observation, reward, terminated, truncated, info = super().step(action)
        if (terminated or truncated) and self.reward_funcs:
            reward += self._episode_reward()
        return observation, reward, terminated, truncated, info

    def close(self) -> None:
        """Close the instances that have a `close` method."""
        super().close()
        for environment in self._instances.values():
            if callable(getattr(environment, "close", None)):
                environment.close()
        self._instances.clear()

    def _call(self, tool_call: dict[str, Any]) -> dict[str, Any]:
        """Run one tool call; returns its role "tool" message (an error result, as TRL writes it, if it fails)."""
        function = tool_call.get("function", tool_call)
        name, arguments = function.get("name"), function.get("arguments") or {}
        try:
            if name not in tool_names(type(self.environment)):
                raise ValueError(f"Tool {name} not found.")
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            result = self._resolved(getattr(self.environment, name)(**arguments))
        except Exception as exc:  # noqa: BLE001 (the model's call failed: it reads why, as in TRL)
            result = {"error": str(exc)}
        self._calls.append((str(name), json.dumps(arguments, sort_keys=True, default=str)))
        return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}

    def _episode_reward(self) -> float:
        """The sum of the reward functions over this episode, called as TRL calls them for one completion."""
        columns = {name: [value] for name, value in self._row.items() if name not in ("prompt", "completion")}
        total = 0.0
        for function in self.reward_funcs:
            values = self._resolved(function(prompts=[self._prompt], completions=[self._completion],
                                             environments=[self.environment], **columns))
            if values and values[0] is not None:  # None: this function does not score this row (TRL: NaN)
                total += float(values[0])
        return total

    def _info(self) -> dict[str, Any]:
        if self.anchor_mode == "tool_calls":
            anchor = hashlib.sha1(json.dumps(self._calls).encode()).hexdigest()
        elif isinstance(inspect.getattr_static(type(self.environment), "anchor", None), property):
            anchor = self.environment.anchor
        elif callable(getattr(self.environment, "gigpo_anchor", None)):
            anchor = self.environment.gigpo_anchor()
        else:
            anchor = attribute_anchor(self.environment)
        return {INFO_ANCHOR: anchor, INFO_TASK_TYPE: self._name or type(self.environment).__name__, **self._success()}

    def _success(self) -> dict[str, bool]:
        """`{"won": the instance's won}`; empty when it has no `won` or it is None (unknown).

        Raises:
            ValueError: `won` is neither a bool nor None, naming the class and the value.
        """
        won = getattr(self.environment, "won", None)
        if won is None:
            return {}
        if not isinstance(won, bool | np.bool_):
            raise ValueError(f"{type(self.environment).__name__}.won must be a bool (or None while unknown), got {won!r}")
        return {INFO_WON: bool(won)}

    def _resolved(self, value: Any) -> Any:
        return self._loop.run_until_complete(value) if inspect.isawaitable(value) else value


class ToolCallDialogue:
    """The rollout's side of `TRLEnvironment`: a step's prompt is the row's messages (with what `reset` returned)
    and the last `history_length` (assistant, tool) exchanges, offered the environment's tools, or the whole
    conversation (`history_length` None, as TRL plays it: each prompt continues the previous one's ids with the
    answer as generated and the tool messages as the next turn); a reply becomes the assistant message TRL's
    `parse_response` reads from its tokens, sent to the environment as JSON. A reply that opens a tool call TRL cannot
    parse breaks the format (invalid): it has no tool call, so it ends the episode.

    Args:
        processing_class: the tokenizer, with TRL's response parser set (`check_tool_chat_template`).
        history_length: K, the past exchanges shown; None, the whole conversation.
    """

    def __init__(self, processing_class: Any, history_length: int | None = None) -> None:
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.history_length = history_length
        response_template = getattr(self.tokenizer, "response_template", None) or {}
        self.tool_call_opening = response_template.get("fields", {}).get("tool_calls", {}).get("open")

    def prompt(self, start: EnvOutput, current: EnvOutput, history: Sequence[Exchange], step: int) -> Messages:
        shown = history_window(history, self.history_length)
        exchanges = [message for past in shown for message in (self.reply(past), *self.turn(past, step))]
        return [*start.info[INFO_PROMPT], *exchanges]

    def reply(self, past: Exchange) -> dict[str, Any]:
        return json.loads(past.action.action)

    def turn(self, past: Exchange, step: int) -> Messages:
        messages = list(past.result.info.get(INFO_TOOL_MESSAGES, []))
        if self.history_length is None and message_images(messages):
            raise ValueError(NO_IMAGES_IN_CONVERSATIONS)
        return messages

    def tools(self, start: EnvOutput) -> Tools:
        return start.info[INFO_TOOLS]

    def read(self, completion: Completion, start: EnvOutput, current: EnvOutput) -> ParsedAction:
        from trl.chat_template_utils import parse_response  # noqa: PLC0415

        message = parse_response(self.tokenizer, completion.completion_ids, prefix=completion.prompt_ids,
                                 tools=start.info[INFO_TOOLS])
        malformed = (self.tool_call_opening is not None and not message.get("tool_calls")
                     and self.tool_call_opening in completion.text)
        return ParsedAction(json.dumps(message), valid=not malformed)

    @property
    def answer_format(self) -> str:
        return "no tool call the chat template's parser cannot read"


def _tool_observation(tool_messages: Messages) -> str | list[dict[str, Any]]:
    """What a step's tool messages are as an observation (`gigpo_trl.observations`): their contents joined by
    newlines, as text, or as content blocks where a tool returned some (an image, say)."""
    blocks = [block for message in tool_messages for block in (
        message["content"] if isinstance(message["content"], list) else [{"type": "text", "text": str(message["content"])}])]
    if all(block.get("type") == "text" for block in blocks):
        return "\n".join(block["text"] for block in blocks)
    return blocks


def _factories(environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory]) -> dict[str | None, EnvironmentFactory]:
    factories = dict(environment_factory) if isinstance(environment_factory, Mapping) else {None: environment_factory}
    not_callable = [name for name, factory in factories.items() if not callable(factory)]
    if not factories or not_callable:
        raise ValueError(f"environment_factory must be a callable returning an environment, or a non-empty dict of "
                         f"them; got {environment_factory!r}")
    return factories


def _check_reset_arguments(reset: Callable[..., Any], columns: set[str], kind: str) -> None:
    """`reset(**row)` must accept every column of a row and find every argument it requires."""
    parameters = inspect.signature(reset).parameters.values()
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in parameters if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if required - columns:
        raise ValueError(f"{kind}.reset needs {sorted(required - columns)}, which the dataset has no column for "
                         f"(its columns: {sorted(columns)})")
    if not accepts_any and columns - named:
        raise ValueError(f"{kind}.reset(**row) receives every column of a row, as in TRL, but does not accept "
                         f"{sorted(columns - named)}: add **kwargs to reset")


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_plain(item) for key, item in value.items())
    return False


def _plain(value: Any) -> Any:
    """A JSON value of a plain-data value; a set becomes its sorted members."""
    if isinstance(value, set | frozenset):
        return sorted((_plain(item) for item in value), key=json.dumps)
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
