"""The recipes: every YAML config parses into the script's arguments (and its GRPO baseline is the same config with
`--step_advantage_weight 0`), and the script trains end to end on one and on two CPU processes (torchrun, and
`accelerate launch` with the DeepSpeed ZeRO-3 recipe)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from launchers import torchrun
from optional_packages import require
from trl import ModelConfig, TrlParser

from bench.gpu_check import deepspeed_launcher
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.env_checker import check_env
from gigpo_trl.envs import make_env, registered_envs
from gigpo_trl.models import build_tiny_vlm
from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories
from gigpo_trl.tasks import TaskArguments

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# The recipes users run, and the learning comparisons' configs (research/configs/), run by the same recipe.
CONFIGS = [*sorted((RECIPES / "configs").glob("*.yaml")),
           *sorted((RECIPES.parent / "research" / "configs").glob("learning_*.yaml"))]


def script_arguments(config: Path) -> type:
    """The arguments of the recipe script a config names in its header (recipes/train_gigpo.py by default)."""
    if "train_trl_environment.py" not in config.read_text():
        return TaskArguments
    spec = importlib.util.spec_from_file_location("train_trl_environment", RECIPES / "train_trl_environment.py")
    module = sys.modules.setdefault("train_trl_environment", importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module.ScriptArguments


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_and_its_grpo_baseline_parse_as_the_recipe_parses_them(config, tmp_path):
    parser = TrlParser((script_arguments(config), GiGPOConfig, ModelConfig))  # the recipe script's parser
    # GPU configs ask for bf16, which GiGPOConfig refuses on a machine without it, as TRL does: override it, as a
    # user on this machine would.
    device = ["--bf16", "false"] if yaml.safe_load(config.read_text()).get("bf16") else []
    arguments = ["--config", str(config), "--output_dir", str(tmp_path), *device]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task_args, training_args, model_args = parser.parse_args_and_config(args=arguments)
        _, baseline, _ = parser.parse_args_and_config(args=[*arguments, "--step_advantage_weight", "0"])

    assert training_args.env_name in registered_envs()  # (ignored by the environment-class recipe)
    assert training_args.num_generations >= 2 and task_args.num_train_tasks > 0
    assert training_args.step_advantage_weight == 1.0 and baseline.step_advantage_weight == 0.0
    # No setting of ours is deprecated on the pinned versions (transformers 5.23 renamed gradient_checkpointing).
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
    assert training_args.activation_checkpointing == yaml.safe_load(config.read_text()).get("activation_checkpointing", True)


@pytest.mark.parametrize("config", [p for p in CONFIGS if p.stem.startswith("learning_")], ids=lambda p: p.name)
def test_learning_configs_build_their_environment(config):
    settings = yaml.safe_load(config.read_text())
    check_env(make_env(settings["env_name"], **settings["env_kwargs"]))


def run_recipe(launcher: list[str], model_dir: str, output_dir: Path, config: str = "smoke_cpu.yaml",
               *options: str) -> subprocess.CompletedProcess:
    command = [*launcher, str(RECIPES / "train_gigpo.py"), "--config", str(RECIPES / "configs" / config),
               "--model_name_or_path", model_dir, "--output_dir", str(output_dir), *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.timeout(600)
def test_the_recipe_trains_evaluates_saves_and_reports(tmp_path, tiny_model_path):
    result = run_recipe([sys.executable], tiny_model_path, tmp_path)

    assert "Held-out success rate (2 tasks):" in result.stdout
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "report" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_resumes_from_the_last_checkpoint_when_told_true_on_the_command_line(tmp_path, tiny_model_path):
    run_recipe([sys.executable], tiny_model_path, tmp_path, "smoke_cpu.yaml", "--max_steps", "1",
               "--save_strategy", "steps", "--save_steps", "1")
    resumed = run_recipe([sys.executable], tiny_model_path, tmp_path, "smoke_cpu.yaml", "--max_steps", "2",
                         "--save_strategy", "steps", "--save_steps", "1", "--resume_from_checkpoint", "true")

    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [record["step"] for record in read_iterations(tmp_path) if record["mode"] == "train"] == [0, 1]
    # the panel before training is not played again at the checkpoint's step: the line reads it from the records
    evaluations = read_evaluations(tmp_path)
    assert [record["step"] for record in evaluations] == [0, 1, 2]
    assert f"({len(evaluations[0]['tasks'])} tasks): {evaluations[0]['metrics']['env/success_rate']:.1%} before " \
           f"training -> {evaluations[2]['metrics']['env/success_rate']:.1%} after" in resumed.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("java") is None, reason="TextWorldExpress needs a Java runtime (java)")
@pytest.mark.timeout(600)
def test_the_recipe_trains_on_cookingworld_and_reports_held_out_success_per_task_type(tmp_path, tiny_model_path):
    result = run_recipe([sys.executable], tiny_model_path, tmp_path, config="cookingworld_smoke_cpu.yaml")

    assert "Held-out success rate (3 tasks):" in result.stdout
    task_type = "cookingworld(includeDoors=0,numDistractorItems=0,numIngredients=1,numLocations=1)"
    evaluations = read_evaluations(tmp_path)
    assert [record["step"] for record in evaluations] == [0, 2]  # before and after training
    for record in evaluations:
        assert record["metrics"]["env/panel_tasks"] == 3
        assert record["metrics"][f"env/success_rate/{task_type}"] == record["metrics"]["env/success_rate"]
    assert (tmp_path / "report" / "panel.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_recipe_runs_on_two_cpu_processes_under_torchrun(tmp_path, tiny_model_path):
    result = run_recipe(torchrun(2), tiny_model_path, tmp_path)

    assert "GiGPO on 2 process(es), cpu" in result.stdout
    assert "Held-out success rate" in result.stdout
    assert (tmp_path / "report" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_recipe_runs_on_two_cpu_processes_under_deepspeed_zero3(tmp_path, tiny_model_path):
    # The user's launch: evaluation before training (on the engine train() prepared: an evaluate() before train() left
    # transformers an engine without an optimizer), training, evaluation, the model saved from ZeRO-3's shards.
    require("deepspeed", "GIGPO_TRL_REQUIRE_DEEPSPEED", "pip install -c constraints.txt -e '.[deepspeed]'")
    result = run_recipe(deepspeed_launcher(3, num_processes=2, mixed_precision="no"), tiny_model_path, tmp_path)

    assert "GiGPO on 2 process(es), cpu" in result.stdout
    assert "Held-out success rate (2 tasks):" in result.stdout
    assert [record["step"] for record in read_evaluations(tmp_path)] == [0, 2]  # before and after training
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "report" / "index.html").is_file()


@pytest.mark.timeout(600)
def test_the_environment_class_recipe_trains_evaluates_and_reports(tmp_path, tool_model_path):
    command = [sys.executable, str(RECIPES / "train_trl_environment.py"), "--config",
               str(RECIPES / "configs" / "guess_number_cpu.yaml"), "--model_name_or_path", tool_model_path,
               "--output_dir", str(tmp_path), "--max_steps", "1", "--num_eval_tasks", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, result.stderr[-4000:]
    assert "Held-out games won (2):" in result.stdout and (tmp_path / "report" / "index.html").is_file()
    assert [record["metrics"]["env/panel_tasks"] for record in read_evaluations(tmp_path)] == [2, 2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_visual_sokoban_recipe_trains_a_tiny_vlm_adapter_on_two_cpu_processes(tmp_path):
    model_dir = str(build_tiny_vlm(tmp_path / "tiny-vlm"))
    result = run_recipe(torchrun(2), model_dir, tmp_path / "run", "visual_sokoban_smoke_cpu.yaml")

    assert "Held-out success rate (2 tasks):" in result.stdout
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    episodes = [episode for name, records in read_trajectories(tmp_path / "run").items() if name.startswith("train")
                for episode in records]
    steps = [step for episode in episodes for step in episode["steps"]]
    assert steps and all(step["observation"] == "[image 96x96]" for step in steps)
