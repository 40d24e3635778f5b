"""Conversation mode (`history_length` None): every prompt after an episode's first is the previous prompt's ids, the
answer's ids as generated and the next turn's ids; over 10 turns, for the chat templates users bring, the ids extend
token for token and read as the template's rendering of the whole conversation; a template that is not
prefix-preserving is refused or replaced by TRL's training template; a run plays and trains in the mode."""

from __future__ import annotations

import pytest
from datasets import Dataset
from scripted_policy import scripted_tool_trainer
from toy_tool_envs import IncrementEnv
from trainer_helpers import cpu_config
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import chat_template_utils

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.conversation import ChatTurns
from gigpo_trl.dialogue import Completion, ContinuedPrompt, exchange_count, without_oldest_exchanges
from gigpo_trl.models import EMBEDDED_MODEL, resolve_model
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TURNS = 10
TOOL = {"type": "function", "function": {"name": "move", "description": "Move one cell.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "description": "left or right"}},
    "required": ["direction"]}}}


def tokenizer_with(path: str, template: str | None, end_of_turn: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    if end_of_turn not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer, tokenizer.convert_tokens_to_ids(end_of_turn)


def turns_of(tokenizer, end_of_turn: int, **kwargs) -> ChatTurns:
    def render(messages, add_generation_prompt):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False, **kwargs))
    return ChatTurns(render, frozenset({end_of_turn}))


def answer_text(tokenizer, reply: dict, tools, end_token: str) -> str:
    """The text a model trained on the template writes for `reply` after the generation prompt (a reasoning block, a
    tool call: each template spaces them its own way)."""
    question = [{"role": "user", "content": "dummy"}]
    asked = tokenizer.apply_chat_template(question, tools=tools, add_generation_prompt=True, tokenize=False)
    answered = tokenizer.apply_chat_template([*question, reply], tools=tools, tokenize=False)
    assert answered.startswith(asked)
    return answered[len(asked): answered.rindex(end_token)]


def play(turns: ChatTurns, tokenizer, end_token: str, role: str, tools=None):
    """A 10-turn conversation: the answers' ids as a generator would return them (every third cut short, without its
    end-of-turn token), each next turn a user or tool message. Returns the messages, the prompts' ids and the
    answers."""
    end_of_turn = tokenizer.convert_tokens_to_ids(end_token)
    messages = [{"role": "system", "content": "You walk a corridor."}, {"role": "user", "content": "Reach cell 9."}]
    prompt_ids = [list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))]
    conversations, answers = [list(messages)], []
    for t in range(TURNS - 1):
        direction = "right" if t % 2 else "left"
        reasoning = f"<think>\nstep {t}\n</think>\n\n"
        if role == "tool":
            call = {"name": "move", "arguments": {"direction": direction}}
            reply = {"role": "assistant", "content": reasoning, "tool_calls": [{"type": "function", "function": call}]}
            turn = [{"role": "tool", "name": "move", "content": f"You are in cell {t + 1}."}]
        else:
            reply = {"role": "assistant", "content": f"{reasoning}<action>{direction}</action>"}
            turn = [{"role": "user", "content": f"Current observation (step {t + 1}): cell {t + 1}."}]
        text = answer_text(tokenizer, reply, tools, end_token)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = t % 3 == 2
        answer = Completion(prompt_ids[-1], ids if cut else [*ids, end_of_turn], text)
        messages = [*messages, reply, *turn]
        prompt_ids.append(turns.prompt_ids(ContinuedPrompt(answer, turn, messages)))
        conversations.append(list(messages))
        answers.append(answer)
    return conversations, prompt_ids, answers


def continued_steps(steps) -> list[tuple[int, Completion, list[int]]]:
    """(row, the previous step's completion, the ids appended after it) of every step sample but an episode's first,
    each checked to extend the previous prompt by the previous answer's ids as generated."""
    continued = []
    for trajectory in set(steps.trajectory):
        rows = steps.rows_of(trajectory)
        for before, after in zip(rows, rows[1:]):
            previous, now = steps.completion[before], steps.completion[after]
            extended = [*previous.prompt_ids, *previous.completion_ids]
            assert now.prompt_ids[: len(extended)] == extended
            continued.append((after, previous, now.prompt_ids[len(extended):]))
    return continued


