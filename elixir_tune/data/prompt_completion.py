"""A prompt/completion pair into tokens, with the loss on the completion only.

The prompt is encoded with the tokenizer's special tokens (e.g. BOS first), the completion without
them, and EOS ends the completion: the model learns to answer and to stop. Encoding the two apart
keeps the boundary exact (no token straddles prompt and completion), as TRL's SFT trainer does.
"""

from __future__ import annotations

from typing import Any

IGNORE = -100  # the label of a token without loss (PyTorch's cross-entropy ignore_index)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Tokens and labels of one pair: labels are -100 on the prompt, the tokens on the completion and EOS.

    Args:
        tokenizer: a transformers tokenizer.
        prompt: the text the model is given.
        completion: the text it learns to produce.

    Returns:
        (input ids, labels), of equal length.
    """
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True, verbose=False)["input_ids"])
    if prompt_ids and tokenizer.eos_token_id is not None and prompt_ids[-1] == tokenizer.eos_token_id:
        prompt_ids.pop()  # a tokenizer that ends every text with EOS: the completion follows the prompt
    completion_ids = list(tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        completion_ids.append(tokenizer.eos_token_id)
    return prompt_ids + completion_ids, [IGNORE] * len(prompt_ids) + completion_ids
