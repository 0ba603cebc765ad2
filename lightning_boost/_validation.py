"""One message template for bad arguments: what was expected, what was given, and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def unknown_choice_error(argument: str, value: object, choices: Iterable[str]) -> ValueError:
    """A `ValueError` for a name that is not one of `choices`, listing every choice and the close matches.

    Example:
        >>> print(unknown_choice_error("name", "fast-dp", ["fast-ddp", "fsdp", "auto"]))
        `name` expected one of 'auto', 'fast-ddp', 'fsdp', got 'fast-dp'. Did you mean 'fast-ddp' or 'fsdp'?
    """
    names = sorted(choices)
    listed = ", ".join(repr(name) for name in names)
    message = f"`{argument}` expected one of {listed}, got {value!r}."
    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.6)
    if close:
        message += " Did you mean " + " or ".join(repr(name) for name in close) + "?"
    return ValueError(message)
