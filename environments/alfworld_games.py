"""ALFWorld's text games (household tasks: pick, look, clean, heat, cool, pick two) as a text environment, played
by TextWorld's PDDL engine the way ALFWorld's own `AlfredTWEnv` plays them.

Install and data. `pip install 'gigpo-trl[alfworld]'` installs `alfworld` and `textworld[pddl]`, whose planner
`fast-downward-textworld` pip builds from source (cmake and a C++ compiler, about a minute). The games are
downloaded once by ALFWorld's own script, `alfworld-download`, into `$ALFWORLD_DATA` (default `~/.cache/alfworld`):

    <data_dir>/json_2.1.1/<split>/<task type>-<object>-<movable receptacle>-<receptacle>-<scene>/trial_*/
        traj_data.json   ALFRED's trial description (its `task_type` is read)
        game.tw-pddl     the game: PDDL domain and problem, text grammar, `solvable`, an expert's `walkthrough`

Games of a split, as `AlfredTWEnv` collects them: every trial folder with a `traj_data.json`, except those whose
path names a movable receptacle ("movable") or a sliced object ("Sliced"), of one of the task types asked for,
whose `game.tw-pddl` exists and is marked solvable; in the order of their paths (sorted here: `AlfredTWEnv` keeps
`os.walk`'s order, which differs between file systems). Listing a split reads every game file once; the list is
cached under `gigpo_trl.paths.cache_root()/alfworld` and rebuilt when a file of the split changes (size or
modification time). Measured on 3,553 synthetic trials (game files of 112 KB, traj_data.json of 34 KB; 2 cores):
2.8 s to list, 0.24 s from the cache (every worker process of a pool reads it once).

Tasks and folds. A task is a seed; each split holds its own range of seeds, so held-out games can never be trained
on: the train fold is ALFWorld's `train` split (seed i = its i-th game), the dev fold `valid_seen` (1,000,000 + i:
rooms seen in training, "in distribution") and the test fold `valid_unseen` (2,000,000 + i: unseen rooms, "out of
distribution"). `reset(seed=s)` plays the game of `s`, whatever the environment's `split`; `reset()` without a seed
draws a game of `split` from the environment's generator, which a seeded reset re-seeds.

Episode. Observation: the engine's text, without the "-= Welcome to TextWorld, ALFRED! =-" banner (the first one
ends with "Your task is to: ..."). Actions are matched exactly against the admissible commands; anything else
leaves the state unchanged and reads "Nothing happens.", as in ALFWorld. Reward: `win_reward` (default 10, what
the GiGPO reference code pays) on the step that completes the task, else 0. Terminated: the task is done (no game
is ever lost). `info` on reset and step: `anchor` (below), `admissible_actions` (the engine's, sorted), `won`,
`task` (the goal, e.g. "put some apple on fridge"), `task_type` (`TASK_TYPES`' short name: "pick", "look",
"clean", "heat", "cool", "pick_two"); on reset also `seed`, `split` and `game` (the game file's path relative to
the split folder). `walkthrough` gives the game's stored expert solution.

Anchor: a sha1 hex digest of the engine's state facts (where the agent, every object and receptacle are, what is
held, opened, clean, hot, cool, toggled), not the observation text the reference uses: that text repeats across
different states ("Nothing happens.", "You pick up the apple 1 from the countertop 1." whether the fridge is open or
not) and differs within one state ("look" and "inventory" describe it differently), so it would merge states GiGPO
must keep apart. Two kinds of facts that change nothing later are left out (`unread_predicates`): those of
`BOOKKEEPING_PREDICATES` ("checked", "examined", set by look, examine, inventory and help) when neither the game's
domain, goal nor text grammar reads them, and TextWorld's records of deleted facts ("not_opened(fridge 1)" after the
fridge is closed again; the planner keeps its own state) whose name the grammar never uses ("not_inreceptacle" it
does use, in what "look" lists). So a state looked at and the same state not looked at share an anchor, and so do
a closed fridge and the same fridge opened and closed again. The facts hold no step counter.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    import fast_downward  # noqa: F401 (TextWorld's PDDL engine imports it lazily and fails late without it)
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
    from textworld.envs import PddlEnv
except ImportError as exc:
    raise ImportError(
        "the ALFWorld environment needs the alfworld and textworld[pddl] packages: pip install 'gigpo-trl[alfworld]' "
        f"(it builds fast-downward-textworld from source: cmake and a C++ compiler are needed) [{exc}]"
    ) from exc
from tqdm.auto import tqdm

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.envs import (
    DEFAULT_FOLD_STARTS, FOLDS, INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_TASK_TYPE, INFO_WON,
)
from gigpo_trl.paths import cache_root

DATA_ENV_VAR = "ALFWORLD_DATA"
GAMES_FOLDER = "json_2.1.1"
SPLITS = ("train", "valid_seen", "valid_unseen")
SPLIT_OF_FOLD = dict(zip(FOLDS, SPLITS))
SPLIT_SEED_STARTS = {split: DEFAULT_FOLD_STARTS[fold] for fold, split in SPLIT_OF_FOLD.items()}
# ALFWorld's task types (its config numbers them 1-6) and the short names the GiGPO paper's tables use.
TASK_TYPES = {
    "pick_and_place_simple": "pick",
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "pick_two",
}
BOOKKEEPING_PREDICATES = ("checked", "examined")
BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_GOAL_LINE = re.compile(r"Your task is to: (.*?)\.?\s*$", re.MULTILINE)
_INDEX_VERSION = 1


def default_data_dir() -> Path:
    """`$ALFWORLD_DATA` when set, else `~/.cache/alfworld` (where `alfworld-download` puts the games)."""
    return Path(os.environ.get(DATA_ENV_VAR) or Path.home() / ".cache" / "alfworld")


def state_anchor(facts: Iterable[Any], hidden_predicates: Iterable[str] = ()) -> str:
    """The exact key of a game state: sha1 hex digest of the sorted fact strings (e.g.
    "inreceptacle(apple_bar_...: object, fridge_bar_...: receptacle)"), without the facts of `hidden_predicates`."""
    hidden = set(hidden_predicates)
    text = "\n".join(sorted(str(fact) for fact in facts if fact.name not in hidden))
    return hashlib.sha1(text.encode()).hexdigest()


class AlfWorldEnv(BaseTextEnv):
    """ALFWorld's text games (see the module docstring).

    Args:
        data_dir: the folder holding `json_2.1.1/`; default `default_data_dir()`.
        split: "train", "valid_seen" or "valid_unseen": the split `reset()` without a seed draws from.
        task_types: the task types to play, as ALFWorld names them (keys of `TASK_TYPES`) or by their short names;
            default all six. Seeds number the games of these types only.
        win_reward: the reward of the step that completes the task.
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step.
        cache_dir: where the lists of games are cached; default `cache_root()/alfworld`.

    Stepping before `reset()` or after the episode ended raises a RuntimeError.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        split: str = "train",
        *,
        task_types: Sequence[str] | None = None,
        win_reward: float = 10.0,
        max_steps: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.data_dir = Path(data_dir).expanduser().absolute() if data_dir is not None else default_data_dir()
        if not (self.data_dir / GAMES_FOLDER).is_dir():
            raise FileNotFoundError(
                f"no ALFWorld games in {self.data_dir}: expected the folder {self.data_dir / GAMES_FOLDER}. Download "
                f"them once with `alfworld-download` (it writes to ${DATA_ENV_VAR}, default ~/.cache/alfworld), then "
                f"pass data_dir=<that folder> or set {DATA_ENV_VAR}."
            )
        self.split = split
        self.task_types = _checked_task_types(task_types)
        self.win_reward = float(win_reward)
        self.cache_dir = Path(cache_dir).expanduser().absolute() if cache_dir is not None else cache_root() / "alfworld"
        self._games: dict[str, list[dict[str, str]]] = {}  # split -> its games of the asked types, by seed order
        self._seed_rng: random.Random | None = None
        self._engine: Any = None  # AlfredDemangler(PddlEnv), created at the first reset
        self._game_file: Path | None = None  # the game the engine has loaded
        self._hidden_predicates: frozenset[str] = frozenset()
        self._state: Any = None
        self._episode: dict[str, Any] | None = None

    def split_seeds(self, split: str) -> list[int]:
        """The seeds of the games of `split`, in order."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        start = SPLIT_SEED_STARTS[split]
        return list(range(start, start + len(self._games_of(split))))

    def fold_seeds(self, fold: str) -> list[int]:
        """The seeds of `fold`: "train" -> ALFWorld's train split, "dev" -> valid_seen, "test" -> valid_unseen."""
        if fold not in FOLDS:
            raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
        return self.split_seeds(SPLIT_OF_FOLD[fold])

    @property
    def walkthrough(self) -> list[str]:
        """The commands of the stored expert solution of the current game (ALFWorld's `walkthrough`)."""
        self.require_reset("the walkthrough")
        return list(_read_json(self._game_file, "walkthrough")["walkthrough"])

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Start an episode of the game of `seed`."""
        if options:
            raise ValueError(f"ALFWorld takes no reset options (a task is a seed), got {options!r}")
        if seed is None:
            if self._seed_rng is None:
                self._seed_rng = random.Random()
            seed = self._seed_rng.choice(self.split_seeds(self.split))
        else:
            self._seed_rng = random.Random(seed)
        split, game = self._game_of(seed)

        game_file = self.data_dir / GAMES_FOLDER / split / game["path"]
        if self._engine is None:
            request = textworld.EnvInfos(won=True, admissible_commands=True)
            self._engine = AlfredDemangler(PddlEnv(request), shuffle=False)
        if game_file != self._game_file:
            self._engine.load(str(game_file))
            self._game_file = game_file
            # The bookkeeping facts this game never reads, from the planner's parse of its domain and problem.
            pddl_env = self._engine._wrapped_env
            self._hidden_predicates = unread_predicates(pddl_env._pddl_state.task, pddl_env._game_data["grammar"])
        self._state = self._engine.reset()
        goal = _GOAL_LINE.search(self._state.feedback)
        if goal is None:
            raise ValueError(f"{game_file}: the first observation states no goal ('Your task is to: ...')")
        self._episode = {"task": goal.group(1), "task_type": TASK_TYPES[game["task_type"]]}
        info = self._info()
        info.update(seed=seed, split=split, game=game["path"])
        return self._state.feedback.replace(BANNER, "", 1).strip(), info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._state, _, _ = self._engine.step(action)
        won = bool(self._state["won"])
        return self._state.feedback.strip(), self.win_reward if won else 0.0, won, self._info()

    def close(self) -> None:
        """End the episode. The engine is kept for a later `reset`: its planner library (a private copy per engine)
        cannot be unloaded (`fast_downward.close_lib` crashes the process at exit), so a new engine per close would
        leak about 1 MB each time."""
        super().close()
        self._state, self._episode = None, None

    def _info(self) -> dict[str, Any]:
        return {
            INFO_ANCHOR: state_anchor(self._state["_facts"], self._hidden_predicates),
            INFO_ADMISSIBLE_ACTIONS: list(self._state["admissible_commands"]),
            INFO_WON: bool(self._state["won"]),
            INFO_TASK: self._episode["task"],
            INFO_TASK_TYPE: self._episode["task_type"],
        }

    def _game_of(self, seed: int) -> tuple[str, dict[str, str]]:
        """The split and game of `seed`; only that split is listed (an evaluation worker never reads train's list)."""
        split = max((s for s in SPLITS if SPLIT_SEED_STARTS[s] <= seed), key=SPLIT_SEED_STARTS.get, default=None)
        if split is not None and seed - SPLIT_SEED_STARTS[split] < len(self._games_of(split)):
            return split, self._games_of(split)[seed - SPLIT_SEED_STARTS[split]]
        ranges = {
            split: f"{SPLIT_SEED_STARTS[split]}-{SPLIT_SEED_STARTS[split] + len(self._games_of(split)) - 1}"
            if self._games_of(split) else "no games"
            for split in SPLITS
        }
        raise ValueError(f"seed {seed} is no ALFWorld game of {self.data_dir / GAMES_FOLDER}: seeds are {ranges}")

    def _games_of(self, split: str) -> list[dict[str, str]]:
        if split not in self._games:
            games = _split_games(self.data_dir / GAMES_FOLDER / split, self.cache_dir)
            self._games[split] = [game for game in games if game["task_type"] in self.task_types]
        return self._games[split]


def unread_predicates(task: Any, grammar: str) -> frozenset[str]:
    """The predicates whose facts change no later step of a game (see the module docstring): the
    `BOOKKEEPING_PREDICATES` that no precondition, conditional effect, axiom or goal of the planner's `task` reads,
    nor the text `grammar`, and "not_<p>" for every predicate p of `task` whose negation the grammar never names."""
    read, conditions = set(), [task.goal]
    for action in task.actions:
        conditions += [action.precondition, *(effect.condition for effect in action.effects)]
    conditions += [axiom.condition for axiom in task.axioms]
    while conditions:
        condition = conditions.pop()
        if hasattr(condition, "predicate"):
            read.add(condition.predicate.lower())
        conditions.extend(getattr(condition, "parts", ()))

    def in_grammar(name: str) -> bool:  # as a condition or filter: "name(o:object)"; "\b" keeps "p(" out of "not_p("
        return re.search(rf"\b{re.escape(name)}\(", grammar, re.IGNORECASE) is not None

    hidden = {name for name in BOOKKEEPING_PREDICATES if name not in read and not in_grammar(name)}
    hidden |= {f"not_{p.name.lower()}" for p in task.predicates if not in_grammar(f"not_{p.name}")}
    return frozenset(hidden)


def _split_games(split_dir: Path, cache_dir: Path) -> list[dict[str, str]]:
    """The playable games of a split folder as `[{"path": <game file relative to split_dir>, "task_type": ...}]`,
    sorted by path (see the module docstring), from the cache when no file changed since it was written."""
    trials = sorted(
        root for root, _, files in os.walk(split_dir)
        if "traj_data.json" in files and "movable" not in root and "Sliced" not in root
    )
    stats = []
    for trial in trials:
        for name in ("traj_data.json", "game.tw-pddl"):
            path = Path(trial, name)
            stat = path.stat() if path.exists() else None
            stats.append([str(path.relative_to(split_dir)), stat and stat.st_size, stat and stat.st_mtime_ns])
    fingerprint = hashlib.sha1(json.dumps([_INDEX_VERSION, stats]).encode()).hexdigest()
    index_file = cache_dir / f"{split_dir.name}-{hashlib.sha1(str(split_dir).encode()).hexdigest()[:12]}.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        if index.get("fingerprint") == fingerprint:
            return index["games"]

    games = []
    for trial in tqdm(trials, desc=f"Listing ALFWorld's {split_dir.name} games", unit="game", disable=len(trials) < 100):
        game_file = Path(trial, "game.tw-pddl")
        task_type = _read_json(Path(trial, "traj_data.json"), "task_type")["task_type"]
        if task_type in TASK_TYPES and game_file.exists() and _read_json(game_file).get("solvable"):
            games.append({"path": str(game_file.relative_to(split_dir)), "task_type": task_type})
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = index_file.with_name(f".{index_file.name}.{uuid.uuid4().hex}")
    staging.write_text(json.dumps({"split_dir": str(split_dir), "fingerprint": fingerprint, "games": games}))
    staging.replace(index_file)  # atomic: concurrent readers see the old list or the new one
    return games


def _read_json(path: Path, key: str | None = None) -> dict[str, Any]:
    """The JSON object of an ALFWorld file (holding `key` when one is given); a ValueError names the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): re-download or re-generate it") from None
    if not isinstance(data, dict) or (key is not None and key not in data):
        raise ValueError(f"{path} is not an ALFWorld file of the expected format: no {key!r} field")
    return data


def _checked_task_types(task_types: Sequence[str] | None) -> frozenset[str]:
    if task_types is None:
        return frozenset(TASK_TYPES)
    if isinstance(task_types, str):
        raise ValueError(f"task_types must be a list of task types, got the str {task_types!r}")
    by_short_name = {short: name for name, short in TASK_TYPES.items()}
    unknown = [t for t in task_types if t not in TASK_TYPES and t not in by_short_name]
    if unknown or not task_types:
        raise ValueError(
            f"unknown ALFWorld task types {unknown}; known: {list(TASK_TYPES)} or {list(by_short_name)}" if unknown
            else "task_types must name at least one task type"
        )
    return frozenset(by_short_name.get(t, t) for t in task_types)
