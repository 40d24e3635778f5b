"""Where gigpo-trl keeps what it generates once and reuses (TextWorld games, the converted embedded model)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "GIGPO_TRL_CACHE"


def cache_root() -> Path:
    """`$GIGPO_TRL_CACHE` when set, else `$XDG_CACHE_HOME/gigpo_trl`, else `~/.cache/gigpo_trl`."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gigpo_trl"
