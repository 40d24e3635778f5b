"""The environment contract, the environment registry and `make_env`.

An environment is any object with Gymnasium's API, with text in and text (or images) out, so a `gymnasium.Env`
whose observations and actions are strings plugs in unchanged:

    obs, info = env.reset(seed=S, options=task_or_None)
    obs, reward, terminated, truncated, info = env.step(action)      # action: str
    env.close()

- `obs` is what the agent sees: clean text, or a PIL image, or a list of content blocks mixing text and images as
  TRL's environment classes return them (`gigpo_trl.observations`); `reward` is the reward of this step (not
  cumulative).
- The same `seed` and `options` give the same initial state (and so the same initial anchor).
- Optional `info` keys:
    `anchor`             hashable exact key of the state the next action is taken in (default: `obs`; for an
                         observation with images, its text and a digest of each image's pixels)
    `admissible_actions` list of str, the actions that make sense now
    `won`                bool, the task is solved; the success rates count it (an environment that never
                         gives it logs no success rate: unknown, not 0)
    `task`               str, the goal text
    `task_type`          str, the kind of task (evaluation reports success per type)
    `anchor_kind`        on reset: "state" (the default) or "history", for an anchor that is the history of the
                         episode's actions rather than the state they led to (it never repeats within an episode,
                         so the loop metrics, `loops/*`, are left out rather than reported as 0)

An environment may also give `walkthrough`: the actions that win the current task when played from its start
(an expert's solution, e.g. for a supervised warm start or a test that the game can be won).

The shipped environments derive from `gigpo_trl.env_base.BaseTextEnv`, which does the bookkeeping every
environment shares (order of calls, step limit, argument checks); any object with the methods below fits.

Tasks are seeds. An environment may define folds, `env.fold_seeds(fold) -> list[int]` for `fold` in
"train", "dev", "test" (TextWorldExpress uses its engine's own folds); for one that does not, `fold_seeds` below
uses disjoint seed ranges starting at `DEFAULT_FOLD_STARTS`.

`check_env` (in `gigpo_trl.env_checker`) tells a plug-in author precisely what does not fit.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gigpo_trl.metric_names import ENV_PREFIX, TRAINER_ENV_METRICS
from gigpo_trl.observations import observation_key

INFO_ANCHOR = "anchor"
INFO_ADMISSIBLE_ACTIONS = "admissible_actions"
INFO_WON = "won"
INFO_TASK = "task"
INFO_TASK_TYPE = "task_type"
INFO_ANCHOR_KIND = "anchor_kind"
INFO_METRICS = "metrics"
ANCHOR_KINDS = ("state", "history")
# What an environment may name a metric of its own: it is logged as env/<name> (and env/<name>/<task type>).
ENV_METRIC_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def info_metrics(info: Mapping[str, Any]) -> dict[str, float]:
    """The numbers an environment reports for the run's metrics in `info["metrics"]` ({name: number}, on reset or any
    step; {} without it). The run logs the mean over its episodes of each one's latest value as `env/<name>`, and per
    task type as `env/<name>/<type>`. Raises ValueError naming what does not fit: a name other than letters, digits,
    `_`, `.`, `-`, a name the trainer logs itself, a value that is not a finite number."""
    metrics = info.get(INFO_METRICS)
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ValueError(f"info['metrics'] must be a dict of {{name: number}}, got {type(metrics).__name__}")
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not ENV_METRIC_NAME.fullmatch(name):
            raise ValueError(f"info['metrics'] has the name {name!r}: use letters, digits, '_', '.' and '-' (it is "
                             "logged as env/<name>)")
        if ENV_PREFIX + name in TRAINER_ENV_METRICS:
            raise ValueError(f"info['metrics'][{name!r}] would be logged as env/{name}, which the trainer logs itself: "
                             "rename it")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"info['metrics'][{name!r}] must be a finite number, got {value!r}")
        checked[name] = float(value)
    return checked


@runtime_checkable
class TextEnv(Protocol):
    """The contract (structural: no base class needed)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


EnvFactory = Callable[..., TextEnv]

