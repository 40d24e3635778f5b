"""TextWorldExpress games (PyPI `textworld-express`) as a text environment.

TextWorldExpress re-implements eight TextWorld-like games in a JVM engine driven over py4j: 0.3-1 ms a step,
no game files, no download. Games and their parameters (TextWorldExpress's own defaults apply to every parameter
not given; `make_env` passes unknown names to the engine, which refuses them with the list it knows):

    cookingworld   numLocations (1-11), numIngredients (1-5), numDistractorItems (0-10), includeDoors (0/1),
                   limitInventorySize (0/1): find the cookbook's ingredients, prepare them, cook and eat the
                   meal, the closest to ALFWorld's household tasks.
    coin           numLocations, numDistractorItems, includeDoors, limitInventorySize: find and take a coin.
    twc            numLocations, numItemsToPutAway, includeDoors, limitInventorySize: put objects where they belong.
    mapreader      numLocations, maxDistractorItemsPerLocation, includeDoors, limitInventorySize,
                   maxDistanceApart: read a map, fetch a coin, bring it back to a box.
    arithmetic     -: solve a math problem, put the object with that quantity in the box.
    sorting        -: put objects in the box from the smallest quantity to the largest.
    simonsays      gameLength, numDistractors, memorization, verbose: do what Simon says.
    peckingorder   -: follow the instruction book, which changes after each step.

Tasks and folds. The engine defines disjoint seed sets per fold: train 0-999, dev 10000-10999, test
20000-20999 (`fold_seeds(fold)` asks the engine). `reset(seed=s)` plays the game of seed `s` in the fold that
holds `s`, so a task is just its seed and held-out tasks can never be trained on; a seed of no fold is refused.
`reset()` without a seed draws a train seed. `options` may override the game and its parameters for one episode:
`{"game": "coin", "numLocations": 3}`.

Reward: the step's score difference (the engine's score is cumulative and normalized to [0, 1]). Terminated: the
task succeeded or failed. `info` on reset and step: `anchor` (the exact state, see below), `admissible_actions`
(the engine's valid actions, sorted), `won`, `lost`, `task` (the task description), `task_type` (the game, with
its parameters when some are given: "cookingworld(numLocations=3)"), `score`; on reset also `seed` and `fold`.
`walkthrough` gives the engine's gold action sequence of the current game (e.g. for a supervised warm start).

Anchor: a sha1 hex digest of the game's full state, the score and the sorted valid actions; never the move count.
The observation and `look` + `inventory` are not exact: they hide closed containers' contents and other rooms. So
the state is read from the engine's objects: the object tree (cookingworld: every room, container, the inventory,
the recipe, eaten or deleted objects), every room's object tree with doors and the agent's room (coin, twc,
mapreader), the one room and the inventory (arithmetic, sorting, peckingorder, whose instruction book's text
changes with progress), the position in the sequence (simonsays). What no tree records (whether a text was read)
changes neither the score nor the valid actions of any game, so states that differ only there share an anchor.
Reading the state costs a few py4j calls: 1-10 ms a step, more than the step itself.

Each environment starts its own JVM at its first reset (about 0.8 s) and stops it on `close()`. A pool of G x N
environments runs G x N JVMs, so they start lean (`JVM_OPTIONS`: serial garbage collector, the quick JIT only, a
192 MB heap cap): measured after five cookingworld episodes of the default size, 74 MB resident instead of 313 MB
with the JVM's defaults, and steps as fast. Java is a system dependency: without a `java` executable the
constructor raises an error that says how to install one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

try:
    import orjson  # a dependency of textworld-express: sorts and serializes the state 5x faster than json
    from textworld_express import TextWorldExpressEnv as Engine
except ImportError as exc:
    raise ImportError(
        "the TextWorldExpress environments need the textworld-express package: pip install 'gigpo-trl[textworld-express]'"
    ) from exc

from gigpo_trl.env_base import BaseTextEnv, is_int
from gigpo_trl.environments.jvm import require_java, start_jvm
from gigpo_trl.envs import FOLDS, INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_TASK_TYPE, INFO_WON

GAMES = ("cookingworld", "coin", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder")
# Where each game keeps its state (see the module docstring).
_STATE_SOURCE = {
    "cookingworld": "object_tree",
    "coin": "rooms", "twc": "rooms", "mapreader": "rooms",
    "arithmetic": "room", "sorting": "room", "peckingorder": "room",
    "simonsays": "sequence",
}
# The engine ends an episode itself after this many steps; episodes are cut off by `max_steps` (or the trainer's
# max_env_steps) long before.
_ENGINE_STEP_LIMIT = 1_000_000
JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xmx192m")


def task_type_of(game: str, params: Mapping[str, Any]) -> str:
    """The task type reported in `info["task_type"]`: the game, with the parameters given, sorted by name."""
    if not params:
        return game
    return f"{game}({','.join(f'{name}={value}' for name, value in sorted(params.items()))})"


def state_anchor(world: Any, score: float, valid_actions: list[str]) -> str:
    """The exact key of a state: sha1 hex digest of the world state (JSON-serializable), the score and the
    sorted valid actions."""
    text = orjson.dumps({"world": world, "score": score, "actions": sorted(valid_actions)}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha1(text).hexdigest()


class TextWorldExpressEnv(BaseTextEnv):
    """A TextWorldExpress game with text observations and text actions (see the module docstring).

    Args:
        game: one of `GAMES`; default "cookingworld".
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step.
        jvm_options: options of the JVM (default `JVM_OPTIONS`), after `jvm.START_OPTIONS` (no performance-data
            file, log output off stdout); the ones in the JAVA_TOOL_OPTIONS environment variable come after them,
            so they win. A start that fails is tried again (`jvm.START_ATTEMPTS` times in all).
        **params: the game's parameters, e.g. `numLocations=3, includeDoors=0` (the engine's defaults otherwise).

    Stepping before `reset()` or after the episode ended raises a RuntimeError.
    """

    def __init__(
        self,
        game: str = "cookingworld",
        *,
        max_steps: int | None = None,
        jvm_options: Sequence[str] = JVM_OPTIONS,
        **params: Any,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if game not in GAMES:
            raise ValueError(f"unknown TextWorldExpress game {game!r}; known: {list(GAMES)}")
        require_java("TextWorldExpress")
        self.game, self.params = game, _checked_params(params)
        self.jvm_options = tuple(jvm_options)
        self._engine: Any = None  # textworld_express.TextWorldExpressEnv, started at the first reset
        self._loaded: tuple[str, str] | None = None  # (game, parameter string) the engine has loaded
        self._seed_folds: dict[str, dict[int, str]] = {}  # game -> seed -> its fold, in the engine's order
        self._seed_rng: random.Random | None = None
        self._episode: dict[str, Any] | None = None  # game, params, seed, fold of the current episode

    def fold_seeds(self, fold: str, game: str | None = None) -> list[int]:
        """The seeds of `fold` ("train", "dev" or "test") of `game` (default: this environment's game)."""
        if fold not in FOLDS:
            raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
        return [seed for seed, its_fold in self._folds_of(game or self.game).items() if its_fold == fold]

    def _folds_of(self, game: str) -> dict[int, str]:
        """Seed -> fold for `game`, asked of the engine once."""
        if game not in self._seed_folds:
            self._load(game, self.params if game == self.game else {})
            engine = self._engine
            fold_sets = (engine.getValidSeedsTrain(), engine.getValidSeedsDev(), engine.getValidSeedsTest())
            self._seed_folds[game] = {seed: fold for fold, seeds in zip(FOLDS, fold_sets) for seed in seeds}
        return self._seed_folds[game]

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Start an episode of the game of `seed`."""
        options = options or {}
        game = options.pop("game", self.game)
        if game not in GAMES:
            raise ValueError(f"unknown TextWorldExpress game {game!r} in options; known: {list(GAMES)}")
        params = _checked_params({**(self.params if game == self.game else {}), **options})
        if seed is None:
            if self._seed_rng is None:
                self._seed_rng = random.Random()
            seed = self._seed_rng.choice(self.fold_seeds("train", game))
        else:
            self._seed_rng = random.Random(seed)
        fold = self._folds_of(game).get(seed)
        if fold is None:
            ranges = {name: f"{min(seeds)}-{max(seeds)}" for name in FOLDS for seeds in [self.fold_seeds(name, game)]}
            raise ValueError(f"seed {seed} is in no fold of TextWorldExpress's {game}: seeds are {ranges}")

        self._load(game, params)
        observation, engine_info = self._engine.reset(seed=seed, gameFold=fold, generateGoldPath=True)
        self._episode = {"game": game, "params": params, "seed": seed, "fold": fold}
        info = self._info_of(engine_info)
        info.update(seed=seed, fold=fold)
        return observation.strip(), info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        observation, reward, _, engine_info = self._engine.step(action)
        terminated = bool(engine_info["tasksuccess"] or engine_info["taskfailure"])
        return observation.strip(), reward, terminated, self._info_of(engine_info)

    @property
    def walkthrough(self) -> list[str]:
        """The engine's gold action sequence of the current game, from its first state."""
        self.require_reset("the walkthrough")
        return list(self._engine.getGoldActionSequence())

    def close(self) -> None:
        """Stop the JVM (a later `reset` starts a new one)."""
        super().close()
        engine, self._engine, self._loaded, self._episode = self._engine, None, None, None
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 (py4j and the pipe raise their own errors when the JVM is already gone)
                pass
            engine.close = lambda: None  # the engine's __del__ would close it again, into a closed pipe

    def _load(self, game: str, params: Mapping[str, Any]) -> None:
        if self._engine is None:
            start = lambda: Engine(envStepLimit=_ENGINE_STEP_LIMIT)  # noqa: E731
            self._engine = start_jvm("TextWorldExpress", start, self.jvm_options)
        param_string = ",".join(f"{name}={_param_value(value)}" for name, value in sorted(params.items()))
        if self._loaded != (game, param_string):
            self._engine.load(game, param_string)  # raises ValueError naming unknown or out-of-range parameters
            self._loaded = (game, param_string)

    def _info_of(self, engine_info: Mapping[str, Any]) -> dict[str, Any]:
        valid_actions = sorted(engine_info["validActions"])
        return {
            INFO_ANCHOR: state_anchor(self._world_state(), engine_info["scoreRaw"], valid_actions),
            INFO_ADMISSIBLE_ACTIONS: valid_actions,
            INFO_WON: bool(engine_info["tasksuccess"]),
            "lost": bool(engine_info["taskfailure"]),
            INFO_TASK: engine_info["taskDescription"],
            INFO_TASK_TYPE: task_type_of(self._episode["game"], self._episode["params"]),
            "score": float(engine_info["score"]),
        }

    def _world_state(self) -> Any:
        """The game's full state as read from the engine (see the module docstring)."""
        source = _STATE_SOURCE[self._episode["game"]]
        if source == "object_tree":
            return self._engine.getObjectTree()
        game = self._engine.server.game()
        if source == "sequence":
            return game.currentStep()
        state = {"inventory": orjson.loads(game.agentInventory().toJSON())}
        if source == "room":
            state["room"] = orjson.loads(game.agentLocation().toJSON())
        else:
            state["at"] = game.agentLocation().name()
            state["rooms"] = [orjson.loads(room.toJSON()) for room in game.locations()]
        return state


def _param_value(value: Any) -> Any:
    return int(value) if isinstance(value, bool) else value


def _checked_params(params: Mapping[str, Any]) -> dict[str, Any]:
    for name, value in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a TextWorldExpress parameter name must be an identifier, got {name!r}")
        if not (is_int(value) or isinstance(value, bool)):
            raise ValueError(f"TextWorldExpress parameter {name} must be an int (or bool), got {value!r}")
    return dict(params)