TEMPLATES = {  # name: (the template, or None for the tokenizer's own; the token that ends a turn; the model)
    "tiny ChatML": (None, "<|im_end|>", "tiny"),
    "SmolLM2": (None, "<|im_end|>", "smollm2"),
    "TRL Qwen2.5": (chat_template_utils.qwen2_5_chat_template, "<|im_end|>", "tiny"),
    "TRL Qwen3 training": (chat_template_utils.qwen3_training_chat_template, "<|im_end|>", "tiny"),
    "TRL Llama-3.1": (chat_template_utils.llama3_1_chat_template, "<|eot_id|>", "tiny"),
}


@pytest.mark.parametrize(("name", "role"), [(name, "user") for name in TEMPLATES]
                         + [("TRL Qwen2.5", "tool"), ("TRL Qwen3 training", "tool"), ("TRL Llama-3.1", "tool")])
@pytest.mark.slow
def test_prompt_ids_extend_token_for_token_and_read_as_the_templates_rendering_over_10_turns(tiny_model_path, name,
                                                                                                role):
    template, end_token, model = TEMPLATES[name]
    tokenizer, end_of_turn = tokenizer_with(tiny_model_path if model == "tiny" else resolve_model(EMBEDDED_MODEL),
                                            template, end_token)
    tools = [TOOL] if role == "tool" else None
    turns = turns_of(tokenizer, end_of_turn)
    turns.check(role)
    conversations, prompt_ids, answers = play(turns, tokenizer, end_token, role, tools)
    assert len(prompt_ids) == TURNS
    for t, answer in enumerate(answers):
        extended = [*answer.prompt_ids, *answer.completion_ids]
        assert prompt_ids[t + 1][: len(extended)] == extended  # the answer's ids as generated, never re-tokenized
        # A cut answer is closed by the template's end-of-turn token, which the model did not generate
        assert (prompt_ids[t + 1][len(extended)] == end_of_turn) == (answer.completion_ids[-1] != end_of_turn)
    for messages, ids in zip(conversations, prompt_ids):
        rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(ids) == rendered  # the whole conversation, as the template writes it


def test_a_template_that_is_not_prefix_preserving_is_refused_naming_the_problem(tiny_model_path):
    # Qwen3's original template writes an empty reasoning block into the last assistant answer only: once a user
    # message follows, that answer is rendered without it.
    tokenizer, end_of_turn = tokenizer_with(tiny_model_path, chat_template_utils.qwen3_chat_template, "<|im_end|>")
    with pytest.raises(ValueError, match="not prefix-preserving"):
        turns_of(tokenizer, end_of_turn).check("user")
    with pytest.raises(ValueError, match="none of the tokens generation stops at"):
        ChatTurns(turns_of(tokenizer, end_of_turn).render, frozenset({tokenizer.pad_token_id})).check("user")


def test_the_trainer_renders_with_trls_training_template_where_the_users_is_not_prefix_preserving(tmp_path,
                                                                                                  tiny_model_path):
    tokenizer, _ = tokenizer_with(tiny_model_path, chat_template_utils.qwen3_chat_template, "<|im_end|>")
    config = cpu_config(tmp_path, env_name="corridor", history_length="conversation")
    with pytest.warns(UserWarning, match="training template"):
        trainer = GiGPOTrainer(tiny_model_path, args=config, processing_class=tokenizer,
                               train_dataset=task_dataset(range(4)))
    assert trainer.chat_template == chat_template_utils.qwen3_training_chat_template


@pytest.mark.parametrize(("given", "meant"), [("auto", "auto"), (None, None), ("conversation", None), ("None", None),
                                              ("3", 3), (0, 0)])
def test_history_length_takes_a_window_the_conversation_or_auto(tmp_path, given, meant):
    config = GiGPOConfig(str(tmp_path), history_length=given, report_to=[])
    assert config.history_length == meant
    window = 2 if meant == "auto" else meant
    assert config.history_shown(tool_environment=False) == window
    assert config.history_shown(tool_environment=True) == (None if meant == "auto" else meant)


def test_history_length_refuses_what_is_neither_a_window_nor_a_mode(tmp_path):
    with pytest.raises(ValueError, match="history_length='whole'"):
        GiGPOConfig(str(tmp_path), history_length="whole", report_to=[])
    with pytest.raises(ValueError, match="history_length=-1 must be >= 0"):
        GiGPOConfig(str(tmp_path), history_length=-1, report_to=[])


def prompts_generated_from(trainer: GiGPOTrainer) -> list[list[int]]:
    """The prompt ids the trainer's generation is called with from now on, in order (the list fills as it runs)."""
    generated: list[list[int]] = []
    generate = trainer._generate_single_turn

    def recording_generate(prompt_ids, *args, **kwargs):
        generated.extend(list(ids) for ids in prompt_ids)
        return generate(prompt_ids, *args, **kwargs)

    trainer._generate_single_turn = recording_generate
    return generated


