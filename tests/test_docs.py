"""The documentation says what it must: every field's fate under GiGPO, links and file paths that lead somewhere, every
module of the package in the layout, and the algorithm page's worked examples as `compute_gigpo_advantages` computes
them."""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from transformers import TrainingArguments
from trl import GRPOConfig

from gigpo_trl.advantages import compute_gigpo_advantages, discounted_returns
from gigpo_trl.config import GiGPOConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
# The pages a reader opens: the README, the user pages, the research wing's index and its settings' pages.
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")), "research/README.md",
         *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "research" / "settings").glob("*/README.md"))]
# A repository path, as pages, commands and help texts write it: from a top-level folder of the repository, relative
# to its root, anywhere in the text (prose, backticks, commands); braces ({a,b}) and globs (*) allowed.
TOP_LEVEL = ("gigpo_trl", "environments", "recipes", "research", "bench", "scripts", "tests", "docs", "notebooks", ".ci")
REPOSITORY_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w.*{},/-]*)" % "|".join(map(re.escape, TOP_LEVEL)))


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


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_lead_to_files_that_exist(page):
    text = (ROOT / page).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    missing = [t for t in targets if t and not ((ROOT / page).parent / t).exists()]
    assert missing == []


def test_the_readme_is_a_first_read_with_exactly_its_two_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) < 12_000  # what a newcomer needs first; reference material goes to docs/
    assert re.findall(r"<!-- ([a-z-]+-command) -->", readme) == ["main-command", "test-command"]


def named_paths(text: str) -> list[str]:
    """The repository paths a text names (`REPOSITORY_PATH`), braces expanded, web addresses left out."""
    def expand(path: str) -> list[str]:
        braces = re.search(r"\{([^{}]*)\}", path)
        if braces is None:
            return [path]
        return [name for part in braces.group(1).split(",")
                for name in expand(path[: braces.start()] + part + path[braces.end():])]

    text = re.sub(r"https?://\S+", "", text)
    return [name for path in REPOSITORY_PATH.findall(text) for name in expand(path.rstrip(".,"))]


def missing_paths(text: str) -> list[str]:
    return sorted({path for path in named_paths(text)
                   if not (glob.glob(str(ROOT / path)) if any(c in path for c in "*?[") else (ROOT / path).exists())})


def test_the_path_reader_finds_paths_in_prose_commands_and_braces():
    text = ("See `docs/gpu.md`, [x](https://github.com/a/docs/none.md) and\n"
            "python research/learning.py --config recipes/configs/{sokoban,nowhere}_gigpo.yaml docs/figures/*.json.")
    assert named_paths(text) == ["docs/gpu.md", "research/learning.py", "recipes/configs/sokoban_gigpo.yaml",
                                 "recipes/configs/nowhere_gigpo.yaml", "docs/figures/*.json"]
    assert missing_paths(text) == ["recipes/configs/nowhere_gigpo.yaml"]


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_exists(page):
    assert missing_paths((ROOT / page).read_text()) == []


def test_every_file_a_help_text_names_exists():
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GiGPOConfig)}
    assert {name: missing_paths(text) for name, text in helps.items() if missing_paths(text)} == {}
    assert "docs/algorithm.md" in helps["step_advantage_lambda"]  # the reader finds what the help texts cite


def test_the_layout_names_every_module_of_the_package():
    layout = (ROOT / "docs" / "layout.md").read_text()
    modules = sorted(p.relative_to(ROOT / "gigpo_trl").as_posix() for p in (ROOT / "gigpo_trl").rglob("*.py"))
    assert "advantages.py" in modules
    assert [m for m in modules if f"`{m}`" not in layout and f"`gigpo_trl/{m}`" not in layout] == []


