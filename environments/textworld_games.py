"""TextWorld games as a text environment, generated offline with TextWorld's own generators and cached on disk.

A game is fixed by a challenge, its settings and a seed. `reset(seed=s)` plays the game of the environment's
challenge and settings (overridable per episode through `options`) for seed `s`. It is generated the first time
(0.5-1.5 s, plus about 1 s for TextWorld's first generation in a process; compiled to a .z8 story file by the
bundled Inform 7) and read from the cache every later time, by any process. The same settings and seed give the
same game: byte-identical for every challenge but "cooking", whose story file varies with Python's string hashing
(PYTHONHASHSEED) while the game plays the same (same first observation, facts and walkthrough).

Challenges and their settings (defaults in `DEFAULT_SETTINGS`):

    treasure_hunter  level 1-30: 5, 10 or 20 rooms; the quest is to take one object, and taking a second,
                     wrong object loses. The default game is level 3: 5 rooms, the object one room away
                     (walkthrough: 2 commands), so a random policy already wins now and then, and walking
                     back and forth revisits states (repeated anchors, the point of GiGPO's step groups).
    coin_collector   level 1-300: a chain of rooms, the coin at its end.
    simple           rewards ("dense", "balanced", "sparse"), goal ("detailed", "brief", "none"), test (bool):
                     the fixed six-room house, find the food and put it on the stove.
    cooking          recipe (1-5 ingredients), take (how many to find), go (1, 6, 9 or 12 rooms), open, cook,
                     cut, drop (bool skills), recipe_seed, split (None, "train", "valid", "test"): the First
                     TextWorld Problems games, the closest to ALFWorld's household tasks.
    custom           world_size (rooms), nb_objects, quest_length: `tw-make custom` (same game as
                     `tw-make custom --world-size W --nb-objects N --quest-length L --seed S`).

Reward: the score difference of the step (TextWorld's score is cumulative). Terminated: the game is won or
lost. `info` on reset and step: `anchor` (a sha1 hex digest of the sorted facts of the world and the score:
the exact state, see `state_anchor`), `admissible_actions`, `won`, `lost`, `task` (the objective), `score`,
`max_score`; on reset also `seed` (the game's seed, drawn when `reset` got none).

Every action goes through `sanitize_command` before it reaches the interpreter, which runs in this process:
some inputs hang it, crash the process, or change the game behind TextWorld's state tracking.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import textworld
import textworld.challenges
import textworld.generator

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_WON
from gigpo_trl.paths import cache_root

DEFAULT_CHALLENGE = "treasure_hunter"
DEFAULT_SETTINGS: dict[str, dict[str, Any]] = {
    # tw-make's defaults where it has some (cooking; custom's world size and objects), else small games won in
    # 2 or 3 commands.
    "treasure_hunter": {"level": 3},
    "coin_collector": {"level": 3},
    "simple": {"rewards": "dense", "goal": "detailed", "test": False},
    "cooking": {
        "recipe": 1,
        "take": 0,
        "go": 1,
        "open": False,
        "cook": False,
        "cut": False,
        "drop": False,
        "recipe_seed": 0,
        "split": None,
    },
    "custom": {"world_size": 5, "nb_objects": 10, "quest_length": 3},
}
# Settings that TextWorld reads with if/elif chains, so that a typo would silently make another game.
_SETTING_CHOICES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("simple", "rewards"): ("dense", "balanced", "sparse"),
    ("simple", "goal"): ("detailed", "brief", "none"),
    ("cooking", "split"): (None, "train", "valid", "test"),
}

GAME_FILE_NAME = "game.z8"
_MAX_SEED = 2**32  # exclusive: TextWorld seeds a numpy RandomState with it

# jericho's input buffer; it truncates longer commands itself (with a warning).
MAX_COMMAND_LENGTH = 198
# Inform's own answer to an empty command; given without calling the interpreter to commands that sanitize to "".
EMPTY_COMMAND_FEEDBACK = "I beg your pardon?"
# Verbs of the Inform library that act on the interpreter instead of the world. restart and restore change the
# game behind TextWorld's state tracking (facts, score), save and script/transcript write files into the working
# directory, quit waits for a yes/no answer, undo would rewind the game behind the tracking, and the display
# modes change how later observations read, which the facts do not record.
META_VERBS = frozenset(
    {"quit", "q", "restart", "restore", "save", "script", "transcript", "undo"}
    | {"brief", "normal", "superbrief", "short", "verbose", "long", "notify"}
)
# Inform runs "a. b", "a, b" and "a then b" as several commands in one step; TextWorld's tracking misses all but one.
_COMMAND_SEPARATOR = re.compile(r"[.,]|\bthen\b", re.IGNORECASE)
_UNSAFE_CHARACTER = re.compile(r"[^ -~]|\\")  # anything but printable ASCII, and the backslash

# The ASCII-art title of the first observation: lines drawn with only these characters.
_BANNER_LINE = re.compile(r"[ _|\\/$<>]*[_|\\/$][ _|\\/$<>]*")
# The last line: the prompt ">" followed by the right-aligned status "-= Room =-score/moves".
_PROMPT_LINE = re.compile(r"^>.*\s*\Z", re.MULTILINE)
_ENDGAME_QUESTION = "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"

_REQUESTED_INFOS = textworld.EnvInfos(
    admissible_commands=True, facts=True, objective=True, score=True, max_score=True, won=True, lost=True
)
# The interpreter's random generator is seeded from the clock unless told otherwise (and 0 means "not told").
_INTERPRETER_SEED = 1


def sanitize_command(text: str) -> str:
    """The part of `text` that is safe to send to TextWorld's interpreter (dumb-frotz, in this process).

    Each rule removes a hazard measured with TextWorld 1.7 / jericho 3.3:

    - only the first line: an embedded newline runs a second command unseen; its text comes out at the next
      step, and TextWorld's state tracking falls one step behind the game;
    - only the first command of a chain: Inform also runs "a. b", "a, b" and "a then b" as several commands
      (same desync: the game can be won while the tracked facts and score do not move);
    - printable ASCII only, other characters become spaces: a NUL byte segfaults the whole Python process;
      control and non-ASCII characters mean nothing to the parser;
    - no backslash: dumb-frotz reads a leading backslash as a hot key, and an unknown one makes it loop forever
      (printing an error line each time: gigabytes of log a minute);
    - whitespace collapsed and at most `MAX_COMMAND_LENGTH` characters (jericho's input buffer);
    - no meta-command (`META_VERBS`: quit, restart, restore, save, script, undo, display modes ...): they act on
      the interpreter instead of the world, write files, or wait for a yes/no answer.

    Returns "" when nothing safe is left; `TextWorldEnv` then answers `EMPTY_COMMAND_FEEDBACK` itself.
    """
    lines = text.splitlines()
    first_line = " ".join(_UNSAFE_CHARACTER.sub(" ", lines[0] if lines else "").split())[:MAX_COMMAND_LENGTH]
    command = _COMMAND_SEPARATOR.split(first_line, maxsplit=1)[0].strip()
    if command.split(" ", 1)[0].lower() in META_VERBS:
        return ""
    return command


def clean_observation(feedback: str) -> str:
    """The text the agent should read from the interpreter's raw output: without the ASCII-art title, the
    trailing prompt and status line (which holds the move counter), the end-of-game RESTART/RESTORE/QUIT
    question, leading and trailing spaces of lines (centered text) and runs of blank lines."""
    text = _PROMPT_LINE.sub("", feedback).replace(_ENDGAME_QUESTION, "")
    lines = [line.strip() for line in text.splitlines() if not _BANNER_LINE.fullmatch(line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def state_anchor(facts: Iterable[Any], score: int) -> str:
    """The exact key of a game state: sha1 hex digest of the sorted fact strings (e.g. "at(P, kitchen: r)",
    "in(coin: o, I)") and of the score. The score is part of the state because TextWorld pays each quest's
    points once: a drawer opened (+1), closed and opened again has the facts of before but pays nothing."""
    text = "\n".join(sorted(map(str, facts))) + f"\nscore {score}"
    return hashlib.sha1(text.encode()).hexdigest()


def default_cache_dir() -> Path:
    """Where games are cached: the `textworld` folder of `gigpo_trl.paths.cache_root()`
    (`$GIGPO_TRL_CACHE`, else `$XDG_CACHE_HOME/gigpo_trl`, else `~/.cache/gigpo_trl`)."""
    return cache_root() / "textworld"


class TextWorldEnv(BaseTextEnv):
    """A TextWorld game with text observations and text actions (see the module docstring).

    Args:
        challenge: "treasure_hunter" (default), "coin_collector", "simple", "cooking" or "custom".
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step
            (with `terminated` too when that step ends the game, as gymnasium's TimeLimit does).
        cache_dir: folder of the generated games; default `default_cache_dir()`.
        **settings: the challenge's settings (see `DEFAULT_SETTINGS[challenge]` for their names and defaults).

    `reset(seed=s)` plays the game of seed `s` (0 <= s < 2**32); `reset()` without a seed plays a game of a
    seed drawn from the environment's generator, which `reset(seed=s)` re-seeds (as in gymnasium: a seeded
    reset followed by unseeded ones is reproducible). `options` is None or a dict of settings that override
    the constructor's for that episode. The interpreter is started once per game and only reset between
    episodes of the same game. Stepping before `reset()` or after the episode ended raises a RuntimeError.

    Cache layout: `cache_dir/<challenge>-<hash>-seed<seed>/` holds `game.z8` (the story file), `game.json`
    (TextWorld's description of the game), `game.ni` (its Inform 7 source) and `parameters.json`; `<hash>`
    is a short sha1 of the challenge, all its settings and TextWorld's version. A game is generated into a
    hidden staging folder and renamed into place, so concurrent processes never read a half-written game
    (when two generate the same game, the first rename wins and the other's copy is discarded).
    """

    def __init__(
        self,
        challenge: str = DEFAULT_CHALLENGE,
        *,
        max_steps: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(max_steps=max_steps)
        if challenge not in DEFAULT_SETTINGS:
            raise ValueError(f"unknown TextWorld challenge {challenge!r}; known: {sorted(DEFAULT_SETTINGS)}")
        self.challenge = challenge
        self.settings = _checked_settings(challenge, DEFAULT_SETTINGS[challenge], settings)
        self.cache_dir = Path(cache_dir).expanduser().absolute() if cache_dir is not None else default_cache_dir()
        self._seed_rng: random.Random | None = None
        self._game: textworld.core.Environment | None = None  # the running interpreter
        self._game_file: Path | None = None
        self._state: textworld.GameState | None = None

    seed_description = "an int in [0, 2**32)"

    def seed_in_range(self, seed: int) -> bool:
        return 0 <= seed < _MAX_SEED

    @property
    def walkthrough(self) -> list[str]:
        """The commands that win the current game from its start (TextWorld's walkthrough)."""
        self.require_reset("the walkthrough")
        return list(self._state["game"].walkthrough)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Start an episode of the game of `seed` (generated on first use)."""
        if seed is None:
            if self._seed_rng is None:
                self._seed_rng = random.Random()
            seed = self._seed_rng.randrange(_MAX_SEED)
        else:
            self._seed_rng = random.Random(seed)
        settings = _checked_settings(self.challenge, self.settings, options or {})

        game_file = self._cached_game_file(settings, seed)
        if game_file != self._game_file:
            self.close()
            self._game = textworld.start(str(game_file), request_infos=_REQUESTED_INFOS)
            self._game.seed(_INTERPRETER_SEED)
            self._game_file = game_file
        self._state = self._game.reset()
        info = self._info()
        info["seed"] = seed
        return clean_observation(self._state.feedback), info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Send one command, sanitized first."""
        command = sanitize_command(action)
        if command:
            score_before = self._state["score"]
            self._state, _, _ = self._game.step(command)
            observation = clean_observation(self._state.feedback)
            reward = float(self._state["score"] - score_before)
        else:
            observation, reward = EMPTY_COMMAND_FEEDBACK, 0.0
        terminated = bool(self._state["won"] or self._state["lost"])
        return observation, reward, terminated, self._info()

    def close(self) -> None:
        """Stop the interpreter (a later `reset` starts it again)."""
        super().close()
        if self._game is not None:
            self._game.close()
        self._game = None
        self._game_file = None
        self._state = None

    def _info(self) -> dict[str, Any]:
        state = self._state
        return {
            INFO_ANCHOR: state_anchor(state["facts"], state["score"]),
            INFO_ADMISSIBLE_ACTIONS: list(state["admissible_commands"]),
            INFO_WON: bool(state["won"]),
            "lost": bool(state["lost"]),
            INFO_TASK: state["objective"],
            "score": state["score"],
            "max_score": state["max_score"],
        }

    def _cached_game_file(self, settings: dict[str, Any], seed: int) -> Path:
        """The story file of the game, generated into the cache first if it is not there."""
        parameters = {"challenge": self.challenge, "settings": settings, "textworld": textworld.__version__}
        digest = hashlib.sha1(json.dumps(parameters, sort_keys=True).encode()).hexdigest()[:12]
        folder = self.cache_dir / f"{self.challenge}-{digest}-seed{seed}"
        if not folder.is_dir():
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = folder.parent / f".{folder.name}.{uuid.uuid4().hex}"
            staging.mkdir()
            try:
                _generate_game(self.challenge, settings, seed, staging / GAME_FILE_NAME)
                (staging / "parameters.json").write_text(json.dumps({**parameters, "seed": seed}, indent=2) + "\n")
                try:
                    staging.rename(folder)  # atomic: readers see no folder or a complete one
                except OSError:
                    if not folder.is_dir():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return folder / GAME_FILE_NAME


def _generate_game(challenge: str, settings: Mapping[str, Any], seed: int, game_file: Path) -> None:
    """Generate and compile a game as `tw-make` does, writing `game_file` and its siblings."""
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = str(game_file)
    if challenge == "custom":
        options.nb_rooms = settings["world_size"]
        options.nb_objects = settings["nb_objects"]
        options.quest_length = settings["quest_length"]
        options.chaining.max_breadth = 5  # tw-make's default
        game = textworld.generator.make_game(options)
    else:
        _, make_challenge_game, _ = textworld.challenges.CHALLENGES[f"tw-{challenge}"]
        game = make_challenge_game(dict(settings), options)
    textworld.generator.compile_game(game, options)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _checked_settings(challenge: str, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` updated with `overrides`, whose keys must be settings of `challenge`."""
    unknown = sorted(set(overrides) - set(DEFAULT_SETTINGS[challenge]), key=str)
    if unknown:
        raise ValueError(
            f"unknown settings {unknown} for the TextWorld challenge {challenge!r}; "
            f"known: {sorted(DEFAULT_SETTINGS[challenge])}"
        )
    settings = {**base, **overrides}
    for (choice_challenge, name), choices in _SETTING_CHOICES.items():
        if choice_challenge == challenge and settings[name] not in choices:
            raise ValueError(f"{challenge} setting {name} must be one of {choices}, got {settings[name]!r}")
    return settings
