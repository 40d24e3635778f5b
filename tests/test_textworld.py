"""TextWorldEnv on real TextWorld games: seeded games cached on disk, exact anchors, clean text, safe commands."""

from __future__ import annotations

import multiprocessing
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import textworld
from hypothesis import given
from hypothesis import strategies as st

from gigpo_trl.environments.textworld_games import (
    EMPTY_COMMAND_FEEDBACK,
    MAX_COMMAND_LENGTH,
    TextWorldEnv,
    default_cache_dir,
    sanitize_command,
    state_anchor,
)
from gigpo_trl.envs import make_env

# jericho warns that it has no bindings for TextWorld's games (TextWorld silences that outside pytest).
pytestmark = pytest.mark.filterwarnings("ignore::jericho.UnsupportedGameWarning")

OPPOSITE_DIRECTIONS = {"north": "south", "south": "north", "east": "west", "west": "east"}


@dataclass(frozen=True)
class Game:
    """A game of this file: the environment's constructor arguments, and the seed and options of `reset`."""

    settings: dict[str, Any]
    seed: int
    options: dict[str, Any] | None = None


CUSTOM_SETTINGS = {"world_size": 3, "nb_objects": 4, "quest_length": 2}
GAMES = {
    "treasure_hunter": Game(settings={}, seed=3),  # the default game: go west, take the broom
    "cooking": Game(settings={"challenge": "cooking", "recipe": 1, "take": 1}, seed=1),  # fetch milk, cook, eat
    "custom": Game(settings={"challenge": "custom"}, seed=1, options=CUSTOM_SETTINGS),  # go east, close the bureau
}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding every game of GAMES, generated once per test run."""
    cache = tmp_path_factory.mktemp("textworld-cache")
    for game in GAMES.values():
        env = TextWorldEnv(cache_dir=cache, **game.settings)
        env.reset(seed=game.seed, options=game.options)
        env.close()
    return cache


@dataclass
class Started:
    """An environment just reset on one of GAMES, what the reset returned, and the game's walkthrough."""

    env: TextWorldEnv
    observation: str
    info: dict[str, Any]
    walkthrough: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.walkthrough = self.env.walkthrough


@pytest.fixture
def start(cache_dir: Path):
    """start(name="treasure_hunter", **env_kwargs): a new environment reset on the game GAMES[name]."""
    envs = []

    def _start(name: str = "treasure_hunter", **env_kwargs: Any) -> Started:
        game = GAMES[name]
        env = TextWorldEnv(cache_dir=cache_dir, **game.settings, **env_kwargs)
        envs.append(env)
        return Started(env, *env.reset(seed=game.seed, options=game.options))

    yield _start
    for env in envs:
        env.close()


def game_folders(cache: Path) -> list[Path]:
    """Everything in a cache folder, hidden staging folders included."""
    return sorted(cache.iterdir())


def outcome(step: tuple) -> tuple:
    """What a step returned that the agent and GiGPO see: observation, reward, terminated, truncated, anchor;
    the turn count of the final "You scored 1 out of a possible 1, in 3 turns." aside (a "look" takes a turn)."""
    observation, reward, terminated, truncated, info = step
    return re.sub(r"in \d+ turns?\.", "in N turns.", observation), reward, terminated, truncated, info["anchor"]


def play(env: TextWorldEnv, commands: list[str]) -> list[tuple]:
    """The outcomes of stepping `commands` in turn."""
    return [outcome(env.step(command)) for command in commands]


def first_observation_in_this_process(cache: str) -> tuple[str, str]:
    """The default game's first observation and anchor, generated into `cache` if needed (runs in a worker)."""
    env = TextWorldEnv(cache_dir=cache)
    observation, info = env.reset(seed=GAMES["treasure_hunter"].seed)
    env.close()
    return observation, info["anchor"]


