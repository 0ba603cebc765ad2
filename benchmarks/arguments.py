"""Bad arguments across the public API: how many get a clear error at construction.

Every callable `lightning_boost.__all__` exports is called with one argument bad at a time, the
others left at their defaults (or at `REQUIRED`'s good values). What is bad is read off the
signature's type hints by `fits`, an oracle written apart from the package's validation: the
values of `POOL` and those `near` each hint (just past a bound, a misspelt choice) that do not fit.

- clear: a `TypeError` or `ValueError` whose message names the argument in backticks, says what
  it expected and shows the value given;
- unclear: any other exception, or a message missing one of those;
- accepted: no error at all.

The ratio is clear / tried; the target is 1.00 (0 unclear, 0 accepted). ``tests/test_arguments.py``
holds the package to it with values hypothesis generates.
"""

from __future__ import annotations

import collections
import enum
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typing_extensions

import lightning_boost
from benchmarks.common import Row
from lightning_boost._validation import Identifier, Matches, NonEmpty, NotBlank, OneOf, Range
from lightning_boost.hardware import EXAMPLES
from lightning_boost.testing import BoringModel

COMMAND = "python -m benchmarks arguments"

#: Values every argument is tried with (those that fit its hint are skipped).
POOL: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2.5, -0.5, math.nan, math.inf, -math.inf, 10**12, "", "x", "warn ",
    b"x", [], (), {}, {"bogus": 1}, [1, "a"], ("x",), object(), print,
)  # fmt: skip

#: Good values for the arguments that have no default.
REQUIRED: dict[str, dict[str, Any]] = {
    "preset": {"name": "fast-ddp", "hardware": EXAMPLES["cpu"]},
    "auto_precision": {"hardware": EXAMPLES["cpu"]},
    "HardwareInfo": {"accelerator": "cpu"},
    "Finding": {"source": "doctor", "area": "data", "severity": "info", "title": "a title"},
    "micro_batches": {"module": BoringModel(), "batch": (), "loss_fn": len},
}
_UNPACK = {typing_extensions.Unpack, getattr(typing, "Unpack", typing_extensions.Unpack)}


def public_callables() -> dict[str, Callable[..., Any]]:
    """The exported functions and classes a user calls with arguments (not exceptions or enums)."""
    found = {}
    for name in lightning_boost.__all__:
        target = getattr(lightning_boost, name)
        if not callable(target) or (
            isinstance(target, type) and issubclass(target, (BaseException, enum.Enum))
        ):
            continue
        found[name] = target
    return found


def parameters(target: Callable[..., Any]) -> list[tuple[str, Any, bool]]:
    """``(name, hint, is_keyword_only_option)`` per argument; a ``**kwargs: Unpack[TypedDict]``
    contributes the TypedDict's keys."""
    hints = typing.get_type_hints(target if _is_dataclass(target) else _function(target), include_extras=True)
    found = []
    for name, parameter in inspect.signature(target).parameters.items():
        hint = hints.get(name)
        if parameter.kind is parameter.VAR_KEYWORD and get_origin(hint) in _UNPACK:
            options = typing.get_type_hints(get_args(hint)[0], include_extras=True)
            found += [(key, option, True) for key, option in options.items()]
        elif parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) and hint is not None:
            found.append((name, hint, False))
    return found


