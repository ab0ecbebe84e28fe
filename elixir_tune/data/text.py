"""Plain text into samples: documents, their lines or paragraphs, or documents packed into windows.

The documents are a .txt file's whole text, or the ``text`` field of each record. ``text_mode``
then makes the samples:

    pack       the documents, each ended with EOS, joined into one token stream cut into full
               seq_len windows (the last, shorter window is kept only when it is the only one);
               every token of a window is learned, across document boundaries, as in pretraining
    document   one sample per document
    line       one sample per non-empty line
    paragraph  one sample per blank-line separated paragraph

Without a tokenizer the text's UTF-8 bytes are the tokens (no EOS). The tokenizer is called with
``verbose=False``: texts longer than the model's maximum are cut to seq_len here, and transformers'
warning about them would otherwise repeat on every rank.
"""

from __future__ import annotations

from typing import Any

Tokens = list[int]


def text_units(documents: list[str], text_mode: str) -> list[str]:
    """The sample texts of ``document``, ``line`` or ``paragraph`` mode (``pack`` keeps the documents).

    Args:
        documents: the documents' texts.
        text_mode: pack | document | line | paragraph.

    Returns:
        The non-empty texts, stripped.
    """
    if text_mode == "line":
        pieces = [line for document in documents for line in document.splitlines()]
    elif text_mode == "paragraph":
        pieces = [part for document in documents for part in _paragraphs(document)]
    else:
        pieces = documents
    return [piece.strip() for piece in pieces if piece.strip()]


def _paragraphs(document: str) -> list[str]:
    paragraphs, current = [], []
    for line in document.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    if current:
        paragraphs.append("\n".join(current))
    return paragraphs


def encode_text(tokenizer: Any, text: str) -> Tokens:
    """One text sample's tokens: the tokenizer's special tokens (e.g. BOS), the text, EOS.

    Args:
        tokenizer: a transformers tokenizer, or None for bytes.
        text: the sample.
    """
    if tokenizer is None:
        return list(text.encode())
    ids = list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):  # some tokenizers end every text with EOS already
        ids.append(eos)
    return ids


def pack_windows(tokenizer: Any, documents: list[str], seq_len: int) -> list[Tokens]:
    """The documents, each ended with EOS, as one stream cut into seq_len windows.

    Args:
        tokenizer: a transformers tokenizer, or None for bytes.
        documents: the documents (a fast tokenizer encodes them in one batch).
        seq_len: the window length.

    Returns:
        The full windows; a single shorter one when the whole stream is shorter than seq_len.
    """
    if tokenizer is None:
        stream = [byte for document in documents for byte in document.encode()]
    else:
        eos = tokenizer.eos_token_id
        encoded = tokenizer(documents, add_special_tokens=True, verbose=False)["input_ids"]
        stream = [
            token
            for ids in encoded
            for token in (list(ids) + ([eos] if eos is not None and (not ids or ids[-1] != eos) else []))
        ]
    if len(stream) <= seq_len:
        return [stream] if stream else []
    return [stream[start : start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]
