"""Turning a model's answer into an environment action.

Validity is about FORMAT only (docs/algorithm.md, "The invalid-answer penalty"): an answer is valid when it holds
exactly one non-empty `<action>...</action>` block; a well-formed but useless action is valid. Independently,
the action text is mapped leniently onto the admissible actions, so that an untrained model that
names a command in its own words still moves the environment.

An environment whose actions come in several kinds names one tag per kind (a prompt template's `action_tags`, e.g.
`("search", "answer")` for search QA): an answer is then valid when it holds exactly one non-empty block among all
the tags, and the action is that block written out with its tag (`<search>query</search>`), which tells the
environment the kind.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

# Longest action text sent to an environment (and shown in later prompts' history). Real commands are
# short ("take red apple from fridge"); the bound keeps a rambling answer from inflating every later prompt.
MAX_ACTION_CHARS = 100
DEFAULT_ACTION_TAGS = ("action",)
ACTION_TAG = re.compile(r"[A-Za-z][\w-]*")
THINK_BLOCK = re.compile(r"<think>.*?(</think>|$)", re.IGNORECASE | re.DOTALL)
NUMBER = re.compile(r"^\(?#?(\d+)[.):]?$")


@dataclass(frozen=True)
class ParsedAction:
    """`action`: the text sent to the environment. `valid`: the answer followed the format.
    `match`: how `action` was found among the admissible actions ("exact", "case", "number",
    "contained"), or None when it was not (the raw text is sent)."""

    action: str
    valid: bool
    match: str | None = None


def parse_action(text: str, admissible_actions: Sequence[str] | None = None,
                 tags: Sequence[str] = DEFAULT_ACTION_TAGS, max_chars: int = MAX_ACTION_CHARS) -> ParsedAction:
    """Parse a model answer.

    With one tag (`<action>` by default): the candidate is the content of its block when there is one (the last one
    if several), else the answer without its `<think>` block. It is mapped onto `admissible_actions` by the first
    rule that applies: an exact match; a match ignoring case and repeated spaces; a number `k`
    naming the k-th action of the numbered list (1-based); the one admissible action contained in
    the text (as whole words, an action listed twice counting once; when several are, the one containing all the
    others).
    Unmapped candidates are sent as they are (first line, stripped, at most `max_chars` characters).

    With several tags (one per kind of action): valid when the answer holds exactly one non-empty block among all of
    them; the action is then that block written out with its tag, its text on one line and at most
    `max_chars` characters long (`<search>query</search>`). An invalid answer is sent without its `<think>`
    block, on one line, at most `max_chars` characters long, so the environment applies its own rule to it.
    No mapping onto admissible actions: the tag, not a list, says what the action is.

    Raises:
        ValueError: `tags` is empty or holds a name that is not a tag name (a letter, then letters, digits, `_`, `-`).
    """
    blocks = _blocks(text, tuple(tags))
    valid = len(blocks) == 1 and bool(blocks[0][1].strip())
    if len(tags) > 1:
        if valid:
            tag, content = blocks[0]
            return ParsedAction(f"<{tag}>{_one_line(content, max_chars)}</{tag}>", True)
        return ParsedAction(_one_line(THINK_BLOCK.sub(" ", text), max_chars), False)
    candidate = (blocks[-1][1] if blocks else THINK_BLOCK.sub(" ", text)).strip()
    for rule, action in _mapping_rules(candidate, admissible_actions or []):
        if action is not None:
            return ParsedAction(action, valid, rule)
    first_line = candidate.splitlines()[0].strip() if candidate else ""
    return ParsedAction(first_line[:max_chars].rstrip(), valid, None)


def _mapping_rules(candidate: str, admissible: Sequence[str]):
    """Yields (rule name, admissible action or None) in order of precedence, lazily."""
    admissible = [a for a in admissible if a.strip()]
    if not admissible:
        return
    yield "exact", candidate if candidate in admissible else None
    normalized = _normalize(candidate)
    by_normal_form = {_normalize(a): a for a in admissible}
    yield "case", by_normal_form.get(normalized)
    number = NUMBER.match(normalized)
    in_range = number is not None and 1 <= int(number.group(1)) <= len(admissible)
    yield "number", admissible[int(number.group(1)) - 1] if in_range else None
    # A set: an environment may list an action more than once (TextWorldExpress's Simon says does), and one
    # action named by the text is still one candidate.
    contained = {a for a in admissible if re.search(rf"(?<!\w){re.escape(_normalize(a))}(?!\w)", normalized)}
    widest = [a for a in contained if all(_normalize(b) in _normalize(a) for b in contained)]
    yield "contained", widest[0] if len(widest) == 1 else None


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def _one_line(text: str, max_chars: int) -> str:
    return " ".join(text.split())[:max_chars].rstrip()


@functools.lru_cache(maxsize=16)
def _block_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    if not tags or not all(isinstance(tag, str) and ACTION_TAG.fullmatch(tag) for tag in tags):
        raise ValueError(f"action tags must be a non-empty list of tag names (a letter, then letters, digits, '_' or "
                         f"'-'), got {tags!r}")
    names = "|".join(map(re.escape, tags))
    return re.compile(rf"<({names})>(.*?)</\1>", re.IGNORECASE | re.DOTALL)


def _blocks(text: str, tags: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (tag, content) blocks of `text` whose tag is one of `tags`, in order; a tag keeps its spelling in `tags`."""
    by_name = {tag.lower(): tag for tag in tags}
    return [(by_name[tag.lower()], content) for tag, content in _block_pattern(tags).findall(text)]