# --------------------------------------------------------------------------------------------
# Winning, losing, rewards
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GAMES)
def test_following_the_walkthrough_wins_with_rewards_summing_to_the_max_score(start, name: str) -> None:
    game = start(name)
    assert game.info["score"] == 0 and not game.info["won"] and game.info["max_score"] >= 1

    rewards = []
    for t, command in enumerate(game.walkthrough):
        observation, reward, terminated, truncated, info = game.env.step(command)
        rewards.append(reward)
        last = t == len(game.walkthrough) - 1
        assert terminated == last and info["won"] == last and not info["lost"] and not truncated

    assert sum(rewards) == info["max_score"] == info["score"]
    assert "*** The End ***" in observation


def test_the_reward_is_the_score_difference_of_the_step(start) -> None:
    game = start("cooking")  # 1 point for taking the ingredient, 1 for preparing the meal, 1 for eating it

    rewards = [game.env.step(command)[1] for command in game.walkthrough]

    assert rewards == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_eating_an_ingredient_loses(start) -> None:
    game = start("cooking")
    take_the_ingredient = next(c for c in game.walkthrough if c.startswith("take "))  # "take milk from fridge"
    game.env.step(take_the_ingredient)

    observation, reward, terminated, truncated, info = game.env.step("eat " + take_the_ingredient.split(" ")[1])

    assert terminated and info["lost"] and not info["won"] and reward == 0.0
    assert "*** You lost! ***" in observation


@pytest.mark.parametrize("name", GAMES)
def test_admissible_actions_pass_the_sanitizer_unchanged(start, name: str) -> None:
    game = start(name)
    admissible = [game.info["admissible_actions"]]
    for command in game.walkthrough[:-1]:
        admissible.append(game.env.step(command)[4]["admissible_actions"])

    for actions in admissible:
        assert actions and all(isinstance(a, str) and sanitize_command(a) == a for a in actions)


# --------------------------------------------------------------------------------------------
# Anchors
# --------------------------------------------------------------------------------------------


def test_going_to_a_room_and_coming_back_returns_to_the_initial_anchor(start) -> None:
    game = start()
    go_there = game.walkthrough[0]  # "go west"
    come_back = "go " + OPPOSITE_DIRECTIONS[go_there.split()[1]]

    there = game.env.step(go_there)[4]["anchor"]
    back = game.env.step(come_back)[4]["anchor"]

    assert there != game.info["anchor"]
    assert back == game.info["anchor"]


def test_looking_around_keeps_the_anchor_although_the_move_counter_advances(start) -> None:
    game = start()
    anchors = {game.info["anchor"]}
    for command in ["look", "inventory", "look", "examine the ceiling", "dance"]:
        anchors.add(game.env.step(command)[4]["anchor"])

    assert anchors == {game.info["anchor"]}


@pytest.mark.parametrize("name", GAMES)
def test_every_acting_step_of_the_walkthrough_reaches_a_new_anchor(start, name: str) -> None:
    game = start(name)
    anchors = [game.info["anchor"]]
    for command in game.walkthrough:
        anchor = game.env.step(command)[4]["anchor"]
        if command.startswith(("inventory", "examine")):  # the cooking walkthrough reads the cookbook first
            assert anchor == anchors[-1]
        else:
            assert anchor not in anchors
            anchors.append(anchor)

    assert all(re.fullmatch(r"[0-9a-f]{40}", anchor) for anchor in anchors)  # sha1 hex: small and cheap to send


def test_the_anchor_covers_the_facts_in_any_order_and_the_score() -> None:
    facts = ["at(P, kitchen: r)", "closed(chest drawer: c)"]

    assert state_anchor(facts, 0) == state_anchor(reversed(facts), 0)
    assert state_anchor(facts, 0) != state_anchor(facts, 1)  # a quest's points are paid once
    assert state_anchor(facts, 0) != state_anchor(facts[:1], 0)


# --------------------------------------------------------------------------------------------
# Seeds, options and the cache
# --------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_initial_observation_and_anchor_across_instances(start) -> None:
    first, second = start(), start()

    assert (first.observation, first.info["anchor"]) == (second.observation, second.info["anchor"])
    assert first.env.reset(seed=GAMES["treasure_hunter"].seed) == (first.observation, first.info)