def fits(hint: Any, value: Any) -> bool:
    """Whether `value` is a good value for `hint` (the oracle; the package's own check is apart)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        return fits(args[0], value) and all(_rule_holds(rule, value) for rule in args[1:])
    if origin in (Union, types.UnionType):
        return any(fits(arg, value) for arg in args)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return isinstance(value, (tuple, list)) and len(value) == len(args) and all(map(fits, args, value))
    if origin in (tuple, list, Sequence, collections.abc.Sequence):
        kinds = (list,) if origin is list else (tuple, list)
        return isinstance(value, kinds) and all(fits(args[0], item) for item in value)
    if origin in (dict, Mapping, collections.abc.Mapping):
        return isinstance(value, Mapping) and all(isinstance(key, str) for key in value)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is Path:
        return isinstance(value, os.PathLike)
    if hint in (None, type(None)):
        return value is None
    if hint is Any:  # a class since Python 3.11: isinstance() refuses it
        return True
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in [member.value for member in hint]
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # Any


def near(hint: Any) -> list[Any]:
    """Values close to good ones for `hint`: each side of its bounds, misspelt choices."""
    origin, args = get_origin(hint), get_args(hint)
    found: list[Any] = []
    if origin is Annotated:
        found += near(args[0])
        for rule in args[1:]:
            if isinstance(rule, Range):
                for bound in (rule.gt, rule.ge, rule.lt, rule.le):
                    if bound is not None:
                        found += [bound, bound - 1, bound + 1, bound - 0.5, bound + 0.5, int(bound) * 10**6]
            if isinstance(rule, (Identifier, Matches)):
                found += ["two words", "1st", "a.b c"]
            if isinstance(rule, NonEmpty):
                found += [(), []]
            if isinstance(rule, NotBlank):
                found += ["", "  "]
            if isinstance(rule, OneOf):
                found += [word for choice in rule.choices() for word in misspellings(choice)]
    elif origin in (Union, types.UnionType, tuple, list, Sequence, collections.abc.Sequence):
        found += [item for arg in args if arg is not Ellipsis for item in near(arg)]
        if origin is not Union and origin is not types.UnionType and args:
            found += [[item] for item in near(args[0])] + [(item,) for item in near(args[0])]
    elif origin is Literal:
        found += [word for choice in args if isinstance(choice, str) for word in misspellings(choice)]
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        found += [word for member in hint for word in misspellings(str(member.value))]
    return found


def misspellings(word: str) -> list[str]:
    """A letter dropped, doubled, upper-cased and a space added: typos a user makes."""
    return [word[1:], word + word[-1:], word.upper(), word + " "] if word else []


def bad_values(hint: Any) -> list[Any]:
    """The values of `POOL` and `near` that do not fit `hint`."""
    return [value for value in (*POOL, *near(hint)) if not fits(hint, value)]


def call(target: Callable[..., Any], name: str, value: Any, target_name: str) -> Any:
    """`target` with the good required arguments and `name` set to `value`."""
    return target(**{**REQUIRED.get(target_name, {}), name: value})


def outcome(target: Callable[..., Any], target_name: str, name: str, value: Any) -> tuple[str, str]:
    """``("clear" | "unclear" | "accepted", what was raised)`` for one bad value."""
    try:
        call(target, name, value, target_name)
    except (TypeError, ValueError) as error:
        message = str(error)
        shown = repr(value)[:20]
        clear = f"`{name}`" in message and "expected" in message and shown in message
        return ("clear" if clear else "unclear"), f"{type(error).__name__}: {message}"
    except Exception as error:  # anything else is unclear by definition
        return "unclear", f"{type(error).__name__}: {error}"
    return "accepted", ""


def cases() -> Iterator[tuple[str, Callable[..., Any], str, Any]]:
    """``(callable name, callable, argument, hint)`` for every argument of the public API."""
    for target_name, target in public_callables().items():
        for name, hint, _ in parameters(target):
            if hint is not Any:  # every value fits: there is no bad one to try
                yield target_name, target, name, hint


def sweep() -> tuple[collections.Counter[str], list[str]]:
    """Every bad value of every argument: the counts, and a line per value not clearly rejected."""
    counts: collections.Counter[str] = collections.Counter()
    problems = []
    for target_name, target, name, hint in cases():
        for value in bad_values(hint):
            verdict, raised = outcome(target, target_name, name, value)
            counts["tried"] += 1
            counts[verdict] += 1
            if verdict != "clear":
                problems.append(f"{target_name}({name}={value!r}): {verdict} {raised}")
    return counts, problems


def run() -> list[Row]:
    counts, problems = sweep()
    detail = (
        f"{counts['tried']} bad values over {len(public_callables())} public callables:"
        f" {counts['clear']} clear, {counts['unclear']} unclear, {counts['accepted']} accepted"
    )
    for line in problems[:10]:
        print(line)
    ratio = counts["clear"] / counts["tried"]
    return [Row("arguments: bad values rejected clearly / tried (target 1.00)", ratio, detail, COMMAND)]


def _is_dataclass(target: Any) -> bool:
    return isinstance(target, type) and "__dataclass_fields__" in vars(target)


def _function(target: Any) -> Any:
    return inspect.unwrap(target.__init__ if isinstance(target, type) else target)


def _rule_holds(rule: Any, value: Any) -> bool:
    if isinstance(rule, Range):
        return not any(
            bound is not None and not compare(value, bound)
            for bound, compare in (
                (rule.gt, lambda v, b: v > b),
                (rule.ge, lambda v, b: v >= b),
                (rule.lt, lambda v, b: v < b),
                (rule.le, lambda v, b: v <= b),
            )
        )
    if isinstance(rule, Identifier):
        return value.isidentifier()
    if isinstance(rule, Matches):
        return re.fullmatch(rule.pattern, value) is not None
    if isinstance(rule, NonEmpty):
        return len(value) > 0
    if isinstance(rule, NotBlank):  # an empty or blank string; a Path("") is "." and fine
        return not isinstance(value, str) or value.strip() != ""
    if isinstance(rule, OneOf):
        return all(part.rpartition(":")[2] in set(rule.choices()) for part in value.split(","))
    raise AssertionError(f"no oracle for the rule {rule!r}")
