"""HF generation through the prefix cache (gigpo_trl/prefix_cache.py, `generation_prefix_cache`): each distinct prompt
token of a rollout is forwarded once, and greedy decoding gives the tokens of TRL's plain `generate`."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import cpu_config
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, MistralConfig, Qwen2Config

from gigpo_trl.prefix_cache import PrefixCache, prefix_cache_problem
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer


def plain_generate(model, prompts: list[list[int]], config: GenerationConfig, pad: int) -> torch.Tensor:
    """`generate` over left-padded prompts, as TRL's transformers path calls it."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]


def test_kept_prefixes_give_plain_generates_greedy_tokens_and_forward_each_new_token_once_over_8_turns(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=pad)
    random = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(10, 400, (n,), generator=random).tolist()

    # 6 conversations: a 60-token instruction all share, tasks of 5-39 tokens, two conversations identical at first
    instructions = tokens(60)
    prompts = [instructions + tokens(n) for n in (5, 17, 39, 8, 23)]
    prompts.insert(1, list(prompts[0]))
    cache = PrefixCache()
    with torch.no_grad():
        for turn in range(8):
            generated = cache.generate(model, prompts, config, pad)
            assert torch.equal(generated, plain_generate(model, prompts, config, pad)), f"turn {turn}"
            counts = cache.take_counts()
            assert counts.prompt_tokens == sum(map(len, prompts))
            if turn == 0:  # the instructions once, then each distinct task once; generation reads at least one token a
                # row, so both rows of the repeated prompt read its last token again
                distinct = {tuple(prompt) for prompt in prompts}
                assert counts.forwarded_tokens == 60 + sum(len(p) - 60 for p in distinct) + 2
            else:  # only what came back (7 tokens a row), and the answers' unread last tokens, once each
                assert counts.forwarded_tokens == len(prompts) * 7 + unread
            answers = [row[: row.index(eos) + 1] if eos in row else row for row in generated.tolist()]
            # the last token generated is sampled, never forwarded: the answers as long as the call's longest have it
            # unread, once for the two conversations that are still alike
            unread = len({tuple(prompt + answer) for prompt, answer in zip(prompts, answers)
                          if len(answer) == generated.size(1)})
            prompts = [prompt + answer + tokens(7) for prompt, answer in zip(prompts, answers)]
            assert len(cache._kept) <= 2 * len(prompts) + 1  # each row's sequence, the prefixes this turn read


def test_a_window_written_anew_each_turn_reads_its_instructions_once_and_keeps_no_stale_prefix(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    pad = tokenizer.pad_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    random = torch.Generator().manual_seed(1)
    instructions = torch.randint(10, 400, (50,), generator=random).tolist()
    cache = PrefixCache()
    with torch.no_grad():
        for turn in range(6):  # 4 copies of 2 tasks, each turn's window new text after the instructions
            windows = [torch.randint(10, 400, (20,), generator=random).tolist() for _ in range(2)]
            prompts = [instructions + windows[k % 2] for k in range(4)]
            assert torch.equal(cache.generate(model, prompts, config, pad), plain_generate(model, prompts, config, pad))
            forwarded = cache.take_counts().forwarded_tokens
            # the instructions on the first turn only; each task's window once, then its last token again in each of
            # its rows (generation reads at least one token a row)
            assert forwarded == (50 if turn == 0 else 0) + 2 * 20 + 4
            assert len(cache._kept) <= 2 * len(prompts) + 1


def greedy_rollout(tiny_model_path: str, tmp_path, prefix_cache: bool, history_length) -> tuple[list, dict]:
    """One training rollout of corridor (4 tasks x 2 copies, 6 steps) decoded greedily: each step's prompt and answer
    ids, and the rollout's logged metrics."""
    config = cpu_config(tmp_path / str(prefix_cache), env_name="corridor", max_steps=1, max_env_steps=6,
                        max_completion_length=6, history_length=history_length, generation_prefix_cache=prefix_cache,
                        generation_kwargs={"do_sample": False}, env_processes=False, disable_tqdm=True)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    trainer.train()
    trainer.close_environments()
    assert prefix_cache == (trainer.turns.prefix_cache is not None)
    steps = trainer.last_rollout.steps
    logged = next(entry for entry in trainer.state.log_history if "generation/prompt_tokens" in entry)
    return [(c.prompt_ids, c.completion_ids) for c in steps.completion], logged


@pytest.mark.parametrize("history_length", ["conversation", 2])
def test_a_run_generates_the_same_greedy_answers_with_and_without_the_prefix_cache(tmp_path, tiny_model_path,
                                                                                   history_length):
    cached, cached_log = greedy_rollout(tiny_model_path, tmp_path, True, history_length)
    plain, plain_log = greedy_rollout(tiny_model_path, tmp_path, False, history_length)
    assert cached == plain
    prompt_tokens = sum(len(prompt) for prompt, _ in plain)
    assert cached_log["generation/prompt_tokens"] == plain_log["generation/prompt_tokens"] == prompt_tokens
    assert plain_log["generation/prefill_tokens"] == prompt_tokens  # TRL's generate reads every prompt whole
    if history_length == "conversation":  # the first prompts (shared by each task's 2 copies), then the new turns
        first = {tuple(prompt) for prompt, answer in cached[:8]}
        new_turns = sum(len(prompt) - len(before) - len(answer) + 1
                        for (before, answer), (prompt, _) in zip(cached, cached[8:]))
        assert cached_log["generation/prefill_tokens"] <= sum(map(len, first)) + new_turns
    else:  # a window is written anew: the instructions and each task's first prompt are still read once
        assert cached_log["generation/prefill_tokens"] < prompt_tokens / 2


def test_the_kept_prefixes_are_dropped_after_each_rollout_as_the_weights_change(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", max_steps=2, history_length="conversation", disable_tqdm=True)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    played = []
    play = trainer._play

    def recording_play(*args, **kwargs):
        played.append(bool(trainer.turns.prefix_cache._kept))  # what the rollout starts with
        rollout = play(*args, **kwargs)
        played.append(bool(trainer.turns.prefix_cache._kept))  # what it leaves
        return rollout

    trainer._play = recording_play
    trainer.train()
    trainer.close_environments()
    assert played == [False] * 4


def test_the_prefix_cache_names_what_it_cannot_serve(tmp_path, tiny_model_path):
    greedy = GenerationConfig(do_sample=False)
    full = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    full._attn_implementation = "sdpa"
    assert prefix_cache_problem(full, greedy) is None
    sliding = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, sliding_window=32)
    sliding._attn_implementation = "sdpa"
    assert prefix_cache_problem(sliding, greedy) == "mistral uses sliding-window attention"
    assert "not the dynamic cache" in prefix_cache_problem(full, GenerationConfig(cache_implementation="static"))
    assert "continuous batching" in prefix_cache_problem(full, greedy, continuous_batching=True)
    assert prefix_cache_problem(full, greedy, sharded="ZeRO-3").startswith("ZeRO-3 makes every forward of the model "
                                                                          "collective")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.use_sliding_window, model.config.sliding_window = True, 64
    with pytest.warns(UserWarning, match="generation_prefix_cache is off: qwen2 uses sliding-window attention; every "
                      "prompt is forwarded whole"):
        trainer = GiGPOTrainer(model, args=cpu_config(tmp_path, env_name="corridor"), train_dataset=task_dataset(range(4)),
                               processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
    assert trainer.turns.prefix_cache is None