def test_a_conversation_run_generates_from_and_trains_on_each_prompt_extended_by_the_answer_before_it(
        tmp_path, tiny_model_path):
    # Answers of at most 6 tokens from a random model: most are cut short, some end with the end-of-turn token
    config = cpu_config(tmp_path, env_name="corridor", max_steps=1, max_env_steps=5, max_completion_length=6,
                        temperature=1.0, history_length="conversation")
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    generated = prompts_generated_from(trainer)
    trainer.train()
    trainer.close_environments()
    steps = trainer.last_rollout.steps
    continued = continued_steps(steps)
    for row, previous, appended in continued:
        assert steps.completion[row].prompt_ids in generated  # what was generated from is what trains
        # the conversation's messages, for logs: the answers as their text
        assert steps.prompt[row][-2] == {"role": "assistant", "content": previous.text}
    assert len(continued) >= len(set(steps.trajectory))
    assert trainer.state.global_step == 1


def test_trl_environment_classes_play_the_whole_conversation_by_default_each_tool_result_appended_as_a_turn(
        tmp_path, tool_model_path):
    config = cpu_config(tmp_path, max_completion_length=8, max_env_steps=8, max_steps=1)
    trainer = scripted_tool_trainer(tool_model_path, args=config, train_dataset=Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Task {k}."}] for k in range(4)]}), environment_factory=IncrementEnv)
    assert trainer.dialogue.history_length is None
    trainer.train()
    trainer.close_environments()
    continued = continued_steps(trainer.last_rollout.steps)
    assert continued
    for _, _, appended in continued:
        text = trainer.processing_class.decode(appended)
        assert "<tool_response>" in text and "Counter is" in text  # the tool's result, as the next turn


def test_dropping_the_oldest_exchanges_keeps_the_first_messages_the_latest_exchange_and_whole_tool_calls():
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    exchanges = [[{"role": "assistant", "content": "a0"}, {"role": "user", "content": "o1"}],
                 [call, {"role": "tool", "name": "f", "content": "r1"}, {"role": "tool", "name": "f", "content": "r2"}],
                 [{"role": "assistant", "content": "a2"}, {"role": "user", "content": "o3"}]]
    messages = [*head, *(message for exchange in exchanges for message in exchange)]
    assert exchange_count(messages) == 3
    assert without_oldest_exchanges(messages, 0) == messages
    assert without_oldest_exchanges(messages, 1) == [*head, *exchanges[1], *exchanges[2]]
    assert without_oldest_exchanges(messages, 2) == [*head, *exchanges[2]]
    with pytest.raises(ValueError, match="cannot drop 3 of the 3 exchanges"):
        without_oldest_exchanges(messages, 3)
    with pytest.raises(ValueError, match="cannot drop -1"):
        without_oldest_exchanges(messages, -1)


def _corridor_dropping_exchanges(tmp_path, tiny_model_path, *, context: int, max_env_steps: int) -> GiGPOTrainer:
    """A trainer of the tiny model, its context cut to `context` tokens, on corridor's whole conversation with
    `context_overflow='drop_oldest'`: 4 tasks x 2 copies, random answers cut at 6 tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.max_position_embeddings = context
    config = cpu_config(tmp_path, env_name="corridor", max_steps=1, max_env_steps=max_env_steps, max_completion_length=6,
                        temperature=1.0, history_length="conversation", context_overflow="drop_oldest",
                        env_processes=False, disable_tqdm=True)
    return GiGPOTrainer(model, args=config, processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
                        train_dataset=task_dataset(range(4)))


def test_a_conversation_that_outgrows_the_context_drops_its_oldest_exchanges_and_goes_on_token_for_token(
        tmp_path, tiny_model_path):
    # corridor's conversation grows by 57 tokens a turn from a first prompt of 180 (answers cut at 6 tokens, a later
    # turn the observation alone): a context of 406 leaves prompts 400 tokens and holds 4 of them; the 5th does not fit
    # and drops the fewest oldest exchanges that bring its rendering to the target of 300 (0.75 of the room), the turns
    # after it extend that one until the next does not fit
    trainer = _corridor_dropping_exchanges(tmp_path, tiny_model_path, context=406, max_env_steps=8)
    tokenizer = trainer.processing_class
    generated = prompts_generated_from(trainer)
    trainer.train()
    trainer.close_environments()

    def rendered(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    assert trainer.turns.prompt_token_limit == 400 and max(map(len, generated)) <= 400
    rollout = trainer.last_rollout
    assert all(episode.length == 8 and episode.context_overflow is None for episode in rollout.episodes)
    steps = rollout.steps
    trimmed = [row for row, completion in enumerate(steps.completion) if completion.dropped_exchanges]
    for trajectory in set(steps.trajectory):
        rows = steps.rows_of(trajectory)
        assert any(row in trimmed for row in rows)  # every episode outgrew the context at least once
        first = steps.prompt[rows[0]]
        for before, after in zip(rows, rows[1:]):
            previous, now, shown = steps.completion[before], steps.completion[after], steps.prompt[after]
            assert shown[: len(first)] == first  # the system message, the task and the first observation are kept
            latest = max(k for k, message in enumerate(shown) if message["role"] == "assistant")
            whole = [*steps.prompt[before], *shown[latest:]]  # the conversation before any drop
            continued = trainer.turns.render.chat_turns.prompt_ids(ContinuedPrompt(previous, shown[latest + 1:], whole))
            if after in trimmed:  # it did not fit: the fewest oldest exchanges dropped to reach the target, rendered once
                dropped = now.dropped_exchanges
                assert len(continued) > 400
                assert shown == without_oldest_exchanges(whole, dropped)
                assert now.prompt_ids == rendered(shown) and len(now.prompt_ids) <= 300
                assert dropped == 1 or len(rendered(without_oldest_exchanges(whole, dropped - 1))) > 300
            else:  # it fits: the previous prompt and answer extended token for token
                assert shown == whole and now.prompt_ids == continued
    log = next(entry for entry in trainer.state.log_history if "env/context_trimmed_share" in entry)
    assert log["env/context_trimmed_share"] == pytest.approx(len(trimmed) / len(steps))
    assert log["env/context_overflow_share"] == 0.0


def test_a_conversation_whose_first_messages_and_latest_exchange_do_not_fit_still_ends_truncated(
        tmp_path, tiny_model_path):
    # a room of 200 tokens holds corridor's first prompt (180) but not it with one exchange (237): nothing can be
    # dropped, so the episode ends at step 1 as under 'truncate', its reason recorded
    trainer = _corridor_dropping_exchanges(tmp_path, tiny_model_path, context=206, max_env_steps=4)
    with pytest.warns(UserWarning, match="env/context_overflow_share"):
        trainer.train()
    trainer.close_environments()
    episodes = trainer.last_rollout.episodes
    assert all(episode.length == 1 and episode.context_overflow.startswith("the prompt of step 1 ") for episode in episodes)
    assert not any(completion.dropped_exchanges for completion in trainer.last_rollout.steps.completion)


def test_dropping_exchanges_is_refused_for_a_window_and_an_unknown_mode_by_name(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", context_overflow="drop_oldest")  # text environments: a window of 2
    with pytest.raises(ValueError, match="context_overflow='drop_oldest' drops the oldest exchanges of a whole "
                       "conversation, but this run shows a window of 2"):
        GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    with pytest.raises(ValueError, match="context_overflow='shrink' is not one of"):
        cpu_config(tmp_path, context_overflow="shrink")


def test_a_later_turn_of_a_conversation_carries_what_is_new_not_the_first_turns_instructions_again():
    from gigpo_trl.dialogue import Exchange, TextDialogue
    from gigpo_trl.envs import EnvOutput
    from gigpo_trl.parsing import ParsedAction
    from gigpo_trl.prompts import TEMPLATES

    template = TEMPLATES["numbered_one_shot"]
    dialogue = TextDialogue(template, history_length=None)
    hall = EnvOutput("A hall.", info={"task": "Leave.", "admissible_actions": ["go north", "look"]})
    corridor = EnvOutput("A corridor.", info={"admissible_actions": ["go north", "look"]})
    garden = EnvOutput("A garden.", info={"admissible_actions": ["go south", "open gate"]})

    first = dialogue.prompt(hall, hall, [], 0)[-1]["content"]
    same_actions = dialogue.turn(Exchange(hall, ParsedAction("go north", True), corridor, None), 1)
    new_actions = dialogue.turn(Exchange(corridor, ParsedAction("go north", True), garden, None), 2)

    assert template.instruction in first and "Leave." in first and "1. go north" in first
    assert same_actions == [{"role": "user", "content": "Current observation (step 1):\nA corridor."}]
    assert new_actions == [{"role": "user", "content": "Current observation (step 2):\nA garden.\n\n"
                                                       "Admissible actions:\n1. go south\n2. open gate"}]
