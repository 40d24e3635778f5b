"""OpenEnv environments as text environments: `OpenEnvAdapter`.

An OpenEnv environment (PyPI `openenv`) has a gym-like API over typed pydantic models: `reset(seed=...,
episode_id=..., **kwargs) -> Observation` and `step(Action) -> Observation`, where every observation carries
`reward`, `done` and `metadata` besides its own fields. `OpenEnvAdapter` plays one through the text contract
of `gigpo_trl.envs`. Its `env` argument is one of:

- an `Environment` instance, or a zero-argument callable (e.g. the class) returning one: runs in this process;
- a server's base URL ("http://127.0.0.1:8000", "https://user-space.hf.space", "ws://..."): a session on that
  server through openenv's `GenericEnvClient`, over the server's `/ws` WebSocket. (The server's HTTP `/reset`
  and `/step` routes create a fresh environment for every request, so an episode cannot be played over them.)
  Every adapter holds a session of its own: the server's `max_concurrent_envs` (1 unless the environment sets
  `SUPPORTS_CONCURRENT_SESSIONS`) must reach the number of environments of an `EnvPool` (G x N);
- an openenv client (`EnvClient` or its `.sync()` wrapper, e.g. `MyEnv.from_docker_image(...)`, typed or
  generic), or a zero-argument callable returning one (the form for `EnvPool` workers).

On a server (a URL or a client), an outage is waited out where it can be: opening the session and starting an
episode (`reset`) try again, with a pause that doubles, while the server refuses connections or answers 5xx, for
`service_wait` seconds in all (`gigpo_trl.services.wait_out`, which says while it waits what it waits for). A step
is never tried again: the episode's state lives in the server's session, so a connection lost during an episode
fails that episode with an error that says so (in an `EnvPool`, its trajectory ends and the run goes on; the next
reset waits for the server).

The adapter owns what it gets: `close()` closes the environment or the client. (Importing this module imports
`openenv.core`, which takes a few seconds: it loads gradio for OpenEnv's web interface.)

The hooks see an observation as a dict: the observation model's fields except `reward` and `done`, with
`metadata`, in JSON types. That is what the server sends over the wire, so an environment gives the same
dicts, texts and anchors in this process and behind a server. Hooks and their defaults:

    observation_to_text    `render_observation`: the first non-empty str among the fields named in
                           `TEXT_FIELDS` ("text", "message", ...); else one "name: value" line per field
                           except `metadata` (values other than str written as JSON).
    observation_to_anchor  `observation_anchor`: canonical JSON of the fields except `metadata` and
                           `COUNTER_FIELDS` (step counters and ids such as `step_count` and `episode_id`), so
                           that the same state reached by two paths, or at another step, has the same anchor.
                           Fields with other names that change without the state changing (a clock, say) need
                           `functools.partial(observation_anchor, exclude=COUNTER_FIELDS | {"clock"})`.
    text_to_action         `action_from_text(text, action_cls)`, see its docstring. The Action model is
                           `action_cls`, or for an `Environment` in this process the annotation of the `action`
                           parameter of its `step`.

`admissible_actions_key`, `won_key` and `task_key` name the field (a str) or the candidate fields (a sequence,
the first found wins) that give `info["admissible_actions"]` (a list; entries other than str written as JSON),
`info["won"]` (bool) and `info["task"]` (str; other values written as JSON). Each name is looked up among the
observation's fields, then in its `metadata`; None, or no name found, leaves the key out of `info`. Defaults:
`ADMISSIBLE_ACTIONS_FIELDS`, `WON_FIELDS`, `TASK_FIELDS`.

Reward: the observation's `reward` (None: 0.0). `terminated`: its `done`. `truncated`: True at the
`max_steps`-th step of an episode (with `terminated` too when that step ends it, as gymnasium's TimeLimit).
`reset(seed=s, options=o)` calls the environment's `reset(seed=s, **o)`, without `seed` when it is None, so
`options` carries any other argument of OpenEnv's reset (`episode_id`, a task's `split` and `index`, ...). A
server passes on only the arguments its environment's reset accepts and silently drops the others.

A text that `text_to_action` rejects with a ValueError (pydantic's ValidationError is one) is an invalid
action, as unknown text is for the other environments of this package: the environment is not called, the
state and its anchor stay, the reward is 0.0, the step counts towards `max_steps`, `info["invalid_action"]` is
True, and the observation is "Invalid action: <the reason>" followed by the last observation's text.
Errors of the environment itself (or of the connection) are raised: `EnvPool` ends that trajectory. Stepping
before `reset()` or after the episode ended raises a RuntimeError, as gymnasium's OrderEnforcing does.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

try:
    from openenv.core import Action, EnvClient, Environment, GenericEnvClient, Observation, SyncEnvClient
    from openenv.core.client_types import StepResult
except ImportError as exc:
    raise ImportError("the OpenEnv adapter needs the openenv package: pip install 'gigpo-trl[openenv]'") from exc
from pydantic import BaseModel, ValidationError
from websockets.exceptions import ConnectionClosed

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_WON
from gigpo_trl.services import DEFAULT_SERVICE_WAIT, wait_out

TEXT_FIELDS = ("text", "message", "prompt", "observation", "content")
COUNTER_FIELDS = frozenset(
    {"episode_id", "session_id", "request_id", "timestamp", "step", "step_count", "steps_taken", "elapsed_steps",
     "steps_remaining", "remaining_steps", "turn_count"}
)
ADMISSIBLE_ACTIONS_FIELDS = ("admissible_actions", "legal_actions", "valid_actions", "available_actions", "legal_moves")
WON_FIELDS = ("won", "success", "solved", "is_success")
TASK_FIELDS = ("task", "goal", "instruction", "objective")

INVALID_ACTION = "Invalid action: {reason}\n{observation}"

OpenEnvSource = Environment | EnvClient | SyncEnvClient | str | Callable[[], Environment | EnvClient | SyncEnvClient]
FieldNames = str | Sequence[str] | None


def render_observation(observation: Mapping[str, Any]) -> str:
    """The default text of an observation dict (see the module docstring)."""
    for name in TEXT_FIELDS:
        value = observation.get(name)
        if isinstance(value, str) and value.strip():
            return value
    return "\n".join(_field_line(name, value) for name, value in observation.items() if name != "metadata")


def observation_anchor(observation: Mapping[str, Any], exclude: frozenset[str] = COUNTER_FIELDS) -> str:
    """The default anchor of an observation dict: canonical JSON of its fields except `metadata` and `exclude`."""
    content = {name: value for name, value in observation.items() if name != "metadata" and name not in exclude}
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def action_from_text(text: str, action_cls: type[Action]) -> Action:
    """The `action_cls` instance the agent's `text` stands for (surrounding whitespace ignored):

    - when the model has exactly one required field and it is a str, the text is that field's value;
    - else a text starting with "{" is parsed as a JSON object of the model's fields;
    - else, when the model has exactly one required field, the text is that field's value, converted by
      pydantic (so "3" is an int field's 3, and a Literal field takes one of its choices).

    Raises:
        ValueError: naming the problem (the field, the JSON error) when the text gives no valid action.
    """
    text = text.strip()
    fields = {name: field for name, field in action_cls.model_fields.items() if name != "metadata"}
    required = [name for name, field in fields.items() if field.is_required()]
    single = required[0] if len(required) == 1 else None
    if single is not None and fields[single].annotation is str:
        return _validated(action_cls, {single: text})
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the text is not valid JSON ({exc.msg} at character {exc.pos})") from None
        return _validated(action_cls, data)
    if single is not None:
        return _validated(action_cls, {single: text})
    raise ValueError(f"expected a JSON object with the fields {_describe_fields(fields)}, got {text!r}")


class OpenEnvAdapter(BaseTextEnv):
    """An OpenEnv environment, in this process or on a server, as a text environment (see the module docstring).

    Args:
        env: an `Environment`, a server's base URL, an openenv client, or a zero-argument callable returning an
            `Environment` or a client.
        action_cls: the `Action` subclass the environment's step takes; needed with the default `text_to_action`
            for a server or a client, and for an `Environment` whose `step` does not annotate `action` with it.
        observation_to_text: observation dict -> the text the agent sees.
        text_to_action: the agent's text -> an `Action`; a ValueError makes the text an invalid action. None:
            `action_from_text` with `action_cls`.
        observation_to_anchor: observation dict -> the hashable anchor of the state.
        admissible_actions_key, won_key, task_key: a field name, candidate names, or None (see the module docstring).
        max_steps: None: the adapter never truncates; an int n >= 1: `truncated` is True at the n-th step.
        service_wait: for a server, seconds an outage (a refused connection, a 5xx answer) is waited out when the
            session opens and when an episode starts (default 300: a server's restart); 0: no second try.

    `info` on reset and step: `anchor`, and `admissible_actions`, `won`, `task` when their fields are found; on
    step also `invalid_action`.
    """

    def __init__(
        self,
        env: OpenEnvSource,
        *,
        action_cls: type[Action] | None = None,
        observation_to_text: Callable[[dict[str, Any]], str] = render_observation,
        text_to_action: Callable[[str], Action] | None = None,
        observation_to_anchor: Callable[[dict[str, Any]], Hashable] = observation_anchor,
        admissible_actions_key: FieldNames = ADMISSIBLE_ACTIONS_FIELDS,
        won_key: FieldNames = WON_FIELDS,
        task_key: FieldNames = TASK_FIELDS,
        max_steps: int | None = None,
        service_wait: float = DEFAULT_SERVICE_WAIT,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if not service_wait >= 0:
            raise ValueError(f"service_wait must be a number of seconds >= 0, got {service_wait!r}")
        if action_cls is not None and not (isinstance(action_cls, type) and issubclass(action_cls, Action)):
            raise TypeError(f"action_cls must be a subclass of openenv's Action, got {action_cls!r}")
        self.observation_to_text = observation_to_text
        self.observation_to_anchor = observation_to_anchor
        self.admissible_actions_key = _field_names(admissible_actions_key, "admissible_actions_key")
        self.won_key = _field_names(won_key, "won_key")
        self.task_key = _field_names(task_key, "task_key")
        self._session = _open_session(env, service_wait)
        if text_to_action is None:
            action_cls = action_cls or _step_action_class(self._session)
            if action_cls is None:
                self._session.close()
                raise ValueError(
                    "cannot tell which Action model the environment's step takes: pass action_cls=<its Action "
                    "subclass> (or text_to_action=<text -> Action>)"
                )
            text_to_action = functools.partial(action_from_text, action_cls=action_cls)
        self.text_to_action = text_to_action
        self._text = ""
        self._info: dict[str, Any] = {}
        self._closed = False

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Start an episode: the environment's `reset(seed=seed, **options)`."""
        if options is not None and not all(isinstance(k, str) for k in options):
            raise ValueError(f"options must be None or a dict of reset arguments by name, got {options!r}")
        arguments = dict(options or {})
        if "seed" in arguments:
            raise ValueError("pass the seed as reset(seed=...), not in options")
        if seed is not None:
            arguments["seed"] = seed
        _, done = self._observe(self._session.reset(**arguments))
        if done:
            self.end_episode()
        return self._text, dict(self._info)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        try:
            openenv_action = self.text_to_action(action)
        except ValueError as exc:
            text = INVALID_ACTION.format(reason=exc, observation=self._text)
            return text, 0.0, False, {**self._info, "invalid_action": True}
        if not isinstance(openenv_action, Action):
            raise TypeError(f"text_to_action must return an openenv Action, got {type(openenv_action).__name__}")
        reward, terminated = self._observe(self._session.step(openenv_action))
        return self._text, reward, terminated, {**self._info, "invalid_action": False}

    def close(self) -> None:
        """Close the environment or the client (once)."""
        super().close()
        if not self._closed:
            self._closed = True
            self._session.close()

    def _observe(self, result: StepResult) -> tuple[float, bool]:
        """Record the text and info of a reset's or step's result; returns its (reward, done)."""
        observation = _observation_dict(result.observation)
        self._text = self.observation_to_text(observation)
        self._info = {INFO_ANCHOR: self.observation_to_anchor(observation)}
        admissible = _lookup(observation, self.admissible_actions_key)
        if admissible is not None:
            if not isinstance(admissible, list | tuple):
                raise TypeError(
                    f"the admissible actions found by admissible_actions_key={self.admissible_actions_key} must be "
                    f"a list, got {type(admissible).__name__}; pass admissible_actions_key=None or another name"
                )
            self._info[INFO_ADMISSIBLE_ACTIONS] = [_as_text(a) for a in admissible]
        won = _lookup(observation, self.won_key)
        if won is not None:
            self._info[INFO_WON] = bool(won)
        task = _lookup(observation, self.task_key)
        if task is not None:
            self._info[INFO_TASK] = _as_text(task)
        return 0.0 if result.reward is None else float(result.reward), bool(result.done)


class _RemoteSession:
    """A session on an OpenEnv server through a sync client: opening it and starting an episode wait out an outage
    (`wait_out`); a step whose connection was lost, or replaced by a new one, fails the episode saying so."""

    def __init__(self, client: SyncEnvClient, wait: float) -> None:
        self.client, self.wait = client, wait
        self.server = f"the OpenEnv server {getattr(client.async_client, 'base_url', None) or 'of the client'}"
        self._waited(client.connect)

    def reset(self, **arguments: Any) -> StepResult:
        return self._waited(lambda: self.client.reset(**arguments))

    def step(self, action: Action) -> StepResult:
        connection = _connection(self.client)
        try:
            result = self.client.step(action)
        except (OSError, ConnectionClosed) as exc:  # not the environment's own errors, which the server sends back
            raise ConnectionError(f"{self.server} failed during the episode ({type(exc).__name__}: {exc}); the episode's "
                                  "state was in its session and is lost") from exc
        if connection is None or _connection(self.client) is not connection:
            raise ConnectionError(f"{self.server} lost the episode's session: the client reconnected during the episode "
                                  "(the server restarted?), so the step ran in a new session, not in the episode's")
        return result

    def close(self) -> None:
        self.client.close()

    def _waited(self, call: Callable[[], Any]) -> Any:
        return wait_out(call, service=self.server, retry_reason=_outage, wait=self.wait)


def _connection(client: SyncEnvClient) -> Any:
    """The WebSocket the client holds now (openenv's EnvClient keeps it in `_ws`), to tell a step that reconnected."""
    return getattr(client.async_client, "_ws", None)


def _outage(exc: Exception) -> str | None:
    """Why opening a session or starting an episode failed, where trying again may help: the server refused the
    connection or answered 5xx (openenv raises a ConnectionError over the cause); None otherwise (a timeout included)."""
    cause = exc.__cause__ if isinstance(exc, ConnectionError) and exc.__cause__ is not None else exc
    status = getattr(getattr(cause, "response", None), "status_code", None)  # websockets' InvalidStatus
    if status is not None:
        return f"HTTP {status}" if status >= 500 else None
    if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
        return str(cause)
    return None


class _InProcessSession:
    """An `Environment` in this process, answering as openenv's sync client does (with a `StepResult`)."""

    def __init__(self, environment: Environment) -> None:
        self.environment = environment

    def reset(self, **arguments: Any) -> StepResult:
        return _step_result(self.environment.reset(**arguments))

    def step(self, action: Action) -> StepResult:
        return _step_result(self.environment.step(action))

    def close(self) -> None:
        self.environment.close()


def _step_result(observation: Observation) -> StepResult:
    return StepResult(observation=observation, reward=observation.reward, done=observation.done)


def _open_session(env: OpenEnvSource, wait: float) -> _InProcessSession | _RemoteSession:
    if isinstance(env, str):
        env = GenericEnvClient(base_url=env)
    elif callable(env) and not isinstance(env, Environment | EnvClient | SyncEnvClient):
        env = env()
    if isinstance(env, Environment):
        return _InProcessSession(env)
    if isinstance(env, EnvClient):
        env = env.sync()
    if isinstance(env, SyncEnvClient):
        return _RemoteSession(env, wait)
    raise TypeError(
        "env must be an openenv Environment, a server's base URL, an openenv client, or a zero-argument callable "
        f"returning an Environment or a client; got {type(env).__name__}"
    )


def _step_action_class(session: _InProcessSession | _RemoteSession) -> type[Action] | None:
    """The Action subclass annotating the `action` parameter of an in-process environment's step, if any."""
    if not isinstance(session, _InProcessSession):
        return None
    try:
        annotation = typing.get_type_hints(type(session.environment).step).get("action")
    except (NameError, TypeError):  # an annotation that does not resolve outside its module
        return None
    if isinstance(annotation, type) and issubclass(annotation, Action) and annotation is not Action:
        return annotation
    return None


def _observation_dict(observation: Observation | Mapping[str, Any]) -> dict[str, Any]:
    """The observation's fields but `reward` and `done`, in JSON types (as the server sends them)."""
    if isinstance(observation, BaseModel):
        return observation.model_dump(mode="json", exclude={"reward", "done"})
    return dict(observation)


def _lookup(observation: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of `names` found among the observation's fields, then in its metadata, or None."""
    metadata = observation.get("metadata") or {}
    for name in names:
        for source in (observation, metadata):
            if source.get(name) is not None:
                return source[name]
    return None


def _field_names(names: FieldNames, argument: str) -> tuple[str, ...]:
    if names is None:
        return ()
    if isinstance(names, str):
        names = (names,)
    if not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"{argument} must be a field name, a sequence of field names, or None; got {names!r}")
    return tuple(names)


def _validated(action_cls: type[Action], data: dict[str, Any]) -> Action:
    try:
        return action_cls.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or action_cls.__name__}: {error['msg']}" for error in exc.errors()
        )
        raise ValueError(problems) from None


def _describe_fields(fields: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f'"{name}": {_type_name(field.annotation)}' for name, field in fields.items()) + "}"


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _field_line(name: str, value: Any) -> str:
    text = _as_text(value)
    return f"{name}:\n{text}" if "\n" in text else f"{name}: {text}"


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