def test_a_second_reset_reads_the_game_from_the_cache(start, cache_dir: Path) -> None:
    folders = game_folders(cache_dir)
    story_files = {path: path.stat().st_mtime_ns for path in cache_dir.glob("*/game.z8")}

    start()
    start("custom")

    assert game_folders(cache_dir) == folders  # nothing generated, no staging folder left
    assert {path: path.stat().st_mtime_ns for path in cache_dir.glob("*/game.z8")} == story_files


def test_the_cache_has_one_folder_per_game_named_by_challenge_settings_hash_and_seed(cache_dir: Path) -> None:
    names = [folder.name for folder in game_folders(cache_dir) if not folder.name.startswith(".")]

    for name, game in GAMES.items():
        challenge = game.settings.get("challenge", "treasure_hunter")
        matching = [n for n in names if re.fullmatch(rf"{challenge}-[0-9a-f]{{12}}-seed{game.seed}", n)]
        assert len(matching) == 1, (name, names)
        assert {"game.z8", "game.json", "parameters.json"} <= {p.name for p in (cache_dir / matching[0]).iterdir()}


def test_resetting_the_same_game_keeps_the_running_interpreter(cache_dir: Path, monkeypatch) -> None:
    started_games = []
    real_start = textworld.start
    monkeypatch.setattr(textworld, "start", lambda *a, **k: started_games.append(a[0]) or real_start(*a, **k))
    env = TextWorldEnv(cache_dir=cache_dir)

    for _ in range(3):
        env.reset(seed=GAMES["treasure_hunter"].seed)
        env.step("look")
    env.close()

    assert len(started_games) == 1


def test_options_override_the_constructor_settings_for_the_episode(start, cache_dir: Path) -> None:
    folders = game_folders(cache_dir)
    by_options = start("custom")  # TextWorldEnv(challenge="custom").reset(seed, options=CUSTOM_SETTINGS)
    by_constructor = TextWorldEnv(cache_dir=cache_dir, challenge="custom", **CUSTOM_SETTINGS)

    observation, info = by_constructor.reset(seed=GAMES["custom"].seed)
    by_constructor.close()

    assert (observation, info["anchor"]) == (by_options.observation, by_options.info["anchor"])
    assert game_folders(cache_dir) == folders


def test_a_seedless_reset_plays_a_drawn_seed_that_info_reports_reproducibly(start) -> None:
    first, second = start(), start()

    drawn = first.env.reset()
    drawn_again = second.env.reset()

    assert first.info["seed"] == GAMES["treasure_hunter"].seed
    assert drawn[1]["seed"] == drawn_again[1]["seed"] != first.info["seed"]
    assert drawn == drawn_again
    assert drawn[0] != first.observation  # another seed, another game


def test_concurrent_processes_generating_the_same_game_share_one_complete_copy(start, cache_dir, tmp_path) -> None:
    reference = start()
    (reference_story_file,) = cache_dir.glob(f"treasure_hunter-*-seed{GAMES['treasure_hunter'].seed}/game.z8")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(first_observation_in_this_process, [str(tmp_path)] * 2)

    assert results == [(reference.observation, reference.info["anchor"])] * 2
    (folder,) = game_folders(tmp_path)  # one game, no staging folder left behind
    assert (folder / "game.z8").read_bytes() == reference_story_file.read_bytes()  # generated alike, byte for byte


