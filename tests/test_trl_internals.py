"""The TRL internals the package relies on (docs/layout.md, "TRL internals this package relies on") exist on the
installed, pinned TRL, and the table names every one the code uses, so that it cannot go stale.

What counts as an internal, found in the source by an AST walk:
- an attribute of `GRPOTrainer` that `transformers.Trainer` does not have (a private method or attribute, or state
  `GRPOTrainer.__init__` sets), used as `self.<name>` in `GiGPOTrainer` and the classes it inherits from the package,
  defined there (an override), or used as `trainer.<name>`;
- a private attribute of `VLLMGeneration`, or any of its attributes, used as `generation.<name>`;
- a name imported from a TRL module other than `trl` itself (in gigpo_trl/, environments/ and recipes/).
The package calls a `GRPOTrainer` argument `trainer` and a `VLLMGeneration` one `generation` (checked below).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

from transformers import Trainer
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from gigpo_trl.trainer import GiGPOTrainer

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "gigpo_trl").glob("*.py"), *(ROOT / "environments").glob("*.py"), *(ROOT / "recipes").glob("*.py")])
SECTION = "## TRL internals this package relies on"
OWNERS = {"GRPOTrainer": GRPOTrainer, "VLLMGeneration": VLLMGeneration}


def table_names() -> dict[str, str]:
    """Every name of the table's first column -> the row's "where we use it"."""
    text = (ROOT / "docs" / "layout.md").read_text()
    assert SECTION in text, f"docs/layout.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    names = {}
    for row in re.findall(r"^\|(.+)\|$", section, flags=re.MULTILINE)[2:]:  # past the header and its rule
        first, where = row.split("|")[:2]
        names.update((name, where.strip()) for name in re.findall(r"`([^`]+)`", first))
    return names


@cache
def members(cls: type) -> frozenset[str]:
    """The attributes of a class and those its classes' methods set on `self` (`self.x = ...`), over its MRO."""
    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        tree = ast.parse(Path(inspect.getsourcefile(klass)).read_text())
        body = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == klass.__name__)
        names.update(node.attr for node in ast.walk(body) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                     and isinstance(node.value, ast.Name) and node.value.id == "self")
    return frozenset(names)


def grpo_internal(name: str) -> bool:
    return name in members(GRPOTrainer) and name not in members(Trainer)


def vllm_internal(name: str) -> bool:
    return name in members(VLLMGeneration)


def exists(name: str) -> bool:
    """`GRPOTrainer.x` / `VLLMGeneration.x`: a member (above); `trl.module.attribute`: importable."""
    owner, _, attribute = name.partition(".")
    if owner in OWNERS:
        return attribute in members(OWNERS[owner])
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            if not hasattr(value, part):
                return False
            value = getattr(value, part)
        return True
    return False


def trainer_classes() -> set[str]:
    """`GiGPOTrainer` and the classes of the package it inherits (the mixins)."""
    return {cls.__name__ for cls in GiGPOTrainer.__mro__ if cls.__module__.startswith("gigpo_trl.")}


def used_internals() -> dict[str, set[str]]:
    """Internal name -> the files that use it (paths relative to the repository)."""
    used: dict[str, set[str]] = {}
    classes = trainer_classes()

    def use(name: str, path: Path) -> None:
        used.setdefault(name, set()).add(str(path.relative_to(ROOT)))

    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for inner in ast.walk(node):
                    if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"
                            and grpo_internal(inner.attr)):
                        use(f"GRPOTrainer.{inner.attr}", path)
                for statement in node.body:  # overrides: methods and class attributes
                    defined = ([statement.name] if isinstance(statement, ast.FunctionDef)
                               else [t.id for t in getattr(statement, "targets", []) if isinstance(t, ast.Name)])
                    for name in defined:
                        if grpo_internal(name):
                            use(f"GRPOTrainer.{name}", path)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "trainer" and grpo_internal(node.attr):
                    use(f"GRPOTrainer.{node.attr}", path)
                elif node.value.id == "generation" and vllm_internal(node.attr):
                    use(f"VLLMGeneration.{node.attr}", path)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trl."):
                for alias in node.names:
                    use(f"{node.module}.{alias.name}", path)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("trl."):
                        use(alias.name, path)
    return used


def test_every_trl_internal_of_the_table_exists_on_the_installed_trl():
    names = table_names()
    assert len(names) > 20
    assert [name for name in names if not exists(name)] == []


def test_the_table_names_every_trl_internal_the_package_uses():
    used = used_internals()
    assert {"GRPOTrainer._compute_loss", "GRPOTrainer._generate_single_turn", "GRPOTrainer._metrics",
            "GRPOTrainer.vllm_generation", "VLLMGeneration._iter_named_params", "trl.trainer.utils.pad"} <= used.keys()
    assert sorted(used.keys() - table_names().keys()) == []


def test_the_table_says_where_each_internal_is_used():
    names = table_names()
    for name, paths in used_internals().items():
        for path in paths:
            shown = path.removeprefix("gigpo_trl/")
            assert f"`{shown}`" in names.get(name, ""), f"{name} is used in {path}, which its row does not say"


def test_the_walk_recognises_the_trainer_and_vllm_arguments_by_their_names():
    """The walk above reads `trainer.x` as a `GRPOTrainer`'s and `generation.x` as a `VLLMGeneration`'s: every
    argument annotated with either class is called so."""
    misnamed = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.annotation is not None:
                annotation = ast.unparse(node.annotation)
                expected = {"GRPOTrainer": "trainer", "VLLMGeneration": "generation"}.get(annotation)
                if expected and node.arg != expected:
                    misnamed.append(f"{path.name}: {node.arg}: {annotation}")
    assert misnamed == []
