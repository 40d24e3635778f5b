"""ScienceWorld (PyPI `scienceworld` 1.2.3): 30 science tasks of an elementary-school curriculum (boil, melt, grow
a plant, test conductivity, Mendelian genetics, ...) in a simulated house, a JVM engine with 7,207 variations split
by the engine into train, dev and test sets; a standard benchmark for LLM agents, which runs offline.

Tasks and folds. The environment plays one task (`task`, e.g. "boil"; `options={"task": ...}` switches it for an
episode); a seed is a variation of that task, and `fold_seeds(fold)` are the engine's variation sets (train, dev,
test are contiguous ranges, e.g. boil 0-13, 14-20, 21-29). `reset()` without a seed draws a train variation.

Episode. The first observation is the engine's "look around" (it costs no move). Reward: the step's change of the
engine's score (0 to 100: the share of the task's subgoals done; -100 when the task fails, e.g. after focusing on
the wrong object). Terminated: the task is completed (`won`) or failed. The engine's `reset task` command, which
erases the progress, is refused ("... is disabled here") and changes nothing. `info` on reset and step: `anchor`,
`won`, `lost`, `task` (the task description, then the engine's action templates), `task_type` (the task name),
`score`; with `admissible_actions=True` also `admissible_actions`, the engine's valid commands (sorted; thousands
in a furnished room, so off by default); on reset also `seed` and `fold`. With `gold_paths=True` every reset also
asks the engine for its gold path (2-4 s), which `walkthrough` gives.

Anchor: the state, read from the engine, not the observation text (which repeats across states and changes within
one). It is a sha1 of
- the object tree (`getObjectTree`), canonical: object ids dropped (those of objects created during play depend on
  creation order), children compared as unordered sets (the engine lists them in hash order), electrical connections
  named by the connected objects' paths instead of ids, floats rounded to 3 decimals, and temperatures binned in
  `temperature_bin` degrees (default 5): in 1.2.3 heat spreads in a random order (upstream issue #33), so replays
  of the same commands differ by up to about 0.015 degrees;
- the goal progress (`getGoalProgressStr`: which subgoals are done, what is focused on);
- the state of every door seen (the tree does not hold doors; each room's look text names its doors, open or
  closed);
- the parser's question, when the last command was ambiguous ("Ambiguous request: ...").
It leaves out the move count, so a state reached again is the same anchor: commands that take no time ("look
around", "inventory", a command the parser does not know) keep it, and so do two paths to one state (two doors
opened in either order). Every other command advances the world's clock, which changes the world (seeds sprout,
water cools) and so the anchor. It merges what the bins merge: two states whose temperatures differ only within a
bin (e.g. water cooling by a few degrees in a freezer). Subgoals once reached stay in the goal progress (a room with
an open door was visited), so a door opened and closed again is not the state before it.

Each environment starts its own JVM at its first reset (1-2 s), with `JVM_OPTIONS`, and stops it on `close()`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

try:
    from scienceworld import ScienceWorldEnv as Engine
    from scienceworld.constants import ID2TASK
except ImportError as exc:
    raise ImportError(
        "the ScienceWorld environment needs the scienceworld package: pip install 'gigpo-trl[scienceworld]'"
    ) from exc

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.environments.jvm import require_java, start_jvm
from gigpo_trl.envs import FOLDS, INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_TASK_TYPE, INFO_WON

TASKS = tuple(ID2TASK.values())
# The engine's simplifications, and "easy" (teleportAction, noElectricalAction, openDoors, selfWateringFlowerPots).
SIMPLIFICATIONS = ("easy", "teleportAction", "noElectricalAction", "openDoors", "openContainers",
                   "selfWateringFlowerPots")
JVM_OPTIONS = ("-XX:+UseSerialGC", "-Xmx128m")
TEMPERATURE_BIN = 5.0
DISABLED_COMMANDS = frozenset({"reset task"})
_AMBIGUOUS = "Ambiguous request"
_ROOM = re.compile(r"(?:This room is called the|This outside location is called the) (.+?)\.")
_DOOR = re.compile(r"A door to the (.+?) \(that is (open|closed)\)")


def canonical_tree(tree: Mapping[str, Any], temperature_bin: float = TEMPERATURE_BIN) -> str:
    """The object tree as a string that equal states share (see the module docstring): no ids, children sorted,
    connections by path, floats rounded, temperatures binned."""
    paths: dict[str, str] = {}

    def collect(node: Mapping[str, Any], parent: str) -> None:
        path = f"{parent}/{node['name']}"
        paths[str(node["uuid"])] = path
        for child in node["contents"].values():
            collect(child, path)

    def value(item: Any, key: str | None) -> Any:
        if isinstance(item, float):
            number = round(item / temperature_bin) if key == "temperatureC" else round(item, 3)
            return number + 0  # -0.0 -> 0.0
        if isinstance(item, Mapping):
            return sorted((name, value(inner, name)) for name, inner in item.items())
        if isinstance(item, list):
            if key == "connectedTo":
                return sorted(paths.get(str(uuid), "?") for uuid in item)
            return [value(inner, None) for inner in item]
        return item

    def node_text(node: Mapping[str, Any]) -> str:  # "(properties as JSON[children, sorted])"
        properties = sorted((name, value(item, name)) for name, item in node.items() if name not in ("uuid", "contents"))
        children = sorted(node_text(child) for child in node["contents"].values())
        return f"({json.dumps(properties)}[{','.join(children)}])"

    collect(tree, "")
    return node_text(tree)


class ScienceWorldEnv(BaseTextEnv):
    """ScienceWorld's tasks as text environments (see the module docstring).

    Args:
        task: one of `TASKS`, e.g. "boil" (the engine's names; "1-1"-style ids are accepted too).
        simplification: the engine's simplifications, comma separated (e.g. "easy", "teleportAction,openDoors"),
            or "" for none.
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step.
        admissible_actions: give the engine's valid commands in `info["admissible_actions"]` (about 30 ms a step).
        gold_paths: ask the engine for its gold path at every reset (2-4 s), for `walkthrough`.
        temperature_bin: degrees per temperature bin of the anchor.
        jvm_options: options of the JVM (default `JVM_OPTIONS`), after `jvm.START_OPTIONS` (no performance-data
            file, log output off stdout); the ones in the JAVA_TOOL_OPTIONS environment variable come after them,
            so they win. A start that fails is tried again (`jvm.START_ATTEMPTS` times in all).
    """

    seed_description = "a variation index (an int >= 0)"

    def __init__(self, task: str = "boil", simplification: str = "easy", *, max_steps: int | None = None,
                 admissible_actions: bool = False, gold_paths: bool = False, temperature_bin: float = TEMPERATURE_BIN,
                 jvm_options: Sequence[str] = JVM_OPTIONS) -> None:
        super().__init__(max_steps=max_steps)
        self.task, self.simplification = _checked_task(task), _checked_simplification(simplification)
        if not temperature_bin > 0:
            raise ValueError(f"temperature_bin must be > 0, got {temperature_bin!r}")
        require_java("ScienceWorld")
        self.admissible_actions, self.gold_paths = admissible_actions, gold_paths
        self.temperature_bin, self.jvm_options = float(temperature_bin), tuple(jvm_options)
        self._engine: Any = None  # scienceworld.ScienceWorldEnv, started at the first use
        self._folds: dict[str, dict[int, str]] = {}  # task -> variation -> its fold
        self._seed_rng: random.Random | None = None
        self._episode: dict[str, Any] | None = None  # task, seed, fold, templates of the current episode
        self._score = 0
        self._doors: dict[frozenset[str], str] = {}
        self._walkthrough: list[str] = []

    def seed_in_range(self, seed: int) -> bool:
        return seed >= 0

    def fold_seeds(self, fold: str, task: str | None = None) -> list[int]:
        """The variations of `fold` ("train", "dev" or "test") of `task` (default: this environment's)."""
        if fold not in FOLDS:
            raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
        return [seed for seed, its_fold in self._folds_of(_checked_task(task or self.task)).items() if its_fold == fold]

    @property
    def walkthrough(self) -> list[str]:
        """The engine's gold path of the current episode, from its start (needs `gold_paths=True`)."""
        self.require_reset("the walkthrough")
        if not self.gold_paths:
            raise RuntimeError("the gold path is generated at reset only with gold_paths=True (2-4 s a reset)")
        return list(self._walkthrough)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        options = dict(options or {})
        task = _checked_task(options.pop("task", self.task))
        simplification = _checked_simplification(options.pop("simplification", self.simplification))
        if options:
            raise ValueError(f"unknown ScienceWorld reset options {sorted(options)}; known: ['simplification', 'task']")
        if seed is None:
            self._seed_rng = self._seed_rng or random.Random()
            seed = self._seed_rng.choice(self.fold_seeds("train", task))
        else:
            self._seed_rng = random.Random(seed)
        fold = self._folds_of(task).get(seed)
        if fold is None:
            raise ValueError(f"seed {seed} is no variation of ScienceWorld's {task}: its variations are "
                             f"0-{len(self._folds_of(task)) - 1}")
        engine = self._started()
        engine.load(task, seed, simplification, generateGoldPath=self.gold_paths)
        self._walkthrough = engine.get_gold_action_sequence() if self.gold_paths else []
        observation = engine.server.step("look around")  # the engine's own first observation; no move
        templates = ", ".join(engine.get_possible_actions())
        self._episode = {"task": task, "seed": seed, "fold": fold, "templates": templates}
        self._score, self._doors = 0, {}
        info = self._info(observation)
        info.update(seed=seed, fold=fold)
        return observation.strip(), info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if " ".join(action.lower().split()) in DISABLED_COMMANDS:
            observation = f"The '{action.strip()}' command is disabled here."
        else:
            observation = self._engine.server.step(action)
        score = int(round(100 * self._engine.server.getScore()))
        reward, self._score = score - self._score, score
        info = self._info(observation)
        return observation.strip(), float(reward), info[INFO_WON] or info["lost"], info

    def close(self) -> None:
        """Stop the JVM (a later `reset` starts a new one)."""
        super().close()
        engine, self._engine, self._episode = self._engine, None, None
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 (py4j raises its own errors when the JVM is already gone)
                pass
            engine.close = lambda: None  # the engine's __del__ would close it again, into a closed pipe

    def _started(self) -> Any:
        if self._engine is None:
            self._engine = start_jvm("ScienceWorld", lambda: Engine("", envStepLimit=1_000_000), self.jvm_options)
        return self._engine

    def _folds_of(self, task: str) -> dict[int, str]:
        """Variation -> fold for `task`, asked of the engine once."""
        if task not in self._folds:
            engine = self._started()
            engine.load(task, 0, "")  # the engine's split calls read the loaded task
            sets = (engine.get_variations_train(), engine.get_variations_dev(), engine.get_variations_test())
            self._folds[task] = {seed: fold for fold, seeds in zip(FOLDS, sets) for seed in seeds}
        return self._folds[task]

    def _info(self, observation: str) -> dict[str, Any]:
        server = self._engine.server
        won, score = bool(server.getCompleted()), int(round(100 * server.getScore()))
        info = {
            INFO_ANCHOR: self._anchor(observation),
            INFO_WON: won,
            "lost": score < 0,
            INFO_TASK: f"{server.getTaskDescription()} Commands: {self._episode['templates']}.",
            INFO_TASK_TYPE: self._episode["task"],
            "score": score,
        }
        if self.admissible_actions:
            joined = self._engine._gateway.jvm.java.lang.String.join("\n", server.getValidActionObjectCombinations())
            info[INFO_ADMISSIBLE_ACTIONS] = sorted(set(joined.split("\n")) - DISABLED_COMMANDS)
        return info

    def _anchor(self, observation: str) -> str:
        server = self._engine.server
        look = server.freeActionLook()
        room = _ROOM.search(look)
        if room:
            for other, state in _DOOR.findall(look):
                self._doors[frozenset((room.group(1), other))] = state
        doors = sorted(f"{'|'.join(sorted(pair))}={state}" for pair, state in self._doors.items())
        question = observation if observation.startswith(_AMBIGUOUS) else ""
        tree = canonical_tree(json.loads(server.getObjectTree("")), self.temperature_bin)
        text = "\x1e".join([tree, server.getGoalProgressStr(), ";".join(doors), question])
        return hashlib.sha1(text.encode()).hexdigest()


def _checked_task(task: Any) -> str:
    name = ID2TASK.get(task, task)
    if name not in TASKS:
        raise ValueError(f"unknown ScienceWorld task {task!r}; known: {list(TASKS)}")
    return name


def _checked_simplification(simplification: Any) -> str:
    parts = simplification.split(",") if isinstance(simplification, str) else None
    unknown = [part for part in parts or [] if part and part not in SIMPLIFICATIONS]
    if parts is None or unknown:
        raise ValueError(f"simplification must be '' or some of {list(SIMPLIFICATIONS)}, comma separated; got "
                         f"{simplification!r}")
    return simplification
