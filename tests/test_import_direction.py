"""The core, every module of the package folder gigpo_trl/, depends on nothing in environments/ (the shipped games and
adapters, installed as `gigpo_trl.environments`): the environments import the core, never the other way round.

What the core may hold of the environments: the registry's "module:attribute" strings (`gigpo_trl.envs`), which
`make_env` imports by name when an environment of that name is made (and `template_for` when its default prompt
template is asked for). Nothing else: no import statement, no
`importlib.import_module` of a literal name.

Within the core, imports flow one way: no two modules import each other, directly or through others, and the
configuration sits at the bottom of the graph with the option names (`gigpo_trl.options`), importing no rollout,
vLLM or PEFT code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from gigpo_trl.envs import _PROMPT_TEMPLATES, _REGISTRY

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "gigpo_trl"
ENVIRONMENTS = "gigpo_trl.environments"
# A string that names a module (or a "module:attribute") of the environments.
NAMES_AN_ENVIRONMENT = re.compile(rf"{re.escape(ENVIRONMENTS)}(\.\w+)*(:\w+)?")


def core_modules() -> dict[str, Path]:
    """Module name -> file, for every module of gigpo_trl/ (subpackages included)."""
    modules = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = ("gigpo_trl", *path.relative_to(CORE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The modules a module imports: `import a.b`, `from a import b` (a and a.b, since b may be a module), relative
    imports resolved, and `import_module` / `__import__` of a literal name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def test_the_reader_finds_every_way_a_module_can_import_the_environments(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import importlib\n"
                      "from . import environments\n"
                      "from .environments import rooms\n"
                      "from gigpo_trl.environments.sokoban import SokobanEnv\n"
                      "def late():\n"
                      "    import gigpo_trl.environments.alfworld_games\n"
                      "    return importlib.import_module('gigpo_trl.environments.textworld_games')\n")
    names = imported_names("gigpo_trl.module", module)
    assert {f"{ENVIRONMENTS}{suffix}" for suffix in ("", ".rooms", ".sokoban", ".alfworld_games", ".textworld_games")} <= names
    assert {"gigpo_trl.trl_environment", "trl"} <= imported_names("gigpo_trl.trainer", CORE / "trainer.py")


def test_no_core_module_imports_the_environments():
    modules = core_modules()
    assert {"gigpo_trl", "gigpo_trl.trainer", "gigpo_trl.trl_environment", "gigpo_trl.envs"} <= modules.keys()
    importing = {module: sorted(name for name in imported_names(module, path)
                                if name == ENVIRONMENTS or name.startswith(f"{ENVIRONMENTS}."))
                 for module, path in modules.items()}
    assert {module: names for module, names in importing.items() if names} == {}


def test_only_the_registry_names_environments_and_only_as_strings_imported_on_use():
    named = {}
    for module, path in core_modules().items():
        strings = {node.value for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        named[module] = {text for text in strings if NAMES_AN_ENVIRONMENT.fullmatch(text)}
    registry = {entry for entry in [*_REGISTRY.values(), *_PROMPT_TEMPLATES.values()] if isinstance(entry, str)}
    assert registry and all(NAMES_AN_ENVIRONMENT.fullmatch(factory) for factory in registry)
    assert {module: strings for module, strings in named.items() if strings} == {"gigpo_trl.envs": registry}


def test_importing_every_core_module_loads_no_environment():
    modules = sorted(core_modules())
    code = (f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(name for name in sys.modules if name.startswith({ENVIRONMENTS!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports (the package's own `__init__` left out: it re-exports)."""
    return {module: {name for name in imported_names(module, path) if name in modules and name not in (module, "gigpo_trl")}
            for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: each set of two or more modules that import one another, directly or not
    (the strongly connected components of more than one module), sorted."""
    reaches = {module: set() for module in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            module = todo.pop()
            if module not in reaches[start]:
                reaches[start].add(module)
                todo += graph[module]
    found = {frozenset([module, *(other for other in reaches[module] if module in reaches[other])])
             for module in graph if module in reaches[module]}
    return sorted(sorted(circle) for circle in found)


def test_the_circle_finder_finds_a_circle_through_three_modules_and_nothing_in_a_line(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    sources = {"a": "from pkg import b\n", "b": "import pkg.c\n", "c": "from pkg.a import thing\n", "d": "import pkg.a\n",
               "e": "import pkg.d\n"}
    for name, source in sources.items():
        (package / f"{name}.py").write_text(source)
    modules = {f"pkg.{name}": package / f"{name}.py" for name in sources}
    assert circles(import_graph(modules)) == [["pkg.a", "pkg.b", "pkg.c"]]
    del modules["pkg.c"]
    assert circles(import_graph(modules)) == []


def test_no_two_core_modules_import_each_other_directly_or_not():
    assert circles(import_graph(core_modules())) == []


def test_the_configuration_imports_only_the_option_names_of_the_package_and_no_rollout_vllm_or_peft_code():
    imported = imported_names("gigpo_trl.config", CORE / "config.py")
    package = {name.split(".")[1] for name in imported if name.startswith("gigpo_trl.")}
    assert package == {"options"}
    assert not [name for name in imported if name.split(".")[0] in ("peft", "vllm")]
    assert import_graph(core_modules())["gigpo_trl.options"] == set()
    # beyond what `import gigpo_trl` loads, `import gigpo_trl.config` loads no module of the package but these two
    code = ("import sys\nimport gigpo_trl\nlight = set(sys.modules)\nimport gigpo_trl.config\n"
            "print(sorted(name for name in set(sys.modules) - light if name.startswith('gigpo_trl')\n"
            "             and name not in ('gigpo_trl.config', 'gigpo_trl.options')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

