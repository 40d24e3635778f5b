"""The packed update (`gigpo_trl.packing`, `packed_update`): rows folded into a prefix trie give the plain path's
per-token log-probs, entropies, loss and gradients, within fp32 rounding, on the tiny model and the embedded SmolLM2,
for the shapes a rollout makes (a step group's identical prompts, prompts that extend each other as with history,
prompts of different lengths, padding, truncated answers, answers sharing their first tokens, one-row groups,
rows without an answer), under LoRA, and over 3 updates of a training run.

Tolerance: fp32 rounding of the two paths' different matrix shapes (and of RoPE at the plain path's padded
positions): log-probs and entropies within 1e-4 absolute (values of order 1-20); gradients within 1e-4 relative to
their largest entry (measured: 3e-5 on SmolLM2, 5e-7 on the tiny model)."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import cpu_config, parameters
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head, split_tensor_dict

from gigpo_trl.batch import loss_batch
from gigpo_trl.dialogue import Completion
from gigpo_trl.models import EMBEDDED_MODEL, resolve_model
from gigpo_trl.packing import IGNORED, joined, pack_rows, packing_problem, rows_by_prompt, unpack
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(600)

INSTRUCTIONS = [11, 12, 13, 14, 15, 16]
# (prompt, answer) rows as a rollout makes them; the answers end within the 5 completion columns or fill them
# (truncated). Rows 0-3: one step group (identical prompts), answers that share their first tokens, one repeated
# whole; rows 4-5: history (row 5's prompt extends row 4's prompt and answer); row 6: a one-row group with a prompt of
# its own length; row 7: a row without an answer (a padding row's shape); row 8: one prompt token.
ROWS = [
    (INSTRUCTIONS + [30, 31], [40, 41, 42]),
    (INSTRUCTIONS + [30, 31], [40, 41, 43, 44, 45]),
    (INSTRUCTIONS + [30, 31], [40, 41, 42]),
    (INSTRUCTIONS + [30, 31], [50]),
    (INSTRUCTIONS + [32], [60, 61]),
    (INSTRUCTIONS + [32, 60, 61, 33, 34], [62, 63, 64, 65, 66]),
    (INSTRUCTIONS[:3] + [35, 36, 37, 38, 39, 20, 21], [70, 71]),
    (INSTRUCTIONS + [30, 31], []),
    ([17], [80, 81, 82]),
]


def padded(rows: list[tuple[list[int], list[int]]], completion_columns: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPOTrainer's layout: prompts left-padded, answers right-padded, pad token 0."""
    prompt_columns = max(len(prompt) for prompt, _ in rows)
    input_ids = torch.zeros(len(rows), prompt_columns + completion_columns, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, answer) in enumerate(rows):
        input_ids[row, prompt_columns - len(prompt):prompt_columns] = torch.tensor(prompt)
        attention_mask[row, prompt_columns - len(prompt):prompt_columns] = 1
        input_ids[row, prompt_columns:prompt_columns + len(answer)] = torch.tensor(answer, dtype=torch.long)
        attention_mask[row, prompt_columns:prompt_columns + len(answer)] = 1
    return input_ids, attention_mask


def test_rows_that_share_a_prefix_share_its_nodes_and_each_node_sees_its_path():
    rows = [([1, 2, 3], [4, 5]), ([1, 2, 3], [4, 6]), ([1, 2, 7], [8])]
    packed = pack_rows(*padded(rows, 2), 2)
    # row 0: 1 2 3 4 (the last token, 5, scores nothing: not forwarded); row 1 parts from row 0 at 4, whose node scores
    # 6, not 5; row 2 parts at 7, a prompt token
    assert packed.tokens == 4 + 1 + 1
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 4, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 3, 2]]
    assert packed.shift_labels.tolist() == [[IGNORED, IGNORED, 4, 5, 6, 8]]
    visible = packed.visible[0].int().tolist()
    assert visible[3] == [1, 1, 1, 1, 0, 0]  # 4 sees its path 1 2 3 and itself
    assert visible[4] == [1, 1, 1, 0, 1, 0]  # the second 4 sees 1 2 3, not the first 4
    assert visible[5] == [1, 1, 0, 0, 0, 1]  # 7 sees 1 2
    # each row's answer token is scored where its path's previous token sits; columns past the answer score nothing
    assert packed.gather.tolist() == [[2, 3], [2, 4], [5, 6]]
    assert unpack(torch.arange(6.0).view(1, 6), packed.gather).tolist() == [[2, 3], [2, 4], [5, 0]]


