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


def check_int(name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """An int >= `minimum` (or ``None`` when `optional`); bools are not ints here.

    Raises:
        ValueError: naming the argument, what it expects and what it got.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"`{name}` expected {expected}, got {value!r}.")


def check_fraction(name: str, value: object, *, zero_ok: bool = False) -> None:
    """A number in (0, 1], or [0, 1) when `zero_ok` (a tolerance).

    Raises:
        ValueError: naming the argument, what it expects and what it got.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not ((0 <= value < 1) if zero_ok else (0 < value <= 1)):  # type: ignore[operator]
        expected = "a fraction >= 0 and < 1" if zero_ok else "a fraction > 0 and <= 1"
        raise ValueError(f"`{name}` expected {expected}, got {value!r}.")


def check_positive(name: str, value: object, unit: str, *, optional: bool = False) -> None:
    """A number > 0 (or ``None`` when `optional`); `unit` names what it counts in the message.

    Raises:
        ValueError: naming the argument, what it expects and what it got.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"`{name}` expected a number of {unit} > 0{' or None' if optional else ''}, got {value!r}."
        )
