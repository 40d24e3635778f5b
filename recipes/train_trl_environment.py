# /// script
# dependencies = ["gigpo-trl"]
# ///
"""Train a tool-calling agent on a TRL environment class (`environment_factory`) with GiGPO: every assistant turn
is a step with its own advantage.

The script is written as a TRL `GRPOTrainer(environment_factory=...)` script is; coming from one, two lines change:

    from trl import GRPOConfig, GRPOTrainer        ->   from gigpo_trl import GiGPOConfig, GiGPOTrainer
    GRPOTrainer(..., args=GRPOConfig(...), ...)     ->   GiGPOTrainer(..., args=GiGPOConfig(...), ...)

The environment is `gigpo_trl.environments.guess_number.GuessTheNumber` (find a number from 1 to 16 with hints),
scored by the reward function `won` (which reads the environments, as TRL passes them).

One GPU, Qwen2.5-1.5B-Instruct (its chat template calls tools), LoRA, vLLM colocate:

    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/train_trl_environment.py \\
        --config recipes/configs/guess_number_lora_gigpo.yaml

On CPU, the embedded SmolLM2-135M-Instruct, whose own chat template cannot render tools: the run takes TRL's
Qwen2.5 template (the same ChatML tokens) and shows the model one game played with the tool (a few minutes):

    python recipes/train_trl_environment.py --config recipes/configs/guess_number_cpu.yaml
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trl.chat_template_utils
from datasets import Dataset
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer
from gigpo_trl.environments.guess_number import HIGHEST, GuessTheNumber, won
from gigpo_trl.models import resolve_model
from gigpo_trl.recipe import train_and_report

SYSTEM = "You play a number guessing game. Call the guess tool with a number; its answer is a hint."
# One game played with the tool, shown before the real one when `one_shot` is set (for small models).
DEMONSTRATION = [
    {"role": "user", "content": f"I am thinking of a whole number from 1 to {HIGHEST}: guess it."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"number": 8}}}]},
    {"role": "tool", "name": "guess", "content": "8 is too low."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"number": 12}}}]},
    {"role": "tool", "name": "guess", "content": "12 is right!"},
    {"role": "assistant", "content": "I found it: 12."},
]


@dataclass
class ScriptArguments:
    num_train_tasks: int = field(default=1000, metadata={"help": "Games to train on (rows of the dataset)."})
    num_eval_tasks: int = field(default=0, metadata={"help": "Held-out games played before and after training."})
    tool_chat_template: str | None = field(
        default=None, metadata={"help": "A chat template of TRL's (e.g. 'qwen2_5') for a model whose own template "
                                "cannot render tool calls; None keeps the model's."})
    one_shot: bool = field(default=False, metadata={"help": "Show one game played with the tool before the real one."})


def games(count: int, first: int, one_shot: bool) -> Dataset:
    """Rows in TRL's shape: the conversation to start from (reset appends the game's opening) and a game number."""
    prompt = [{"role": "system", "content": SYSTEM}, *(DEMONSTRATION if one_shot else []), {"role": "user", "content": "New game."}]
    return Dataset.from_dict({"prompt": [prompt] * count, "game": list(range(first, first + count))})


def main(script_args: ScriptArguments, training_args: GiGPOConfig, model_args: ModelConfig) -> None:
    model = resolve_model(model_args.model_name_or_path or EMBEDDED_MODEL)
    training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    if script_args.tool_chat_template:
        tokenizer.chat_template = getattr(trl.chat_template_utils, f"{script_args.tool_chat_template}_chat_template")
    held_out = games(script_args.num_eval_tasks, 1_000_000, script_args.one_shot) if script_args.num_eval_tasks else None
    trainer = GiGPOTrainer(
        model, args=training_args, train_dataset=games(script_args.num_train_tasks, 0, script_args.one_shot),
        eval_dataset=held_out, processing_class=tokenizer, environment_factory=GuessTheNumber, reward_funcs=won,
        peft_config=get_peft_config(model_args),
    )
    train_and_report(trainer, training_args.resume_from_checkpoint,
                     panel=f"Held-out games won ({script_args.num_eval_tasks})")


if __name__ == "__main__":
    main(*TrlParser((ScriptArguments, GiGPOConfig, ModelConfig)).parse_args_and_config())