def test_a_trajectory_whose_prompts_extend_its_previous_step_samples_forwards_its_last_step_only():
    # steps of one conversation: each prompt is the previous prompt and answer, then the next observation
    rows = [([1, 2], [3, 4]), ([1, 2, 3, 4, 5], [6, 7]), ([1, 2, 3, 4, 5, 6, 7, 8], [9])]
    packed = pack_rows(*padded(rows, 2), 2)
    assert packed.tokens == 8  # 1..8: the last step's tokens but its last
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert packed.shift_labels.tolist() == [[IGNORED, 3, 4, IGNORED, 6, 7, IGNORED, 9]]
    assert packed.gather.tolist() == [[1, 2], [4, 5], [7, 8]]


def test_nodes_are_numbered_depth_first_so_that_a_node_sees_an_interval_of_ancestors():
    # the third row's 4 is a prompt token, so it takes the first row's 4 (which scores 5), made before the second
    # row's 4 (which scores 6): its 7 is made last but sits inside the first 4's subtree, before the second 4
    rows = [([1, 2, 3], [4, 5]), ([1, 2, 3], [4, 6]), ([1, 2, 3, 4, 7], [8])]
    packed = pack_rows(*padded(rows, 2), 2)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 7, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    assert packed.subtree_end.tolist() == [[6, 6, 6, 5, 5, 6]]
    visible = packed.visible[0].int().tolist()
    assert visible[4] == [1, 1, 1, 1, 1, 0]  # 7 sees 1 2 3 and the first 4
    assert visible[5] == [1, 1, 1, 0, 0, 1]  # the second 4 sees 1 2 3 only
    assert packed.gather.tolist() == [[2, 3], [2, 5], [4, 6]]
    # over a trie of many branches, what a node sees is one node at each depth above it, spelling a row's start
    many = pack_rows(*padded(ROWS), 5, capacity=1000)
    sequences = [prompt + answer for prompt, answer in ROWS]
    for j in range(many.tokens):
        path = [i for i in range(j + 1) if many.visible[0, j, i]]
        assert many.position_ids[0, path].tolist() == list(range(len(path)))
        tokens = many.input_ids[0, path].tolist()
        assert any(sequence[:len(tokens)] == tokens for sequence in sequences)


def test_flexattentions_block_mask_gives_the_dense_masks_outputs(tiny_model_path):
    # FlexAttention trains on CUDA only in torch 2.13: on CPU its forward is checked against the dense mask's
    input_ids, attention_mask = padded(ROWS)
    packed = pack_rows(input_ids, attention_mask, 5)
    outputs = {}
    for attention, mask in (("sdpa", packed.attention_mask()), ("flex_attention", packed.block_mask())):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention).eval()
        with torch.no_grad():
            outputs[attention] = model(input_ids=packed.input_ids, attention_mask=mask,
                                       position_ids=packed.position_ids).logits
    real = packed.input_ids != 0
    torch.testing.assert_close(outputs["flex_attention"][real], outputs["sdpa"][real], atol=1e-5, rtol=1e-4)


def test_the_capacity_cuts_the_trie_into_packed_rows_and_a_longer_row_gets_its_own():
    input_ids, attention_mask = padded(ROWS)
    whole = pack_rows(input_ids, attention_mask, 5, capacity=1000)
    assert whole.input_ids.size(0) == 1 and whole.tokens < attention_mask.sum() - len(ROWS)
    default = pack_rows(input_ids, attention_mask, 5)  # at most twice a plain row: 2 * 17 columns
    assert (default.input_ids != 0).sum(dim=1).max() <= 2 * input_ids.size(1)
    cut = pack_rows(input_ids, attention_mask, 5, capacity=14)
    lengths = (cut.input_ids != 0).sum(dim=1).tolist()
    assert len(lengths) > 1 and max(lengths) <= 15  # row 5 alone forwards 15 tokens: it gets a packed row of its own
    assert cut.tokens >= whole.tokens