def test_the_default_cache_follows_the_environment_variables(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GIGPO_TRL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "gigpo_trl" / "textworld"

    monkeypatch.setenv("GIGPO_TRL_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" / "textworld"


# --------------------------------------------------------------------------------------------
# Observations
# --------------------------------------------------------------------------------------------


def test_the_first_observation_is_the_objective_and_the_room_without_banner_or_status_line(start) -> None:
    game = start()

    assert game.observation.startswith(game.info["task"])
    assert re.search(r"^-= .+ =-$", game.observation, re.MULTILINE)  # the room's heading stays
    assert "$$" not in game.observation and "___" not in game.observation  # the ASCII-art title
    assert not re.search(r"^>|=-\s*\d+/\d+", game.observation, re.MULTILINE)  # prompt and "-= Room =-0/1"
    assert "\n\n\n" not in game.observation and game.observation == game.observation.strip()


def test_the_last_observation_ends_with_the_score_not_the_restart_question(start) -> None:
    game = start()
    for command in game.walkthrough:
        observation = game.env.step(command)[0]

    assert observation.endswith("You scored 1 out of a possible 1, in 3 turns.")
    assert "RESTART" not in observation and not re.search(r"^>", observation, re.MULTILINE)


# --------------------------------------------------------------------------------------------
# Hazardous commands
# --------------------------------------------------------------------------------------------

HAZARDS = {
    "nul byte": "look\x00",
    "leading backslash": "\\look",
    "lone backslash": "\\",
    "embedded newline": "look\ngo east",  # east of the default game's first room is another room
    "5000 characters": "x" * 5000,
    "non-ASCII": "regarde la clé 🗝️ 看",
    "control characters": "\x1b[A\x07\x08",
    "empty": "",
    "blank": " \t ",
    "restart": "restart",
    "quit": "quit",
    "save": "save",
    "restore": "restore",
    "transcript": "script",
    "chained restart": "look. restart",
    "display mode": "superbrief",
}


@pytest.mark.timeout(60, method="thread")  # a hang inside the C interpreter can only be stopped from another thread
@pytest.mark.parametrize("action", HAZARDS.values(), ids=HAZARDS.keys())
def test_a_hazardous_action_neither_crashes_nor_hangs_and_the_game_plays_on(start, action, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where save and script would write their files
    reference, game = start(), start()

    observation, reward, terminated, truncated, info = game.env.step(action)

    assert isinstance(observation, str) and observation
    assert reward == 0.0 and not terminated and not truncated
    assert info["anchor"] == game.info["anchor"]
    # The interpreter and TextWorld's tracking of it still agree: the walkthrough plays exactly as in a fresh game.
    assert play(game.env, game.walkthrough) == play(reference.env, reference.walkthrough)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("separator", [". ", ", ", " then ", "\n"])
def test_of_several_commands_in_one_action_only_the_first_runs(start, separator: str) -> None:
    reference, game = start(), start()
    go_there, *rest = reference.walkthrough
    come_back = "go " + OPPOSITE_DIRECTIONS[go_there.split()[1]]

    chained = game.env.step(go_there + separator + come_back)

    assert outcome(chained) == outcome(reference.env.step(go_there))
    assert play(game.env, ["look", *rest]) == play(reference.env, ["look", *rest])


def test_an_empty_command_is_a_normal_step_that_changes_nothing(start) -> None:
    game = start(max_steps=1)

    observation, reward, terminated, truncated, info = game.env.step("")

    assert (observation, reward, terminated, truncated) == (EMPTY_COMMAND_FEEDBACK, 0.0, False, True)
    assert {k: info[k] for k in ("anchor", "admissible_actions", "score")} == {
        k: game.info[k] for k in ("anchor", "admissible_actions", "score")
    }


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("go west", "go west"),
        ("  Go   West  ", "Go West"),
        ("go\teast", "go east"),
        ("go west\ntake broom", "go west"),
        ("go west\r\ntake broom", "go west"),
        ("\ngo west", ""),
        ("look\x00", "look"),
        ("\x00", ""),
        ("\\look", "look"),
        ("lo\\ok", "lo ok"),
        ("take clé", "take cl"),
        ("take coin. go east", "take coin"),
        ("take coin, go east", "take coin"),
        ("take coin then go east", "take coin"),
        ("take coin THEN go east", "take coin"),
        ("Take the coin.", "Take the coin"),
        ("examine thenardier", "examine thenardier"),
        ("x" * 5000, "x" * MAX_COMMAND_LENGTH),
        ("restart", ""),
        ("RESTART.", ""),
        ("q", ""),
        ("save game", ""),
        ("script on", ""),
        ("undo", ""),
        ("verbose", ""),
        ("look. restart", "look"),
        ("take quilt", "take quilt"),
        ("", ""),
        (" \t ", ""),
    ],
)
def test_sanitize_command(text: str, command: str) -> None:
    assert sanitize_command(text) == command


@given(st.text())
def test_a_sanitized_command_is_one_short_printable_line_and_sanitizing_again_changes_nothing(text: str) -> None:
    command = sanitize_command(text)

    assert set(command) <= set(string.printable) - set(string.whitespace[1:]) - {"\\"}
    assert len(command) <= MAX_COMMAND_LENGTH and command == command.strip()
    assert sanitize_command(command) == command


# --------------------------------------------------------------------------------------------
# The contract, steps and arguments
# --------------------------------------------------------------------------------------------

def test_make_env_builds_it_by_name(cache_dir: Path) -> None:
    env = make_env("textworld", cache_dir=cache_dir)

    assert isinstance(env, TextWorldEnv) and env.challenge == "treasure_hunter" and env.settings == {"level": 3}


def test_max_steps_truncates_at_that_step_and_stepping_on_raises(start) -> None:
    game = start(max_steps=2)

    assert game.env.step("look")[3] is False
    assert game.env.step("look")[3] is True
    with pytest.raises(RuntimeError, match="call reset"):
        game.env.step("look")
    game.env.reset(seed=GAMES["treasure_hunter"].seed)
    assert game.env.step("look")[3] is False


def test_stepping_after_the_game_ended_raises_until_reset(start) -> None:
    game = start()
    for command in game.walkthrough:
        game.env.step(command)

    with pytest.raises(RuntimeError, match="episode has ended"):
        game.env.step("look")


def test_stepping_before_reset_or_after_close_raises(start) -> None:
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        TextWorldEnv().step("look")
    game = start()
    game.env.close()
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        game.env.step("look")


def test_an_action_that_is_not_text_raises_type_error(start) -> None:
    with pytest.raises(TypeError, match="action must be a str"):
        start().env.step(3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"challenge": "zork"}, r"unknown TextWorld challenge 'zork'; known: \['coin_collector', 'cooking'"),
        ({"levle": 2}, r"unknown settings \['levle'\] for the TextWorld challenge 'treasure_hunter'; known: \['level'"),
        ({"challenge": "custom", "level": 2}, r"unknown settings \['level'\] for the TextWorld challenge 'custom'"),
        ({"challenge": "simple", "rewards": "often"}, r"rewards must be one of \('dense', 'balanced', 'sparse'\)"),
        ({"max_steps": 0}, "max_steps must be None or an int >= 1"),
    ],
)
def test_bad_constructor_arguments_raise_value_errors_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TextWorldEnv(**kwargs)


@pytest.mark.parametrize(
    ("reset_kwargs", "message"),
    [
        ({"seed": 3, "options": {"level": 3, "nb_rooms": 4, "doors": 1}}, r"unknown settings \['doors', 'nb_rooms'\]"),
        ({"seed": 3, "options": ["level"]}, "options must be None or a dict"),
        ({"seed": -1}, r"seed must be None or an int in \[0, 2\*\*32\)"),
        ({"seed": 2**32}, r"seed must be None or an int in \[0, 2\*\*32\)"),
        ({"seed": 1.5}, r"seed must be None or an int in \[0, 2\*\*32\)"),
        ({"seed": True}, r"seed must be None or an int in \[0, 2\*\*32\)"),
    ],
)
def test_bad_reset_arguments_raise_value_errors_naming_them(reset_kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        TextWorldEnv(cache_dir=tmp_path).reset(**reset_kwargs)
    assert not any(tmp_path.iterdir())  # nothing generated
