"""A tiny random Qwen2-VL (multi-axis rotary positions, images as patches with `image_grid_thw`, and a per-token
`mm_token_type_ids`) built offline, with an image-only processor: the stock `Qwen2VLProcessor` also wants a video
processor, which needs torchvision, and PyPI's torchvision does not load beside the CPU torch."""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from gigpo_trl.models import SPECIAL_TOKENS, _tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def build_tiny_qwen2_vl(output_dir: Path) -> tuple[str, ImageOnlyQwen2VLProcessor]:
    """The model's folder and its processor: a 96x96 picture becomes 36 patches, 9 image tokens."""
    import torch

    tokenizer = _tiny_tokenizer([*SPECIAL_TOKENS, *VISION_TOKENS], TEMPLATE)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    processor = ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=TEMPLATE)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    return str(output_dir), processor
