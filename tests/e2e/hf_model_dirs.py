"""Tiny Hugging Face model directories for the recipe tests, made locally (nothing downloaded).

``make_llama_dir`` writes what a downloaded Llama-style model has: config.json, safetensors weights, a
generation_config.json and a tokenizer trained here with ``tokenizers`` (byte-level BPE, with BOS/EOS/PAD and a
chat template for the chat data formats).
"""

from __future__ import annotations

from pathlib import Path

import torch

from elixir_tune.recipes import BUNDLED_TEXT

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(vocab_size: int = 400, text: Path = BUNDLED_TEXT):
    """A byte-level BPE tokenizer trained on ``text``, as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(text)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_llama_dir(directory: Path, hidden: int = 32, layers: int = 2, seed: int = 3) -> Path:
    """A tiny Llama (hidden <= 64, 2 layers) with weights, generation config and a local tokenizer."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=7,
    ).save_pretrained(directory)
    return directory