@pytest.mark.parametrize("mask_row", [[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 1], [0, 0, 0, 1, 1, 0]])
def test_a_mask_that_is_not_a_left_padded_prompt_and_a_right_padded_answer_is_refused(mask_row):
    input_ids = torch.arange(1, 7).view(1, 6)
    with pytest.raises(ValueError, match="row 0: "):
        pack_rows(input_ids, torch.tensor([mask_row]), 3)


def test_rows_sorted_by_prompt_keep_every_rows_values_together_and_joined_micro_batches_are_the_batch():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 0, 4]])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": (prompt_ids != 0).long(), "advantages": torch.arange(4.0),
             "texts": ["a", "b", "c", "d"], "num_items_in_batch": torch.tensor(9), "old_per_token_logps": None}
    ordered = rows_by_prompt(batch)
    assert ordered["advantages"].tolist() == [3.0, 0.0, 2.0, 1.0]  # [4] < [5, 6] = [5, 6] < [7, 8, 9]
    assert ordered["texts"] == ["d", "a", "c", "b"] and ordered["prompt_ids"][0].tolist() == [0, 0, 4]
    assert ordered["num_items_in_batch"] is batch["num_items_in_batch"] and ordered["old_per_token_logps"] is None
    again = joined(split_tensor_dict(ordered, 2))
    assert again.keys() == ordered.keys() and again["texts"] == ordered["texts"]
    assert all(torch.equal(again[key], ordered[key]) for key in ("prompt_ids", "advantages"))


@pytest.mark.parametrize(("overrides", "sorted_rows"), [({}, True), ({"packed_update": False}, False),
                                                        ({"gradient_accumulation_steps": 1}, False)])
def test_a_rollouts_rows_reach_the_micro_batches_by_prompt_only_where_the_split_changes_no_update(
        tmp_path, tiny_model_path, overrides, sorted_rows):
    trainer = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, env_name="sokoban", **overrides),
                           train_dataset=task_dataset(range(4)))
    trainer.model.train()
    micro_batch = trainer._prepare_inputs([trainer.train_dataset[k] for k in (0, 0, 1, 1)])
    rows = joined(trainer._buffered_inputs)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rows["prompt_ids"], rows["prompt_mask"])]
    assert micro_batch is trainer._buffered_inputs[0]
    assert (prompts == sorted(prompts)) == sorted_rows or len(set(map(tuple, prompts))) == 1
    trainer.close_environments()


def fused_model(path: str, attention: str, temperature: float = 0.7):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def plain_outputs(model, input_ids, attention_mask, completion_columns):
    """GRPOTrainer's forward pass (`_get_per_token_logps_and_entropies`), with a random weighting of its log-probs
    and entropies backpropagated: (log-probs, entropies, gradient)."""
    labels = input_ids.masked_fill(attention_mask == 0, IGNORED)
    labels[:, :-completion_columns] = IGNORED
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return weighted_gradient(model, outputs.log_probs[:, -completion_columns:], outputs.entropy[:, -completion_columns:])


def packed_outputs(model, input_ids, attention_mask, completion_columns, capacity=None):
    packed = pack_rows(input_ids, attention_mask, completion_columns, capacity)
    mask = packed.attention_mask(None if model.config._attn_implementation == "sdpa" else torch.float32)
    outputs = model(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids,
                    shift_labels=packed.shift_labels, fused_lm_head=True)
    return weighted_gradient(model, unpack(outputs.log_probs, packed.gather), unpack(outputs.entropy, packed.gather))


def weighted_gradient(model, log_probs, entropies):
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(log_probs.shape, generator=generator), torch.randn(log_probs.shape, generator=generator)
    model.zero_grad()
    ((log_probs * weights[0]).sum() + (entropies * weights[1]).sum()).backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return log_probs.detach(), entropies.detach(), gradient


