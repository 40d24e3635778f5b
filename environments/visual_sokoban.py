"""Visual Sokoban: the shipped Sokoban (`sokoban.py`: the same rooms, moves, rewards and seeds) seen as a picture,
as in the GiGPO paper's VLM experiments (verl-agent's visual Sokoban: a 96x96 rendering of the room).

Observation: a PIL image (RGB) of the room, `tile_size` pixels a cell (a 6x6 room at the default 16 pixels is
96x96), drawn with PIL alone (no sprites to download):

    wall            dark grey           target          floor with a red ring
    floor           light grey          box             brown square
    player          blue disc           box on target   green square
    (player on a target: the blue disc in the red ring)

`info` is Sokoban's, its `anchor` the room state as the text variant writes it: the same room gives the same anchor
in both variants, so the step groups of the picture are exactly those of the text (and a pixel-for-pixel copy of a
room is never needed to group steps). `info["grid"]` holds that text too, for people and logs.
"""

from __future__ import annotations

from typing import Any

from gigpo_trl.environments.sokoban import (
    ACTIONS, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET, TARGET, WALL, SokobanEnv,
)
from gigpo_trl.envs import INFO_TASK
from gigpo_trl.prompts import PromptTemplate

COLORS = {
    "wall": (64, 64, 64),
    "floor": (200, 200, 200),
    "target": (220, 40, 40),
    "box": (150, 90, 30),
    "box_on_target": (40, 170, 60),
    "player": (40, 80, 220),
}

TASK = (
    "Sokoban: push every box onto a target. You push a box by walking into it; boxes cannot be pulled, and a box "
    "cannot be pushed into a wall or into another box. "
    f"Actions: {', '.join(ACTIONS)}. "
    "In the picture: dark grey walls, light grey floor, red rings are targets, brown squares are boxes, green squares "
    "are boxes on a target, the blue disc is you."
)

# The default wording of visual Sokoban's step prompts (registered with the name "visual_sokoban"): the picture
# stands where the text variant shows its grid.
PROMPT_TEMPLATE = PromptTemplate(
    system="You are solving a Sokoban puzzle: push every box onto a target. Boxes can be pushed but never pulled.",
    current="Current room (step {step}):\n{observation}",
)


class VisualSokobanEnv(SokobanEnv):
    """Sokoban whose observation is a picture of the room (module docstring); every other argument and behaviour is
    `SokobanEnv`'s.

    Args:
        tile_size: pixels per cell side, at least 6.
        dim_room, num_boxes, max_steps: as `SokobanEnv`.
    """

    def __init__(self, *, tile_size: int = 16, **kwargs: Any) -> None:
        if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 6:
            raise ValueError(f"tile_size must be an int >= 6 (pixels a cell), got {tile_size!r}")
        super().__init__(**kwargs)
        self.tile_size = tile_size

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        grid, info = super()._reset(seed, options)
        return self._draw(grid), self._visual_info(grid, info)

    def _step(self, action: str) -> tuple[Any, float, bool, dict[str, Any]]:
        grid, reward, terminated, info = super()._step(action)
        return self._draw(grid), reward, terminated, self._visual_info(grid, info)

    def _visual_info(self, grid: str, info: dict[str, Any]) -> dict[str, Any]:
        return {**info, INFO_TASK: TASK, "grid": grid}

    def _draw(self, grid: str) -> Any:
        """The picture of a grid in the text variant's symbols."""
        from PIL import Image, ImageDraw

        rows = [line.split(" ") for line in grid.split("\n")]
        size = self.tile_size
        image = Image.new("RGB", (len(rows[0]) * size, len(rows) * size), COLORS["floor"])
        draw = ImageDraw.Draw(image)
        inset, ring = max(1, size // 8), max(1, size // 8)
        for r, row in enumerate(rows):
            for c, symbol in enumerate(row):
                left, top = c * size, r * size
                cell = (left, top, left + size - 1, top + size - 1)
                inner = (left + inset, top + inset, left + size - 1 - inset, top + size - 1 - inset)
                if symbol == WALL:
                    draw.rectangle(cell, fill=COLORS["wall"])
                if symbol in (TARGET, PLAYER_ON_TARGET):
                    draw.ellipse(inner, outline=COLORS["target"], width=ring)
                if symbol == BOX:
                    draw.rectangle(inner, fill=COLORS["box"])
                if symbol == BOX_ON_TARGET:
                    draw.rectangle(inner, fill=COLORS["box_on_target"])
                if symbol in (PLAYER, PLAYER_ON_TARGET):
                    middle = (left + 2 * inset, top + 2 * inset, left + size - 1 - 2 * inset, top + size - 1 - 2 * inset)
                    draw.ellipse(middle, fill=COLORS["player"])
        return image
