"""Exact tokens: every step sample trains on the very prompt ids the trainer sent to the generator and the very
completion ids the generator returned, never on a re-tokenization of their decoded text (which is another sequence
where decode -> encode does not round-trip: a token the text leaves out, such as a special token, or a word split
otherwise than the tokenizer would)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import cpu_config

from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


def test_each_step_trains_on_the_prompt_ids_sent_to_the_generator_and_the_completion_ids_it_returned(
        tmp_path, tiny_model_path):
    # A high temperature makes the tiny model's answers random tokens, special ones included: text that does not
    # encode back to them.
    config = cpu_config(tmp_path, env_name="corridor", max_steps=1, temperature=2.0, max_completion_length=8)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    generated: list[tuple[list[int], list[int]]] = []  # (prompt ids sent, completion ids returned), every call
    trained: list[dict[str, torch.Tensor]] = []  # the inputs of every loss computation of the update
    generate, compute_loss = trainer._generate_single_turn, trainer.compute_loss

    def recording_generate(prompt_ids, *args, **kwargs):
        completion_ids, *rest = generate(prompt_ids, *args, **kwargs)
        generated.extend((list(p), list(c)) for p, c in zip(prompt_ids, completion_ids))
        return completion_ids, *rest

    def recording_compute_loss(model, inputs, *args, **kwargs):
        trained.append({key: value.detach().clone() for key, value in inputs.items() if torch.is_tensor(value)})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer._generate_single_turn, trainer.compute_loss = recording_generate, recording_compute_loss
    trainer.train()
    trainer.close_environments()

    tokenizer = trainer.processing_class
    pad = tokenizer.pad_token_id
    rows = 0
    for inputs in trained:
        for k in range(inputs["prompt_ids"].size(0)):
            if not inputs["tool_mask"][k].any():
                continue  # a zero-weight padding row trains on nothing
            prompt = inputs["prompt_ids"][k][inputs["prompt_mask"][k].bool()].tolist()
            completion = inputs["completion_ids"][k].tolist()
            matches = [c for p, c in generated if p == prompt and completion == c + [pad] * (len(completion) - len(c))]
            assert matches, f"row {k} trains on tokens the generator neither was sent nor returned: {prompt} {completion}"
            rows += 1
    assert rows == len(trainer.last_rollout.steps)  # every step sample of the rollout, once
    # The check has teeth: some answer trained on does not survive decode -> encode, as a re-tokenizing trainer would
    # have trained on.
    round_trip = [tokenizer(tokenizer.decode(c, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
                  for _, c in generated]
    assert any(again != c for again, (_, c) in zip(round_trip, generated))
