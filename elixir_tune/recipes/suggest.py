"""The closest option to a misspelt one, for the recipes' option errors (options.py) and settings files
(settings_file.py); a leaf module, so that both import it without importing each other."""

from __future__ import annotations


def did_you_mean(message: str, options: list[str]) -> str:
    """`` (did you mean --steps?)`` for argparse's "unrecognized arguments: --stepz 3", naming the closest
    option of each unknown one; "" when none is close or the message is another."""
    import difflib

    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return ""
    unknown = [token.split("=", 1)[0] for token in message[len(prefix) :].split() if token.startswith("--")]
    close = [match for token in unknown for match in difflib.get_close_matches(token, options, n=1, cutoff=0.6)]
    return f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
