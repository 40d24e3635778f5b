"""Small real environments for the contract, pool and checker tests."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import random
import string
import time
from pathlib import Path

import gymnasium


class Corridor:
    """Cells 0..L-1; start at 0, win at L-1. The seed sets L = 3 + seed % 4 (options: {"length": L}).
    The task type is the length: "corridor-L"."""

    def reset(self, *, seed=None, options=None):
        self.length = (options or {}).get("length", 3 + (seed or 0) % 4)
        self.position = 0
        return self._observation(), self._info()

    def step(self, action):
        if action == "right":
            self.position = min(self.position + 1, self.length - 1)
        elif action == "left":
            self.position = max(self.position - 1, 0)
        won = self.position == self.length - 1
        return self._observation(), 1.0 if won else 0.0, won, False, self._info()

    def close(self):
        pass

    def _observation(self):
        return f"You are in cell {self.position} of a corridor of {self.length} cells."

    def _info(self):
        return {"anchor": (self.length, self.position), "admissible_actions": ["left", "right"],
                "won": self.position == self.length - 1, "task": "Reach the last cell.",
                "task_type": f"corridor-{self.length}"}


class FragileCorridor(Corridor):
    """A corridor whose process fails for real on some actions."""

    def step(self, action):
        if action == "exit":
            os._exit(3)
        if action == "segfault":
            faulthandler.disable()  # a real crash, without the stack dump pytest's fault handler would print for it
            ctypes.string_at(0)
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise RuntimeError("the interpreter broke")
        if action == "unpicklable":
            return "obs", 0.0, False, False, {"handle": lambda: None}
        if action in ("nan", "inf"):
            return "obs", float(action), False, False, self._info()
        return super().step(action)


class FailingReset(Corridor):
    def reset(self, *, seed=None, options=None):
        raise OSError("game file missing")


class FailsToStart(Corridor):
    """A corridor whose reset fails the first `failures[seed]` times a seed is started (-1: every time), as an engine
    that cannot start under load. Starts are counted in `attempts_dir`, so that the count outlives the environment
    (the pool replaces a failed one with a fresh environment in a fresh process)."""

    def __init__(self, attempts_dir, failures):
        self.attempts_dir, self.failures = Path(attempts_dir), failures

    def reset(self, *, seed=None, options=None):
        with open(self.attempts_dir / f"seed-{seed}", "a+") as starts:
            starts.write(".")
            attempt = starts.tell()
        failures = self.failures.get(seed, 0)
        if failures < 0 or attempt <= failures:
            raise OSError(f"the engine of seed {seed} did not start (attempt {attempt})")
        return super().reset(seed=seed, options=options)


class UnseededCorridor(Corridor):
    """Ignores its seed: the start cell is random, and never the same in two resets in a row (so that a
    determinism check of two resets always sees the bug, instead of missing it by chance)."""

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        previous = getattr(self, "_previous_start", None)
        self.position = random.SystemRandom().choice([cell for cell in range(self.length - 1) if cell != previous])
        self._previous_start = self.position
        return self._observation(), self._info()


class GuessTheNumber(gymnasium.Env):
    """A gymnasium environment with text observations and text actions."""

    observation_space = gymnasium.spaces.Text(max_length=200, charset=string.printable)
    action_space = gymnasium.spaces.Text(max_length=20, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, 10))
        return "Guess a number from 1 to 9.", {"anchor": "start", "admissible_actions": [str(k) for k in range(1, 10)]}

    def step(self, action):
        guess = int(action) if action.strip().isdigit() else 0
        won = guess == self.secret
        hint = "right" if won else ("too low" if guess < self.secret else "too high")
        info = {"anchor": ("after", guess), "admissible_actions": [str(k) for k in range(1, 10)], "won": won}
        return f"{guess} is {hint}.", 10.0 if won else 0.0, won, False, info


class BadAnchorOnRank1(Corridor):
    """On the process of rank 1 of a distributed run, its anchors are lists (unhashable): that process alone
    raises when its copies start, as any bug of one process might."""

    def _info(self):
        info = super()._info()
        if os.environ.get("RANK") == "1":
            info["anchor"] = list(info["anchor"])
        return info


class FailsOnStep(Corridor):
    """A corridor whose every step raises (a service it calls is down): every trajectory fails at its first step."""

    def step(self, action):
        raise ConnectionError("the corridor's service is down")


class UnwinnableOnRank1(Corridor):
    """On the process of rank 1 of a distributed run, every corridor is 40 cells long, whatever its task: no copy
    finishes one within a short step limit, so that process's task groups carry no signal, in every round."""

    def reset(self, *, seed=None, options=None):
        if os.environ.get("RANK") == "1":
            options = {**(options or {}), "length": 40}
        return super().reset(seed=seed, options=options)



class GrowingLog(Corridor):
    """A corridor whose observation is a log that grows by `words` words at every step (a long game transcript, a
    tool's ever longer output): its prompts outgrow any context, sooner or later."""

    words = 40

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        return super().step(action)

    def _observation(self):
        log = " ".join(f"entry{k % 10}" for k in range(self.words * getattr(self, "steps", 0)))
        return f"{super()._observation()} Log: {log}"
