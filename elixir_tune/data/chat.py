"""A conversation (``messages``: a list of {role, content}) into tokens, with the loss on the assistant turns.

The tokenizer's chat template renders the conversation. Which tokens are the assistant's is found
in one of two ways:

- the template marks the assistant's text with ``{% generation %}``: transformers returns the mask
  (``apply_chat_template(..., return_assistant_tokens_mask=True)``);
- otherwise the conversation is rendered prefix by prefix: the assistant turn ``i`` is the text
  between ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])``
  (its content and the end-of-turn marker, not the header), mapped to tokens through the fast
  tokenizer's character offsets. A template whose renderings are not prefixes of each other cannot
  be read this way: that is a DataError asking for ``{% generation %}`` markers.
"""

from __future__ import annotations

import re
from typing import Any

from elixir_tune.data.formats import DataError
from elixir_tune.data.prompt_completion import IGNORE

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_chat_tokenizer(tokenizer: Any) -> None:
    """The tokenizer can render conversations.

    Raises:
        DataError: no tokenizer, or no chat template.
    """
    if tokenizer is None:
        raise DataError("format messages needs the model's tokenizer and its chat template; the model has none")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template, which format messages needs: "
            "add one to the model directory (chat_template.jinja) or use prompt/completion data"
        )


def encode_messages(tokenizer: Any, messages: list[dict], record: int = 0) -> tuple[list[int], list[int]]:
    """Tokens and labels of one conversation: labels are the tokens on the assistant turns, -100 elsewhere.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: the conversation, a list of {role, content} dicts.
        record: the record's index, for error messages.

    Returns:
        (input ids, labels), of equal length.

    Raises:
        DataError: the conversation has no assistant turn, or the template refuses it.
    """
    messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
    if not any(message.get("role") == "assistant" for message in messages):
        raise DataError(f"record {record}: the conversation has no assistant turn, so nothing to learn from it")
    try:
        if GENERATION_TAG.search(_template(tokenizer)):
            return _by_generation_mask(tokenizer, messages)
        return _by_prefixes(tokenizer, messages, record)
    except DataError:
        raise
    except Exception as error:  # jinja2's TemplateError (e.g. "roles must alternate"), raised by the template
        raise DataError(f"record {record}: the chat template refused the conversation: {error}") from None


def _template(tokenizer: Any) -> str:
    template = tokenizer.chat_template
    return template if isinstance(template, str) else str(template.get("default", ""))


def _by_generation_mask(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(rendered["input_ids"])
    mask = list(rendered["assistant_masks"])
    return ids, [token if keep else IGNORE for token, keep in zip(ids, mask, strict=True)]


def _by_prefixes(tokenizer: Any, messages: list[dict], record: int) -> tuple[list[int], list[int]]:
    def render(part: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    full = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, after = render(messages[:index], True), render(messages[: index + 1], False)
        if not (full.startswith(after) and after.startswith(before)):
            raise DataError(
                f"record {record}: the chat template does not render the conversation prefix by prefix, so the "
                "assistant turns cannot be found: mark them with {% generation %} in the template"
            )
        spans.append((len(before), len(after)))
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("format messages with a template without {% generation %} needs a fast tokenizer")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    labels = []
    for token, (start, _end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
        inside = any(first <= start < last for first, last in spans)
        labels.append(token if inside else IGNORE)
    return list(encoded["input_ids"]), labels
