"""Observations that hold images: what an environment may return besides text, in the one shape the rest uses.

An environment's observation is one of
- a `str` (text environments);
- a PIL image (`PIL.Image.Image`), for example a rendering of the state;
- a list of content blocks, as TRL's environment classes and chat messages write them: `{"type": "text", "text": str}`
  and `{"type": "image", "image": PIL.Image.Image}`, in reading order.

`split_observation` turns any of them into text and images: the text with `IMAGE_MARKER` where each image stands
(blocks joined by a newline), and the images in the same order. Everything downstream (prompt templates, records,
loop metrics) reads the text; a step's prompt puts the images back where their markers are (`content_blocks`). An
image observation's default anchor is exact: its text and a digest of each image's pixels (`observation_key`), so
copies of a task that see the same picture share a step group and any pixel that differs splits them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

# U+FFFC OBJECT REPLACEMENT CHARACTER: Unicode's own placeholder for an embedded object; an environment's text may not
# hold it.
IMAGE_MARKER = "\ufffc"
# A processor's keys with one entry per prompt token (Qwen2-VL's family marks its image tokens), not one per image.
PER_TOKEN_IMAGE_KEYS = ("token_type_ids", "mm_token_type_ids")


def is_image(value: Any) -> bool:
    """A PIL image (without importing PIL where no image was ever made)."""
    return any(cls.__module__.startswith("PIL.") and cls.__name__ == "Image" for cls in type(value).__mro__)


def split_observation(observation: Any, where: str = "the observation") -> tuple[str, tuple[Any, ...]]:
    """`(text, images)` of an observation (module docstring). Raises TypeError or ValueError naming what does not
    fit: another type, a block that is not a text or an image block, text holding `IMAGE_MARKER`, an empty image."""
    if isinstance(observation, str):
        _check_text(observation, where)
        return observation, ()
    if is_image(observation):
        return IMAGE_MARKER, (_checked_image(observation, where),)
    if isinstance(observation, list | tuple):
        parts, images = [], []
        for k, block in enumerate(observation):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                _check_text(block["text"], f"{where}, block {k}")
                parts.append(block["text"])
            elif kind == "image" and is_image(block.get("image")):
                images.append(_checked_image(block["image"], f"{where}, block {k}"))
                parts.append(IMAGE_MARKER)
            else:
                raise TypeError(f"{where}, block {k}: a content block is {{'type': 'text', 'text': str}} or "
                                f"{{'type': 'image', 'image': PIL.Image.Image}}, got {short_repr(block)}")
        return "\n".join(parts), tuple(images)
    raise TypeError(f"{where} is a {type(observation).__name__}; it must be a str, a PIL image, or a list of content "
                    "blocks ({'type': 'text', 'text': ...}, {'type': 'image', 'image': PIL image})")


def image_digest(image: Any) -> str:
    """A digest of an image's pixels, mode and size: equal exactly when the pictures are."""
    digest = hashlib.sha256(f"{image.mode} {image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()[:32]


def observation_key(text: str, images: Sequence[Any]) -> Any:
    """The exact key of an observation (its default anchor): the text itself without images, else the text and
    each image's digest."""
    return text if not images else (text, *(image_digest(image) for image in images))


def readable(text: str, images: Sequence[Any]) -> str:
    """The text of an observation for people (records, reports): each image as `[image WxH]`."""
    if not images:
        return text
    pieces = text.split(IMAGE_MARKER)
    shown = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        shown += [f"[image {image.size[0]}x{image.size[1]}]", piece]
    return "".join(shown)


def content_blocks(text: str, images: Sequence[Any]) -> str | list[dict[str, Any]]:
    """A message's content: `text` as it is without images, else the content blocks of `text` with each
    `IMAGE_MARKER` replaced by the next image (as TRL's processors read them).

    Raises ValueError when the markers and the images do not pair up (a template that dropped or repeated an
    observation's image)."""
    if not images and IMAGE_MARKER not in text:
        return text
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"a prompt holds {len(pieces) - 1} image places for {len(images)} images: a prompt template "
                         "must show each observation it shows once ({observation})")
    blocks: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if piece:
            blocks.append({"type": "text", "text": piece})
        if k < len(images):
            blocks.append({"type": "image", "image": images[k]})
    return blocks


def _check_text(text: str, where: str) -> None:
    if IMAGE_MARKER in text:
        raise ValueError(f"{where} holds U+FFFC (OBJECT REPLACEMENT CHARACTER), which marks an image's place: "
                         "remove it from the text")


def _checked_image(image: Any, where: str) -> Any:
    if image.size[0] < 1 or image.size[1] < 1:
        raise ValueError(f"{where} is an empty image ({image.size[0]}x{image.size[1]})")
    return image


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (for error messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def message_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The images of chat messages' content blocks, in order."""
    return [block["image"] for message in messages if isinstance(message.get("content"), list)
            for block in message["content"] if isinstance(block, dict) and block.get("type") == "image"]


def readable_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for people and logs: each content-block list as its text, each image as `[image WxH]`."""
    def text(content: Any) -> Any:
        if not isinstance(content, list):
            return content
        return "".join(block["text"] if block.get("type") == "text" else
                       f"[image {block['image'].size[0]}x{block['image'].size[1]}]" if is_image(block.get("image")) else
                       f"[{block.get('type')}]" for block in content)
    return [{**message, "content": text(message.get("content"))} for message in messages]
