"""A prompt that would not fit the model's context ends its episode as truncated, before generation: counted in
`env/context_overflow_share`, named in a warning and in the episode's record, and never cut or sent to the model."""

from __future__ import annotations

import pytest
import torch
from toy_envs import GrowingLog
from trainer_helpers import cpu_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from gigpo_trl.dialogue import Completion, PromptTooLong
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.turns import over_long_prompts, prompt_token_limit
from gigpo_trl.records import read_trajectories
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(600)


def test_the_room_a_prompt_has_is_the_context_less_the_answer():
    assert prompt_token_limit(4096, None, 12) == 4084
    assert prompt_token_limit(4096, 1024, 12) == 1012  # vLLM's max_model_len where set
    assert prompt_token_limit(None, None, 12) is None  # unknown: nothing is checked
    assert over_long_prompts([[1] * 5, [1] * 6, [1] * 7], limit=5) == {1: 6, 2: 7}
    assert over_long_prompts([[1] * 7], limit=None) == {}


def test_an_episode_whose_observation_outgrows_the_context_ends_truncated_instead_of_reaching_the_model(
        tmp_path, tiny_model_path):
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.max_position_embeddings = 400  # a small context, which the growing log outgrows within 8 steps
    config = cpu_config(tmp_path, max_env_steps=8, max_steps=1, env_processes=False, disable_tqdm=True)
    trainer = GiGPOTrainer(model, args=config, env=GrowingLog, processing_class=AutoTokenizer.from_pretrained(
        tiny_model_path), train_dataset=task_dataset(range(4), [{"length": 30}] * 4))
    sent = []
    generate = trainer._generate_single_turn

    def recording(prompt_ids, *args, **kwargs):
        sent.extend(len(ids) for ids in prompt_ids)
        return generate(prompt_ids, *args, **kwargs)

    trainer._generate_single_turn = recording
    with pytest.warns(UserWarning, match=r"100% of the episodes .* more than 388 tokens.*env/context_overflow_share"):
        trainer.train()
    trainer.close_environments()

    assert trainer.turns.prompt_token_limit == 400 - 12
    assert sent and max(sent) <= 388  # no prompt over the limit reached the model (nor was one cut to fit)
    log = next(entry for entry in trainer.state.log_history if "env/context_overflow_share" in entry)
    assert log["env/context_overflow_share"] == 1.0 and log["env/truncated_share"] == 1.0
    rollout = trainer.last_rollout
    assert all(0 < episode.length < 8 and episode.context_overflow for episode in rollout.episodes)
    assert all(len(c.prompt_ids) <= 388 for c in rollout.steps.completion)
    recorded = read_trajectories(tmp_path)["train-00000"][0]
    assert recorded["truncated"] and recorded["context_overflow"].startswith(f"the prompt of step {recorded['length']} ")
    assert recorded["context_overflow"].endswith("more than the 388 the model's context leaves it")


def test_the_turn_loop_ends_the_episodes_whose_prompt_did_not_fit_and_plays_the_others():
    def generate(prompts, tools):  # the second environment's prompts never fit
        return [PromptTooLong(500, 388) if k == 1 else Completion([1], [2], "<action>right</action>")
                for k, _ in enumerate(prompts)]

    with EnvPool(GrowingLog, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(0, {"length": 3})], generate, max_env_steps=4, show_progress=False)

    won, cut = rollout.episodes
    assert (won.length, won.won, won.context_overflow) == (2, True, None)
    assert (cut.length, cut.truncated, cut.env_error) == (0, True, None)
    assert cut.context_overflow == "the prompt of step 0 has 500 tokens, more than the 388 the model's context leaves it"
    assert rollout.steps.trajectory == [0, 0]  # no step sample of the episode that could not go on