def worked_example(marker: str) -> list[dict[str, str]]:
    """The table that follows `<!-- marker -->` in docs/algorithm.md, one dict per row, keyed by the header."""
    text = (ROOT / "docs" / "algorithm.md").read_text().split(f"<!-- {marker} -->\n", 1)[1]
    lines = [line for line in itertools.takewhile(lambda line: line.startswith("|"), text.splitlines())]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def example_rows(table: list[dict[str, str]]) -> dict:
    """The columns `compute_gigpo_advantages` takes, from a worked example: row names "A0" are trajectory A, step 0."""
    return dict(rewards=[float(row["reward"]) for row in table], group_ids=[0] * len(table),
                trajectory_ids=[row["row"][0] for row in table], step_indices=[int(row["row"][1:]) for row in table],
                anchor_keys=[row["anchor"] for row in table])


def returns_to_go(rows: dict, gamma: float = 0.95) -> np.ndarray:
    """G_t of every row of a worked example (its trajectories' rows in step order, one after the other)."""
    trajectories, steps = rows["trajectory_ids"], rows["step_indices"]
    steps_to_go = np.array([trajectories.count(trajectory) - 1 - step for trajectory, step in zip(trajectories, steps)])
    return discounted_returns(np.array(rows["rewards"]), steps_to_go, gamma)


def assert_column(table: list[dict[str, str]], column: str, values) -> None:
    """Every number of a column is the value rounded to the digits the page shows."""
    shown = [row[column] for row in table]
    digits = [len(cell.split(".")[1]) if "." in cell else 0 for cell in shown]
    assert [float(cell) for cell in shown] == [round(float(v), d) + 0.0 for v, d in zip(values, digits)], column


def test_the_algorithm_pages_worked_example_is_what_the_function_computes():
    table = worked_example("worked-example")
    rows = example_rows(table)
    assert_column(table, "G", returns_to_go(rows))
    for episode_stats in ("steps", "trajectories"):
        out = compute_gigpo_advantages(**rows, episode_stats=episode_stats)
        assert_column(table, f"A_E ({episode_stats})", out.episode_advantages)
        assert_column(table, f"A ({episode_stats})", out.advantages)
        assert_column(table, "A_S", out.step_advantages)


def test_the_algorithm_pages_bootstrapped_example_is_what_the_function_computes():
    table = worked_example("worked-example-lambda")
    rows = example_rows(table)
    returns = returns_to_go(rows)
    assert_column(table, "G", returns)
    # V(k): the mean return-to-go of k's step group; the lambda-return by its recursion, backward over each trajectory.
    anchors = rows["anchor_keys"]
    value = {k: float(np.mean([g for g, a in zip(returns, anchors) if a == k])) for k in anchors}
    for step_lambda in (1.0, 0.5, 0.0):
        out = compute_gigpo_advantages(**rows, norm="mean", step_lambda=step_lambda)
        assert_column(table, f"A_S, lambda {step_lambda:g}", out.step_advantages)
        if step_lambda == 1.0:
            continue
        lambda_returns = [0.0] * len(table)
        for k in reversed(range(len(table))):
            last = k + 1 == len(table) or rows["trajectory_ids"][k + 1] != rows["trajectory_ids"][k]
            lambda_returns[k] = rows["rewards"][k] + (0.0 if last else 0.95 * (
                (1 - step_lambda) * value[anchors[k + 1]] + step_lambda * lambda_returns[k + 1]))
        assert_column(table, f"Gl, lambda {step_lambda:g}", lambda_returns)


def test_no_file_of_the_repository_cites_a_file_outside_it():
    # The names, built from parts so that this file does not hold them: a specification and notes users cannot open.
    outside = ["GIGPO" + "_SPEC", "/work/" + "shared", "../" + "shared/"]
    files = [ROOT / name for name in ("README.md", "setup.cfg", "pyproject.toml", ".ci/run")]
    files += [path for top in TOP_LEVEL for path in (ROOT / top).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".png", ".pyc")]
    citing = {path.relative_to(ROOT).as_posix(): name for path in files
              for name in outside if name in path.read_text(errors="replace")}
    assert len(files) > 100 and citing == {}
