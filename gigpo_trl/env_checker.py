"""`check_env`: tells an environment author precisely what does not fit the contract of `gigpo_trl.envs`.

Hard violations raise `EnvCheckError` (a ValueError) naming the problem; things that are legal but
probably wrong (rewards that look cumulative, steps that do not replay) give an `EnvCheckWarning`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

from gigpo_trl.envs import (
    ANCHOR_KINDS, INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_ANCHOR_KIND, INFO_TASK, INFO_WON, TextEnv, anchor_of,
    info_metrics,
)
from gigpo_trl.observations import observation_key, readable, short_repr, split_observation


class EnvCheckError(ValueError):
    """The environment breaks the contract of `gigpo_trl.envs`."""


class EnvCheckWarning(UserWarning):
    """The environment keeps the contract but probably not as meant (e.g. its rewards look cumulative)."""


def check_env(env: TextEnv, *, seed: int = 0, options: dict[str, Any] | None = None, num_steps: int = 20) -> None:
    """Check `env` against the contract: types (observations: text, PIL images or content blocks of both,
    `gigpo_trl.observations`), determinism of `reset` by seed (an image by its pixels), hashable anchors,
    well-formed `info` keys, per-step rewards. The environment is reset and stepped (with its
    admissible actions in turn, or "look") and closed at the end.

    Args:
        env: the environment to check.
        seed: the seed for the resets.
        options: the task options passed to `reset`.
        num_steps: how many steps to play at most.

    Raises:
        EnvCheckError: naming the first violation found.
    """
    for method in ("reset", "step", "close"):
        if not callable(getattr(env, method, None)):
            raise EnvCheckError(f"the environment has no {method}() method")

    (observation, images), info = _checked_reset(env, seed, options)
    (again, images_again), info_again = _checked_reset(env, seed, options)
    if (observation_key(again, images_again), anchor_of(again, info_again, images_again)) != (
            observation_key(observation, images), anchor_of(observation, info, images)):
        raise EnvCheckError(
            f"reset(seed={seed}) is not deterministic: two resets gave different "
            + ("observations" if observation_key(again, images_again) != observation_key(observation, images)
               else "anchors")
            + f" ({short_repr(readable(observation, images))} vs {short_repr(readable(again, images_again))}). GiGPO resets N copies of a task with the same seed "
            "and groups their steps by state: an environment that ignores its seed leaves every step group a singleton."
        )

    trajectory = _play(env, info, num_steps)
    _, info_replay = _checked_reset(env, seed, options)
    replay = _play(env, info_replay, num_steps, actions=[action for action, _ in trajectory])
    if replay != trajectory:
        warnings.warn(
            "replaying the same actions after the same reset gave different observations or rewards: transitions are "
            "stochastic. That is allowed, but copies of a task then share fewer states.",
            EnvCheckWarning,
            stacklevel=2,
        )
    env.close()


def _checked_reset(env: TextEnv, seed: int, options: dict[str, Any] | None
                   ) -> tuple[tuple[str, tuple[Any, ...]], Mapping[str, Any]]:
    """The observation of a reset as (text, images), and its info."""
    result = env.reset(seed=seed, options=options)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise EnvCheckError(f"reset() must return (observation, info), got {short_repr(result)}")
    observation, info = result
    return _check_observation_and_info(observation, info, "reset()"), info


def _play(env: TextEnv, info: Mapping[str, Any], num_steps: int, actions: list[str] | None = None) -> list[tuple[str, Any]]:
    """Play up to `num_steps` steps; returns [(action, (observation, reward, terminated, truncated, anchor))]."""
    trajectory = []
    previous_score = info.get("score")
    for t in range(num_steps if actions is None else len(actions)):
        admissible = info.get(INFO_ADMISSIBLE_ACTIONS) or ["look"]
        action = admissible[t % len(admissible)] if actions is None else actions[t]
        result = env.step(action)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise EnvCheckError(f"step() must return (observation, reward, terminated, truncated, info), got {short_repr(result)}")
        observation, reward, terminated, truncated, info = result
        where = f"step({action!r})"
        text, images = _check_observation_and_info(observation, info, where)
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise EnvCheckError(f"{where} returned reward {reward!r}: the reward must be a finite number")
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not _is_bool(flag):
                raise EnvCheckError(f"{where} returned {name}={flag!r}: it must be a bool")
        score = info.get("score")
        if (isinstance(score, numbers.Real) and previous_score is not None and score != previous_score
                and reward == score and reward != score - previous_score):
            warnings.warn(
                f"{where}: the reward equals info['score'] ({score}) although the score changed by {score - previous_score}: "
                "rewards look cumulative. The reward must be the reward of this step (e.g. the score difference).",
                EnvCheckWarning,
                stacklevel=3,
            )
        previous_score = score if isinstance(score, numbers.Real) else previous_score
        trajectory.append((action, (observation_key(text, images), float(reward), bool(terminated), bool(truncated),
                                    anchor_of(text, info, images))))
        if terminated or truncated:
            break
    return trajectory


def _check_observation_and_info(observation: Any, info: Any, where: str) -> tuple[str, tuple[Any, ...]]:
    """The observation as (text, images), once it and `info` are checked."""
    try:
        text, images = split_observation(observation, f"{where}'s observation")
    except (TypeError, ValueError) as exc:
        raise EnvCheckError(str(exc)) from None
    if not isinstance(info, Mapping):
        raise EnvCheckError(f"{where} returned info of type {type(info).__name__}; it must be a dict")
    if INFO_ANCHOR in info:
        try:
            hash(info[INFO_ANCHOR])
        except TypeError as exc:
            raise EnvCheckError(f"{where}: info['anchor'] must be hashable ({exc})") from None
    admissible = info.get(INFO_ADMISSIBLE_ACTIONS)
    if admissible is not None and not (isinstance(admissible, list | tuple) and all(isinstance(a, str) for a in admissible)):
        raise EnvCheckError(f"{where}: info['admissible_actions'] must be a list of str, got {short_repr(admissible)}")
    if INFO_WON in info and not _is_bool(info[INFO_WON]):
        raise EnvCheckError(f"{where}: info['won'] must be a bool, got {info[INFO_WON]!r}")
    if INFO_TASK in info and not isinstance(info[INFO_TASK], str):
        raise EnvCheckError(f"{where}: info['task'] must be a str, got {type(info[INFO_TASK]).__name__}")
    if INFO_ANCHOR_KIND in info and info[INFO_ANCHOR_KIND] not in ANCHOR_KINDS:
        raise EnvCheckError(f"{where}: info['anchor_kind'] must be one of {ANCHOR_KINDS}, got {info[INFO_ANCHOR_KIND]!r}")
    try:
        info_metrics(info)
    except ValueError as exc:
        raise EnvCheckError(f"{where}: {exc}") from None
    return text, images


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy.bool_ too
