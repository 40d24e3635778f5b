"""Turning a model's answer into an environment action.

Validity is about FORMAT only (docs/algorithm.md, "The invalid-answer penalty"): an answer is valid when it holds
exactly one non-empty `<action>...</action>` block; a well-formed but useless action is valid. Independently,
the action text is mapped leniently onto the admissible actions, so that an untrained model that
names a command in its own words still moves the environment.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Longest action text sent to an environment (and shown in later prompts' history). Real commands are
# short ("take red apple from fridge"); the bound keeps a rambling answer from inflating every later prompt.
MAX_ACTION_CHARS = 100
ACTION_BLOCK = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
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


def parse_action(text: str, admissible_actions: Sequence[str] | None = None) -> ParsedAction:
    """Parse a model answer.

    The candidate is the content of the `<action>` block when there is one (the last one if several),
    else the answer without its `<think>` block. It is mapped onto `admissible_actions` by the first
    rule that applies: an exact match; a match ignoring case and repeated spaces; a number `k`
    naming the k-th action of the numbered list (1-based); the one admissible action contained in
    the text (as whole words, an action listed twice counting once; when several are, the one containing all the
    others).
    Unmapped candidates are sent as they are (first line, stripped, at most `MAX_ACTION_CHARS` characters).
    """
    blocks = ACTION_BLOCK.findall(text)
    valid = len(blocks) == 1 and bool(blocks[0].strip())
    candidate = (blocks[-1] if blocks else THINK_BLOCK.sub(" ", text)).strip()
    for rule, action in _mapping_rules(candidate, admissible_actions or []):
        if action is not None:
            return ParsedAction(action, valid, rule)
    first_line = candidate.splitlines()[0].strip() if candidate else ""
    return ParsedAction(first_line[:MAX_ACTION_CHARS].rstrip(), valid, None)


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
