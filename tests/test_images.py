"""Image observations: the contract (`gigpo_trl.observations`, `check_env`, the pool), visual Sokoban, the prompts
that carry images, and a tiny LLaVA-style model (`build_tiny_vlm`, built offline) that generates from them and is
trained on each step's own images."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
import torch
from PIL import Image
from tiny_qwen2_vl import build_tiny_qwen2_vl
from trainer_helpers import cpu_config
from trl.trainer.utils import split_pixel_values_by_grid

from gigpo_trl import GiGPOTrainer, task_dataset
from gigpo_trl.batch import loss_batch
from gigpo_trl.observations import PER_TOKEN_IMAGE_KEYS
from gigpo_trl.dialogue import Exchange, TextDialogue
from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.env_checker import EnvCheckError, check_env
from gigpo_trl.env_pool import INFO_ENV_ERROR, EnvPool
from gigpo_trl.environments.sokoban import SokobanEnv
from gigpo_trl.environments.visual_sokoban import VisualSokobanEnv
from gigpo_trl.envs import EnvOutput, env_factory
from gigpo_trl.loss import row_chunks
from gigpo_trl.models import build_tiny_vlm
from gigpo_trl.observations import (
    IMAGE_MARKER, content_blocks, image_digest, message_images, observation_key, readable, split_observation,
)
from gigpo_trl.parsing import ParsedAction
from gigpo_trl.tasks import Task


def picture(color: tuple[int, int, int], size: int = 8) -> Image.Image:
    return Image.new("RGB", (size, size), color)


# ---------------------------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------------------------


def test_observations_split_into_text_with_markers_and_images() -> None:
    red, blue = picture((255, 0, 0)), picture((0, 0, 255))
    assert split_observation("a room") == ("a room", ())
    assert split_observation(red) == (IMAGE_MARKER, (red,))
    text, images = split_observation([{"type": "text", "text": "before"}, {"type": "image", "image": red},
                                      {"type": "image", "image": blue}, {"type": "text", "text": "after"}])
    assert text == f"before\n{IMAGE_MARKER}\n{IMAGE_MARKER}\nafter" and images == (red, blue)
    assert readable(text, images) == "before\n[image 8x8]\n[image 8x8]\nafter"


@pytest.mark.parametrize("observation, named", [
    ({"text": "a dict"}, "it must be a str, a PIL image, or a list of content blocks"),
    ([{"type": "audio", "audio": b""}], "block 0: a content block is"),
    ([{"type": "image", "image": "not an image"}], "block 0: a content block is"),
    (f"a {IMAGE_MARKER} in text", "U+FFFC"),
    (Image.new("RGB", (0, 4)), "an empty image (0x4)"),
])
def test_an_observation_that_does_not_fit_is_refused_by_name(observation, named: str) -> None:
    with pytest.raises((TypeError, ValueError), match=re.escape(named)):
        split_observation(observation)


def test_an_image_key_is_its_pixels() -> None:
    first, same, other = picture((10, 20, 30)), picture((10, 20, 30)), picture((10, 20, 30))
    other.putpixel((7, 7), (10, 20, 31))
    assert image_digest(first) == image_digest(same) != image_digest(other)
    assert observation_key(IMAGE_MARKER, (first,)) == observation_key(IMAGE_MARKER, (same,))
    assert observation_key(IMAGE_MARKER, (first,)) != observation_key(IMAGE_MARKER, (other,))
    assert observation_key("text", ()) == "text"
    assert EnvOutput(IMAGE_MARKER, images=(first,)).anchor == EnvOutput(IMAGE_MARKER, images=(same,)).anchor
    assert EnvOutput(IMAGE_MARKER, info={"anchor": "s"}, images=(first,)).anchor == "s"  # the environment's own wins


def test_content_blocks_put_each_image_at_its_marker_and_refuse_a_mismatch() -> None:
    red, blue = picture((255, 0, 0)), picture((0, 0, 255))
    assert content_blocks("plain text", ()) == "plain text"
    blocks = content_blocks(f"past: {IMAGE_MARKER}\nnow: {IMAGE_MARKER}", (red, blue))
    assert blocks == [{"type": "text", "text": "past: "}, {"type": "image", "image": red},
                      {"type": "text", "text": "\nnow: "}, {"type": "image", "image": blue}]
    assert message_images([{"role": "user", "content": blocks}]) == [red, blue]
    with pytest.raises(ValueError, match="2 image places for 1 images"):
        content_blocks(f"{IMAGE_MARKER} {IMAGE_MARKER}", (red,))


class NoisyPicture(BaseTextEnv):
    """Its reset draws a new picture whatever the seed: not deterministic."""

    def _reset(self, seed, options):
        return picture((random.randrange(256), 0, 0)), {}

    def _step(self, action):
        return picture((0, 0, 0)), 0.0, True, {}


class DictObservation(BaseTextEnv):
    def _reset(self, seed, options):
        return "start", {}

    def _step(self, action):
        return {"pixels": [0, 1]}, 0.0, False, {}


def test_check_env_takes_visual_sokoban_and_names_what_does_not_fit() -> None:
    check_env(VisualSokobanEnv(max_steps=10))
    with pytest.raises(EnvCheckError, match="not deterministic"):
        check_env(NoisyPicture())
    with pytest.raises(EnvCheckError, match=r"step\('look'\)'s observation is a dict"):
        check_env(DictObservation())


def test_visual_sokoban_is_the_text_game_drawn_with_the_same_anchors() -> None:
    text, visual = SokobanEnv(max_steps=20), VisualSokobanEnv(max_steps=20, tile_size=8)
    rng = random.Random(0)
    observation, info = visual.reset(seed=7)
    grid, text_info = text.reset(seed=7)
    assert observation.size == (6 * 8, 6 * 8) and info["anchor"] == text_info["anchor"] == grid == info["grid"]
    pictures = {image_digest(observation)}
    for _ in range(12):
        action = rng.choice(["up", "down", "left", "right"])
        observation, reward, terminated, truncated, info = visual.step(action)
        grid, text_reward, *_, text_info = text.step(action)
        assert (info["anchor"], reward) == (text_info["anchor"], text_reward)
        pictures.add(image_digest(observation))
        if terminated or truncated:
            break
    assert len(pictures) > 1  # moves change the picture
    with pytest.raises(ValueError, match="tile_size"):
        VisualSokobanEnv(tile_size=5)


def test_the_pool_carries_images_and_isolates_a_bad_observation() -> None:
    with EnvPool(env_factory("visual_sokoban", max_steps=5), num_groups=1, group_size=2) as pool:
        outputs = pool.reset([Task(3, None)])
        assert outputs[0].observation == IMAGE_MARKER and outputs[0].images[0].size == (96, 96)
        assert outputs[0].anchor == outputs[1].anchor
        stepped = pool.step({0: "up", 1: "down"})
        assert all(len(output.images) == 1 for output in stepped.values())
    with pytest.warns(UserWarning, match="observation is a dict"), EnvPool(DictObservation, 1, 1) as pool:
        pool.reset([Task(0, None)])
        failed = pool.step({0: "look"})[0]
    assert failed.truncated and "step()'s observation is a dict" in failed.info[INFO_ENV_ERROR]


def test_a_windowed_prompt_shows_the_past_image_then_the_current_one() -> None:
    past, now = picture((255, 0, 0)), picture((0, 255, 0))
    start = EnvOutput(IMAGE_MARKER, images=(past,))
    current = EnvOutput(IMAGE_MARKER, images=(now,))
    exchange = Exchange(EnvOutput(IMAGE_MARKER, images=(past,)), ParsedAction("up", True), current, None)
    messages = TextDialogue(history_length=1).prompt(start, current, [exchange], step=1)
    assert message_images(messages) == [past, now]
    assert message_images(TextDialogue(history_length=0).prompt(start, current, [exchange], step=1)) == [now]
    with pytest.raises(ValueError, match="conversation mode .* does not take image observations"):
        TextDialogue(history_length=None).prompt(start, start, [], step=0)


def test_row_chunks_keep_each_rows_images_with_it() -> None:
    pixels = torch.arange(5.0).view(5, 1, 1, 1)  # rows with 2, 0, 1, 2 images
    inputs = {"prompt_ids": torch.zeros(4, 3), "pixel_values": pixels, "num_images": [2, 0, 1, 2],
              "image_sizes": torch.arange(10).view(5, 2), "num_items_in_batch": torch.tensor(7)}
    chunks = row_chunks(inputs, 2)
    assert [chunk["num_images"] for chunk in chunks] == [[2, 0], [1, 2]]
    assert [chunk["pixel_values"].flatten().tolist() for chunk in chunks] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    assert chunks[1]["image_sizes"].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert all(chunk["num_items_in_batch"] is inputs["num_items_in_batch"] for chunk in chunks)


# ---------------------------------------------------------------------------------------------------------------
# The tiny vision-language model
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm_path(tmp_path_factory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm")))


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> tuple[str, Any]:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(params=["llava", "qwen2_vl"])
def vision_model(request, tiny_vlm_path) -> tuple[str, Any]:
    """(model folder, processing_class or None): the LLaVA-style model (one row of pixels per image) and Qwen2-VL
    (pixels per patch with `image_grid_thw`, multi-axis rotary positions, a per-token `mm_token_type_ids`)."""
    return (tiny_vlm_path, None) if request.param == "llava" else request.getfixturevalue("tiny_qwen2_vl")


def test_a_text_model_is_refused_image_observations_by_name_before_any_rollout(tmp_path, tiny_model_path) -> None:
    with pytest.raises(ValueError, match="returned image observations, but the model reads text only"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, env_name="visual_sokoban", max_env_steps=2),
                     train_dataset=task_dataset(range(8)))


def row_image_inputs(batch: dict[str, Any], row: int) -> dict[str, Any]:
    """One row's image inputs out of a batch, by TRL's own per-row split (`split_pixel_values_by_grid`)."""
    by_row = split_pixel_values_by_grid(batch)
    inputs = {key: by_row[key][row] for key in ("pixel_values", "image_grid_thw", "image_sizes") if key in by_row}
    inputs |= {key: batch[key][row:row + 1] for key in PER_TOKEN_IMAGE_KEYS if key in batch}
    return inputs | {"num_images": [batch["num_images"][row]]}


def test_every_forward_pass_reads_each_step_samples_own_images(tmp_path, vision_model) -> None:
    """A rollout of visual Sokoban (2 tasks x 2 copies, a window of 1: prompts of 1 or 2 pictures): each row of the
    update's batch holds the pixels the processor makes of that step's own prompt, and the update's chunked forward
    gives each row the log-probs of that row forwarded alone with its images (a neighbour's images change them). The
    packed update and the prefix cache are off, each named."""
    model, processing_class = vision_model
    with pytest.warns(UserWarning) as warned:
        trainer = GiGPOTrainer(model, args=cpu_config(tmp_path, env_name="visual_sokoban", history_length=1,
                                                      max_env_steps=3, max_completion_length=4),
                               train_dataset=task_dataset(range(8)), processing_class=processing_class)
    messages = [str(warning.message) for warning in warned]
    assert any("packed_update is off for this model" in m and "multimodal" in m for m in messages)
    assert any("generation_prefix_cache is off" in m and "multimodal" in m for m in messages)
    assert not trainer._packed_update and trainer.turns.prefix_cache is None
    pool = trainer._pool("train", 2, 2)
    rollout = trainer._play(pool, [Task(1, None), Task(2, None)], greedy=False)
    trainer.close_environments()
    steps = rollout.steps
    completions = steps.completion
    assert {len(message_images(prompt)) for prompt in steps.prompt} == {1, 2}
    batch = loss_batch(trainer, completions, [1.0] * len(completions), [0.0] * len(completions), "train")
    assert batch["num_images"] == [len(message_images(prompt)) for prompt in steps.prompt]
    for row, prompt in enumerate(steps.prompt):
        own = trainer.processing_class.apply_chat_template([prompt], add_generation_prompt=True, tokenize=True,
                                                           return_dict=True, return_tensors="pt")
        assert own["input_ids"][0].tolist() == completions[row].prompt_ids
        mine = row_image_inputs(batch, row)
        assert torch.equal(mine["pixel_values"], own["pixel_values"])
        for key in PER_TOKEN_IMAGE_KEYS:
            if key in own:
                prompt_part = mine[key][0, :batch["prompt_ids"].size(1)][batch["prompt_mask"][row].bool()]
                assert torch.equal(prompt_part, own[key][0]) and not mine[key][0, batch["prompt_ids"].size(1):].any()

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    images = {key: batch[key] for key in batch if key in ("pixel_values", "image_grid_thw", "num_images", *PER_TOKEN_IMAGE_KEYS)}
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        chunked = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width,
                                                             batch_size=3, **images)[0]
        for row in range(len(completions)):
            alone = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids[row:row + 1], attention_mask[row:row + 1], width, **row_image_inputs(batch, row))[0]
            torch.testing.assert_close(chunked[row][mask[row]], alone[0][mask[row]], atol=1e-5, rtol=1e-5)
        first = row_image_inputs(batch, 0)
        neighbour = next(row_image_inputs(batch, r) for r in range(1, len(completions))
                         if batch["num_images"][r] == batch["num_images"][0]
                         and not torch.equal(row_image_inputs(batch, r)["pixel_values"], first["pixel_values"]))
        swapped = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids[:1], attention_mask[:1], width, **(first | {"pixel_values": neighbour["pixel_values"]}))[0]
    assert not torch.allclose(swapped[0][mask[0]], chunked[0][mask[0]])


def test_a_tiny_vlm_trains_on_visual_sokoban_through_its_images(tmp_path, vision_model) -> None:
    """Two updates of GiGPO with HF generation: the vision tower's and the projector's (merger's) weights move, so
    the update's loss reached them through each step's pixels; TRL's completion logs (a table) get each picture as
    `[image WxH]`."""
    model, processing_class = vision_model
    trainer = GiGPOTrainer(model, args=cpu_config(tmp_path, env_name="visual_sokoban", history_length=0,
                                                  max_env_steps=3, max_completion_length=4, log_completions=True),
                           train_dataset=task_dataset(range(8)), processing_class=processing_class)
    vision = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "visual" in name or "vision" in name
              or "projector" in name}
    trainer.train()
    moved = [name for name, p in trainer.model.named_parameters() if name in vision and not torch.equal(p, vision[name])]
    assert any("vision_tower" in name or "visual.blocks" in name for name in moved)
    assert any("projector" in name or "merger" in name for name in moved)
    assert trainer.state.global_step == 2 and trainer.last_rollout.steps.observation[0] == "[image 96x96]"
    logged_user_messages = [message["content"] for prompt in trainer._logs["prompt"] for message in prompt
                            if message["role"] == "user"]
    assert logged_user_messages and all(isinstance(content, str) and "[image 96x96]" in content
                                        for content in logged_user_messages)


class Camera:
    """A TRL environment class whose reset and tool return pictures: `look` shows the room's color."""

    def reset(self, **row):
        self.color = (40 * (len(row.get("prompt", [])) % 5), 0, 0)
        return [{"type": "text", "text": " The room:"}, {"type": "image", "image": picture(self.color)}]

    def look(self, direction: str) -> list:
        """Look somewhere.

        Args:
            direction: where to look.
        """
        return [{"type": "image", "image": picture((0, 200, 0))}, {"type": "text", "text": f"{direction}: green"}]


def test_a_trl_environment_class_whose_tool_returns_a_picture() -> None:
    from gigpo_trl.trl_environment import INFO_PROMPT, INFO_TOOL_MESSAGES, ToolCallDialogue, TRLEnvironment

    environment = TRLEnvironment(Camera, max_steps=3)
    observation, info = environment.reset(seed=0, options={"prompt": [{"role": "user", "content": "Find green."}]})
    text, images = split_observation(observation)
    assert text == f"Find green.\n The room:\n{IMAGE_MARKER}" and len(images) == 1
    assert message_images(info[INFO_PROMPT]) == list(images)  # the prompt's last message, as TRL appends it
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "look",
                                                                                    "arguments": {"direction": "up"}}}]}
    observation, _, terminated, _, info = environment.step(json.dumps(call))
    assert not terminated and readable(*split_observation(observation)) == "[image 8x8]\nup: green"
    tool_messages = info[INFO_TOOL_MESSAGES]
    start = EnvOutput("x", info={INFO_PROMPT: [{"role": "user", "content": "x"}]})
    past = Exchange(EnvOutput(""), ParsedAction(json.dumps(call), True), EnvOutput("", info={INFO_TOOL_MESSAGES: tool_messages}),
                    None)
    windowed = ToolCallDialogue(None, history_length=1).prompt(start, start, [past], step=1)
    assert [message["role"] for message in windowed] == ["user", "assistant", "tool"]
    assert message_images(windowed) == message_images(tool_messages)
    with pytest.raises(ValueError, match="does not take image observations"):
        ToolCallDialogue(None, history_length=None).turn(past, step=1)
