"""Models that need no download: a tiny random chat model built locally, for tests and CPU demos.

Real users pass any Hugging Face model id or directory as usual (`GiGPOTrainer(model="Qwen/...")`).
"""

from __future__ import annotations

from pathlib import Path

# ChatML, the format of Qwen2 and SmolLM2 chat models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|pad|>"]

# What the tokenizer learns its merges from: the vocabulary of the prompts and the games.
_CORPUS = """
You are an agent in a text-based environment. Read the observation, reason briefly, then act.
Your task: reach the goal. Your most recent steps: Current observation (step 0): Admissible actions:
First think step by step inside <think> </think>. Then give exactly one action inside <action> </action>.
You may also answer with the number of an admissible action. 1. 2. 3. 4. 5. 6. 7. 8. 9. 10.
go north go south go east go west look inventory take open close drop put examine eat cook slice chop
up down left right push box target wall player Sokoban puzzle grid # _ O X P S .
You are in a kitchen. There is a fridge, an oven, a table and a chest. The door leads east.
You see a red apple, a rusty key, a wooden chest, a knife, a carrot, a cookbook and a coin.
You win! You lost. Nothing happens. You can't go that way. Welcome to TextWorld!
"""


def build_tiny_model(output_dir: str | Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Build and save a tiny random Qwen2 chat model with a locally trained byte-level BPE tokenizer.

    The directory loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
    (about 0.5 MB, a few seconds to build). Its answers are random text: it exercises the whole
    pipeline, it does not play well.

    Args:
        output_dir: where to save (created if missing).
        seed: torch seed of the random weights.
        hidden_size: model width.
        num_layers: number of decoder layers.

    Returns:
        The directory.
    """
    import torch  # noqa: PLC0415 (heavy imports only when a model is built)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=CHATML_TEMPLATE
    )
    tokenizer.save_pretrained(output_dir)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    return output_dir
