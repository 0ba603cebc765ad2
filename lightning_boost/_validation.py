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


def check_sampling(every_n_steps: object, max_overhead: object) -> None:
    """The guards' sampling arguments: an int >= 1 or ``None``, and a fraction between 0 and 1.

    Raises:
        ValueError: naming the argument, what it expects and what it got.
    """
    if every_n_steps is not None and (
        isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
    ):
        raise ValueError(f"`every_n_steps` expected an int >= 1 or None, got {every_n_steps!r}.")
    if (
        isinstance(max_overhead, bool)
        or not isinstance(max_overhead, (int, float))
        or not 0 < max_overhead < 1
    ):
        raise ValueError(f"`max_overhead` expected a fraction between 0 and 1, got {max_overhead!r}.")