FOLDS = ("train", "dev", "test")
# First seed of each fold of an environment without `fold_seeds`: a million tasks per fold.
DEFAULT_FOLD_STARTS = {"train": 0, "dev": 1_000_000, "test": 2_000_000}


def default_fold_seeds(fold: str) -> range:
    """The seeds of a fold of an environment without folds of its own: disjoint ranges from `DEFAULT_FOLD_STARTS`."""
    starts = sorted(DEFAULT_FOLD_STARTS.values())
    start = DEFAULT_FOLD_STARTS[fold]
    return range(start, next((later for later in starts if later > start), start + 1_000_000))


def anchor_of(observation: str, info: Mapping[str, Any], images: tuple[Any, ...] = ()) -> Hashable:
    """The anchor key of a state: `info["anchor"]` when the environment gives one, else the observation (its text,
    and its images' digests where it has images: `gigpo_trl.observations.observation_key`)."""
    return info[INFO_ANCHOR] if INFO_ANCHOR in info else observation_key(observation, images)


@dataclass
class EnvOutput:
    """What one environment returned for one reset or step, in one shape (reset: reward 0, not terminated).
    `observation` is its text, with `gigpo_trl.observations.IMAGE_MARKER` where each of `images` stands."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    images: tuple[Any, ...] = ()

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def anchor(self) -> Any:
        return anchor_of(self.observation, self.info, self.images)


# Name -> factory, or "module:attribute" of a factory imported on first use (keeps heavy
# dependencies such as TextWorld out of `import gigpo_trl`).
_REGISTRY: dict[str, EnvFactory | str] = {
    "rooms": "gigpo_trl.environments.rooms:RoomsEnv",
    "compass": "gigpo_trl.environments.compass:CompassEnv",
    "sokoban": "gigpo_trl.environments.sokoban:SokobanEnv",
    "visual_sokoban": "gigpo_trl.environments.visual_sokoban:VisualSokobanEnv",
    "textworld": "gigpo_trl.environments.textworld_games:TextWorldEnv",
    "textworld_express": "gigpo_trl.environments.textworld_express_games:TextWorldExpressEnv",
    "openenv": "gigpo_trl.environments.openenv_adapter:OpenEnvAdapter",
    "alfworld": "gigpo_trl.environments.alfworld_games:AlfWorldEnv",
    "scienceworld": "gigpo_trl.environments.scienceworld_games:ScienceWorldEnv",
    "search_qa": "gigpo_trl.environments.search_qa:SearchQAEnv",
    "webshop": "gigpo_trl.environments.webshop:WebShopEnv",
}
# Name -> the environment's default wording of step prompts (a `gigpo_trl.prompts.PromptTemplate`), or
# "module:attribute" of one imported on first use; a name without one gets the generic template.
_PROMPT_TEMPLATES: dict[str, Any] = {
    "sokoban": "gigpo_trl.environments.sokoban:PROMPT_TEMPLATE",
    "visual_sokoban": "gigpo_trl.environments.visual_sokoban:PROMPT_TEMPLATE",
    "search_qa": "gigpo_trl.environments.search_qa:PROMPT_TEMPLATE",
    "webshop": "gigpo_trl.environments.webshop:PROMPT_TEMPLATE",
}


def register_env(name: str, factory: EnvFactory | str, *, overwrite: bool = False, prompt_template: Any = None) -> None:
    """Register an environment under `name` for `make_env(name, **kwargs)`.

    Args:
        name: the name users pass to `make_env` or to `GiGPOConfig.env_name`.
        factory: a callable `factory(**kwargs) -> env`, or a "module:attribute" string naming one.
        overwrite: replace an existing registration (and its prompt template) instead of raising.
        prompt_template: the environment's default wording of step prompts, a `gigpo_trl.prompts.PromptTemplate` or a
            "module:attribute" string naming one: used when a run names no template, and named by `name` in
            `GiGPOConfig.prompt_template`. None: the generic template.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name must be a non-empty str, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise ValueError(f"factory for {name!r} must be a callable or a 'module:attribute' string, got {factory!r}")
    if isinstance(prompt_template, str) and ":" not in prompt_template:
        raise ValueError(f"prompt_template for {name!r} must be a PromptTemplate or a 'module:attribute' string, got "
                         f"{prompt_template!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"an environment named {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory
    _PROMPT_TEMPLATES.pop(name, None)
    if prompt_template is not None:
        _PROMPT_TEMPLATES[name] = prompt_template


def env_prompt_template(name: str) -> Any:
    """The default prompt template registered with an environment name (see `register_env`), or None."""
    template = _PROMPT_TEMPLATES.get(name)
    return _resolve(template) if template is not None else None


def prompt_template_envs() -> list[str]:
    """The environment names registered with a default prompt template."""
    return sorted(_PROMPT_TEMPLATES)


def registered_envs() -> list[str]:
    """Names `make_env` knows (gymnasium's registry comes on top)."""
    return sorted(_REGISTRY)


def make_env(env: str | EnvFactory, /, **kwargs: Any) -> TextEnv:
    """Create an environment.

    Args:
        env: a name given to `register_env` (built in: see `registered_envs()`), an id registered with
            `gymnasium`, or any callable returning an environment.
        **kwargs: passed to the factory (or to `gymnasium.make`).
    """
    if callable(env):
        return env(**kwargs)
    if not isinstance(env, str):
        raise ValueError(f"env must be a registered name or a callable, got {type(env).__name__}")
    if env in _REGISTRY:
        return _make_registered(_REGISTRY[env], **kwargs)
    gymnasium_ids = _gymnasium_ids()
    if env in gymnasium_ids:
        import gymnasium  # noqa: PLC0415 (optional dependency)

        return gymnasium.make(env, **kwargs)
    raise ValueError(
        f"unknown environment {env!r}; registered: {registered_envs()}"
        + ("" if gymnasium_ids else " (gymnasium ids are accepted too when gymnasium is installed)")
    )


def fold_seeds(env: str | EnvFactory, fold: str, count: int, /, **kwargs: Any) -> list[int]:
    """The first `count` task seeds of `fold` ("train", "dev" or "test") of `make_env(env, **kwargs)`: the
    environment's own `fold_seeds(fold)` when it has one, else `DEFAULT_FOLD_STARTS[fold]`, ... . The same
    arguments give the same seeds on every machine and process, so a dev or test panel is fixed by its fold and
    count; folds never share a seed."""
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    instance = make_env(env, **kwargs)
    try:
        own_seeds = getattr(instance, "fold_seeds", None)
        seeds = default_fold_seeds(fold) if own_seeds is None else own_seeds(fold)
    finally:
        instance.close()
    if count > len(seeds):
        raise ValueError(f"the {fold} fold of {env!r} has {len(seeds)} tasks, fewer than the {count} asked for")
    return list(seeds[:count])


def env_factory(env: str | EnvFactory, /, **kwargs: Any) -> Callable[[], TextEnv]:
    """A zero-argument factory for `make_env(env, **kwargs)`, e.g. for `EnvPool`. A name registered in this process
    (with `register_env`, or a gymnasium id) is looked up now, so the factory also works in a process where it was
    never registered (a fork server started as a fresh interpreter); a "module:attribute" entry is still imported
    where the factory is called."""
    if isinstance(env, str) and env in _REGISTRY:
        return functools.partial(_make_registered, _REGISTRY[env], **kwargs)
    if isinstance(env, str) and env in _gymnasium_ids():
        import gymnasium  # noqa: PLC0415 (optional dependency)

        return functools.partial(gymnasium.make, gymnasium.spec(env), **kwargs)
    return functools.partial(make_env, env, **kwargs)


def _make_registered(entry: Any, /, **kwargs: Any) -> TextEnv:
    """An environment from a registry entry: a factory, or a "module:attribute" string naming one."""
    return _resolve(entry)(**kwargs)


def _resolve(entry: Any) -> Any:
    """A registry entry itself, or the object its "module:attribute" string names (imported now)."""
    if not isinstance(entry, str):
        return entry
    module_name, _, attribute = entry.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _gymnasium_ids() -> set[str]:
    try:
        import gymnasium  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return set()
    return set(gymnasium.registry)