def assert_same_outputs(packed, plain):
    torch.testing.assert_close(packed[0], plain[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(packed[1], plain[1], rtol=0, atol=1e-4)
    assert plain[2].abs().max() > 0
    torch.testing.assert_close(packed[2], plain[2], rtol=0, atol=1e-4 * plain[2].abs().max().item())


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_model(EMBEDDED_MODEL)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("capacity", [None, 14])
def test_the_tiny_models_log_probs_entropies_and_gradients_packed_are_the_plain_paths(tiny_model_path, attention,
                                                                                      capacity):
    model = fused_model(tiny_model_path, attention)
    input_ids, attention_mask = padded(ROWS)
    input_ids = input_ids % model.config.vocab_size
    assert_same_outputs(packed_outputs(model, input_ids, attention_mask, 5, capacity),
                        plain_outputs(model, input_ids, attention_mask, 5))


def test_smollm2s_log_probs_entropies_and_gradients_packed_are_the_plain_paths(smollm2_path):
    model = fused_model(smollm2_path, "sdpa")
    input_ids, attention_mask = padded([(prompt, [token + 1000 for token in answer]) for prompt, answer in ROWS])
    input_ids = input_ids + 100 * attention_mask  # tokens of a real vocabulary's middle
    assert_same_outputs(packed_outputs(model, input_ids, attention_mask, 5),
                        plain_outputs(model, input_ids, attention_mask, 5))


def conversation_rows(steps: int, trajectories: int, end_of_turn: int = 9) -> list[tuple[list[int], list[int]]]:
    """The step samples of conversations (`history_length` conversation): step t's prompt is step t-1's prompt, its
    answer as generated (closed by `end_of_turn` where it was cut short, without one) and the next turn's ids; every
    trajectory starts with `INSTRUCTIONS`. Answers of 2-5 tokens, every third cut short."""
    rows = []
    for trajectory in range(trajectories):
        prompt = [*INSTRUCTIONS, 100 + trajectory]
        for t in range(steps):
            cut = t % 3 == 2
            answer = [200 + (7 * t + trajectory + k) % 50 for k in range(5 if cut else 1 + t % 4)]
            answer = answer if cut else [*answer, end_of_turn]
            rows.append((prompt, answer))
            prompt = [*prompt, *answer, *([end_of_turn] if cut else []), 300 + t % 40, 350 + trajectory]
    return rows


def test_a_conversations_rows_are_forwarded_as_one_sequence_each_with_the_plain_paths_outputs(tiny_model_path):
    # 2 conversations of 12 steps: each row's prompt extends the previous row's prompt and answer, so the trie is one
    # path per conversation (the instructions shared): every distinct token forwarded once
    rows = conversation_rows(steps=12, trajectories=2)
    model = fused_model(tiny_model_path, "sdpa")
    input_ids, attention_mask = padded(rows)
    packed = pack_rows(input_ids, attention_mask, 5, capacity=10_000)
    last = [prompt + answer for prompt, answer in (rows[11], rows[23])]
    # each conversation's tokens but its last (whose hidden state scores nothing), the instructions once
    assert packed.tokens == sum(len(sequence) - 1 for sequence in last) - len(INSTRUCTIONS)
    assert packed.tokens * 5 < int(attention_mask.sum())  # the rows hold each token many times over
    assert_same_outputs(packed_outputs(model, input_ids, attention_mask, 5, capacity=10_000),
                        plain_outputs(model, input_ids, attention_mask, 5))


def test_a_model_packing_cannot_be_exact_for_is_named_with_the_reason(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    config._attn_implementation = "sdpa"
    assert packing_problem(config) is None
    config._attn_implementation = "flash_attention_2"
    assert "takes no 4-D attention mask" in packing_problem(config)
    config._attn_implementation = "flex_attention"  # its block mask: on CUDA, where FlexAttention trains
    assert packing_problem(config, "cuda") is None
    assert "trains on CUDA only" in packing_problem(config, "cpu")
    config._attn_implementation, config.use_sliding_window, config.sliding_window = "sdpa", True, 16
    assert "sliding-window" in packing_problem(config)
    gpt2 = AutoConfig.for_model("gpt2")
    gpt2._attn_implementation = "sdpa"
    assert "not rotary" in packing_problem(gpt2)


def group_rollout_rows(vocab_size: int) -> list[Completion]:
    """A rollout's step samples as the trainer pads them: `ROWS` as token ids of the tiny model, without the empty
    answer (a step sample always has one)."""
    return [Completion(prompt, [token % vocab_size for token in answer], "") for prompt, answer in ROWS if answer]


def trainer_loss_and_gradient(tmp_path, model_path: str, packed: bool, **overrides):
    trainer = GiGPOTrainer(model_path, args=cpu_config(tmp_path, packed_update=packed, temperature=0.7, beta=0.05,
                                                       entropy_coef=0.05, **overrides),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    completions = group_rollout_rows(trainer.model.config.vocab_size)
    advantages = [(-1.0) ** k * (k + 1) / 4 for k in range(len(completions))]
    batch = loss_batch(trainer, completions, [1.0] * len(completions), advantages, "train")
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    gradient = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.item(), gradient, trainer


@pytest.mark.parametrize("overrides", [{}, {"max_step_samples_per_micro_batch": 3}, {"activation_checkpointing": True}],
                         ids=["one pass", "passes of 3", "activation checkpointing"])
def test_the_trainers_loss_and_gradient_with_the_kl_and_entropy_terms_are_the_plain_paths(tmp_path, tiny_model_path,
                                                                                          overrides):
    plain_loss, plain, _ = trainer_loss_and_gradient(tmp_path / "plain", tiny_model_path, False, **overrides)
    packed_loss, packed, trainer = trainer_loss_and_gradient(tmp_path / "packed", tiny_model_path, True, **overrides)
    assert trainer._packed_update
    assert packed_loss == pytest.approx(plain_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(packed, plain, rtol=0, atol=1e-4 * plain.abs().max().item())


def test_a_lora_adapters_gradient_packed_is_the_plain_paths(tmp_path, tiny_model_path):
    from peft import LoraConfig  # noqa: PLC0415

    lora = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    def run(packed):
        trainer = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path / str(packed), packed_update=packed,
                                                                temperature=0.7), train_dataset=task_dataset(range(4)),
                               **lora)
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        for name, parameter in trainer.model.named_parameters():  # LoRA's B starts at 0: give it a value to carry
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1, generator=torch.Generator().manual_seed(2))
        completions = group_rollout_rows(trainer.model.config.vocab_size)
        batch = loss_batch(trainer, completions, [1.0] * len(completions),
                           [(-1.0) ** k for k in range(len(completions))], "train")
        trainer.model.train()
        trainer.model.zero_grad()
        trainer.accelerator.backward(trainer.compute_loss(trainer.model, batch))
        return {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}

    plain, packed = run(False), run(True)
    assert plain.keys() == packed.keys() and all("lora" in name for name in plain)
    for name in plain:
        torch.testing.assert_close(packed[name], plain[name], rtol=0, atol=1e-4 * plain[name].abs().max().item())


def test_three_updates_of_a_training_run_packed_end_at_the_plain_paths_weights(tmp_path, tiny_model_path):
    # Sokoban: the tiny model's own answers vary the returns (the step penalty), so every update has a gradient. The
    # two runs sample the same rollouts: their weights differ by rounding only, far below a sampled token's odds.
    start, weights = None, {}
    for packed in (False, True):
        trainer = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path / str(packed), packed_update=packed,
                                                                max_steps=3, env_name="sokoban"),
                               train_dataset=task_dataset(range(4)))
        start = parameters(trainer.model)
        trainer.train()
        weights[packed] = parameters(trainer.model)
        trainer.close_environments()
    assert all(not torch.equal(weights[False][name], start[name]) for name in start)  # every weight moved
    # Adam divides each gradient entry by its own running scale, so the rounding of a near-zero entry shows in its
    # step: the weights agree within 1% of the largest step the runs took
    largest_step = max((weights[False][name] - start[name]).abs().max().item() for name in start)
    difference = max((weights[True][name] - weights[False][name]).abs().max().item() for name in start)
    assert difference <= 1e-2 * largest_step
