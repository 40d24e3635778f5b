"""The documentation says what it must: every field's fate under GiGPO, and links that lead somewhere."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments
from trl import GRPOConfig

from gigpo_trl.config import GiGPOConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_configuration_page_says_what_gigpo_does_with_every_grpo_config_field():
    named = set(re.findall(r"`([a-z0-9_*]+)`", section(CONFIGURATION, "TRL's `GRPOConfig` fields under GiGPO")))
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = [name for name in sorted(own) if not any(fnmatch.fnmatchcase(name, pattern) for pattern in named)]
    assert missing == []


def test_the_configuration_page_documents_every_gigpo_field():
    table = section(CONFIGURATION, "GiGPO's fields")
    own = {f.name for f in dataclasses.fields(GiGPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert sorted(name for name in own if f"| `{name}` |" not in table) == []


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_lead_to_files_that_exist(page):
    text = (ROOT / page).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if t and not ((ROOT / page).parent / t).exists()]
    assert missing == []


def test_the_readme_is_a_first_read_with_exactly_its_two_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 16_000  # what a newcomer needs first; reference material goes to docs/
    assert re.findall(r"<!-- ([a-z-]+-command) -->", readme) == ["main-command", "test-command"]
