"""One validation mechanism for every public argument, read off the signatures' type hints.

A public callable is wrapped with `validated`; each argument it is given is checked against its
annotation, which is the only place a rule is written:

- ``int`` (a bool is not one), ``float`` (finite: NaN and infinity are rejected), ``bool``, ``str``,
  ``Path`` (any path-like), a class (an instance of it), ``Callable``;
- ``Literal[...]`` choices, with the close matches of a misspelling;
- ``X | None``, ``tuple[X, ...]``, ``Sequence[X]``, ``list[X]``, ``Mapping[str, X]``;
- ``Annotated[X, Range(...)]``, ``Annotated[str, Identifier()]``, ``Annotated[str, Matches(...)]``,
  ``Annotated[X, NonEmpty()]`` and ``Annotated[str, OneOf(...)]`` for bounds, names, formats and
  choices known only at run time;
- ``**kwargs: Unpack[SomeTypedDict]``: only the keys the TypedDict declares, each by its hint.

A value of the wrong type raises `TypeError`; the right type with a bad value (out of range, an
unknown choice) raises `ValueError`. Both name the argument, what it expects, what it got and the
fix. Checks across arguments (one only with another) stay in the callable's own body.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import math
import numbers
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import typing_extensions

_T = TypeVar("_T")
_TYPE, _VALUE = "type", "value"
_UNPACK = {typing_extensions.Unpack, getattr(typing, "Unpack", typing_extensions.Unpack)}


@dataclass(frozen=True)
class Range:
    """Bounds for a number: ``Annotated[float, Range(gt=0, unit="seconds")]``.

    Example:
        >>> Range(ge=1, le=1000).holds(0), Range(ge=1, le=1000).describe()
        (False, '>= 1 and <= 1000')
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    unit: str = ""

    def holds(self, value: Any) -> bool:
        return not (
            (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.lt is not None and not value < self.lt)
            or (self.le is not None and not value <= self.le)
        )

    def describe(self) -> str:
        bounds = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        return " and ".join(f"{sign} {_number(getattr(self, key))}" for key, sign in bounds
                            if getattr(self, key) is not None)  # fmt: skip


@dataclass(frozen=True)
class Identifier:
    """A string that is a Python identifier (an attribute name)."""

    def holds(self, value: Any) -> bool:
        return str(value).isidentifier()

    def describe(self) -> str:
        return "that is an attribute name"


@dataclass(frozen=True)
class Matches:
    """A string matching `pattern` whole, described by an `example`."""

    pattern: str
    example: str

    def holds(self, value: Any) -> bool:
        return re.fullmatch(self.pattern, value) is not None

    def describe(self) -> str:
        return f"like {self.example!r}"


@dataclass(frozen=True)
class NonEmpty:
    """A collection with at least one item."""

    def holds(self, value: Any) -> bool:
        return len(value) > 0

    def describe(self) -> str:
        return "non-empty"


@dataclass(frozen=True)
class NotBlank:
    """A path that is not the empty string (``Path("")`` is the working directory; ``""`` is a mistake)."""

    def holds(self, value: Any) -> bool:
        return not (isinstance(value, str) and not value.strip())

    def describe(self) -> str:
        return "(not an empty string)"


@dataclass(frozen=True)
class OneOf:
    """A string from choices known only at run time (e.g. the registered distributed backends)."""

    choices: Callable[[], Iterable[str]]

    def holds(self, value: Any) -> bool:
        return value in set(self.choices())

    def describe(self) -> str:
        return "among " + ", ".join(repr(choice) for choice in sorted(self.choices()))


#: Shorthands for the rules the package uses most.
Seconds = Annotated[float, Range(gt=0, unit="seconds")]
Fraction = Annotated[float, Range(gt=0, le=1)]
PositiveInt = Annotated[int, Range(ge=1)]
Count = Annotated[int, Range(ge=0)]
Directory = Annotated[str | Path, NotBlank()]


def unknown_choice_error(argument: str, value: object, choices: Iterable[str]) -> ValueError:
    """A `ValueError` for a name that is not one of `choices`, listing every choice and the close matches.

    Example:
        >>> print(unknown_choice_error("name", "fast-dp", ["fast-ddp", "fsdp", "auto"]))
        `name` expected one of 'auto', 'fast-ddp', 'fsdp', got 'fast-dp'. Did you mean 'fast-ddp' or 'fsdp'?
    """
    names = sorted(choices)
    listed = ", ".join(repr(name) for name in names)
    return ValueError(f"`{argument}` expected one of {listed}, got {value!r}." + _close(value, names))


def check_argument(
    name: str, hint: Any, value: Any, default: Any = inspect.Parameter.empty, fix: str = ""
) -> None:
    """Raise when `value` does not fit `hint`, naming `name`, what it expects, what it got and the fix.

    Raises:
        TypeError: for a value of the wrong type.
        ValueError: for a value of the right type that breaks a bound or is not a choice.

    Example:
        >>> check_argument("steps", PositiveInt, 0, default=3)
        Traceback (most recent call last):
        ...
        ValueError: `steps` expected an int >= 1, got 0. Leave `steps` out for the default, 3.
    """
    verdict = _verdict(hint, value)
    if verdict is None:
        return
    expected = describe(hint)
    shown = _shown(value) + (f" ({type(value).__name__})" if verdict == _TYPE and value is not None else "")
    message = f"`{name}` expected {expected}, got {shown}."
    close = _close(value, _choices(hint)) if isinstance(value, str) else ""
    record = _dataclass_in(hint) if isinstance(value, Mapping) else None
    if close:
        message += close
    elif record is not None:
        arguments = ", ".join(f"{key}={item!r}" for key, item in value.items())
        message += f" Pass `{record.__name__}({arguments})` instead of a dict."
    elif default is not inspect.Parameter.empty:
        message += f" Leave `{name}` out for the default, {default!r}."
    elif fix:
        message += " " + fix
    raise (TypeError if verdict == _TYPE else ValueError)(message)


def describe(hint: Any) -> str:
    """What `hint` accepts, in words.

    Example:
        >>> describe(Seconds | None)
        'a finite number of seconds > 0 or None'
    """
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        text = describe(args[0])
        for rule in args[1:]:
            if isinstance(rule, NonEmpty):
                text = "a non-empty " + text.removeprefix("a ")
                continue
            if isinstance(rule, Range) and rule.unit:
                text += f" of {rule.unit}"
            text += " " + rule.describe()
        return text
    if origin in (Union, types.UnionType):
        parts = [describe(arg) for arg in args if arg is not type(None)]
        return " or ".join(parts) + (" or None" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a tuple of {len(args)}: " + ", ".join(describe(arg) for arg in args)
    if origin in (tuple, list) or origin is Sequence:
        kind = {tuple: "a tuple", list: "a list"}.get(origin, "a list or tuple")
        return f"{kind}, each item {describe(args[0])}" if args else kind
    if origin is Mapping or origin is dict:
        return "a mapping with string keys"
    if origin is Callable or hint is Callable:
        return "a callable"
    if hint in _DESCRIBED:
        return _DESCRIBED[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"a {hint.__name__} or one of " + ", ".join(repr(member.value) for member in hint)
    name = getattr(hint, "__name__", str(hint))
    if getattr(hint, "__module__", "").startswith("torch.nn"):
        name = "nn." + name
    return ("an " if name[0].lower() in "aeiou" else "a ") + name


def validated(target: _T) -> _T:
    """Check every argument of a function, or of a class's ``__init__``, against its type hints.

    Unknown keyword arguments are rejected with their close matches; a ``**kwargs`` annotated
    ``Unpack[TypedDict]`` takes the TypedDict's keys only.
    """
    if isinstance(target, type):
        init = target.__init__  # type: ignore[misc]
        hints_of: Any = target if dataclasses.is_dataclass(target) else init
        target.__init__ = _wrap(init, f"{target.__name__}.__init__", hints_of)  # type: ignore[misc]
        return target
    function: Any = target
    return _wrap(function, function.__qualname__, function)  # type: ignore[return-value]


def _wrap(func: Callable[..., Any], label: str, hints_of: Any) -> Callable[..., Any]:
    signature = inspect.signature(func)
    method = label.endswith(".__init__")

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        hints = _hints(hints_of)
        name = type(args[0]).__name__ if method and args else label  # the class the user built
        bound = _bind(signature, name, hints, args, kwargs)
        for argument, value in bound.arguments.items():
            parameter = signature.parameters[argument]
            hint = hints.get(argument)
            if hint is None:
                continue
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and get_origin(hint) in _UNPACK:
                keys = _hints(get_args(hint)[0])
                for key, item in value.items():
                    check_argument(key, keys[key], item, fix=f"Leave `{key}` out for {name}()'s default.")
            elif parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                check_argument(argument, hint, value, parameter.default)
        return func(*args, **kwargs)

    return checked


@functools.cache
def _hints(owner: Any) -> dict[str, Any]:
    return typing.get_type_hints(owner, include_extras=True)


def _bind(
    signature: inspect.Signature,
    label: str,
    hints: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> inspect.BoundArguments:
    parameters = signature.parameters
    var_keyword = next((p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    named = [name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    allowed = None if var_keyword is None else _unpacked_keys(hints.get(var_keyword.name))
    for key in kwargs:
        if key in named or (var_keyword is not None and (allowed is None or key in allowed)):
            continue
        known = [n for n in named if n != "self"] + sorted(allowed or ())
        raise TypeError(
            f"{label}() got an unknown argument `{key}`; it takes "
            + ", ".join(f"`{name}`" for name in known)
            + "."
            + _close(key, known)
        )
    try:
        return signature.bind(*args, **kwargs)
    except TypeError as error:
        keyword_only = [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY]
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [n for n, p in parameters.items() if p.kind in by_position]
        extra = args[len(positional) :]
        if extra and keyword_only and "positional" in str(error):
            given = ", ".join(_shown(value) for value in extra)
            raise TypeError(
                f"{label}() takes its settings by name, but {given} came by position: name it, as one of "
                + ", ".join(f"`{name}=`" for name in keyword_only)
                + f" (e.g. {label}({keyword_only[0]}={_shown(extra[0])}))."
            ) from None
        raise TypeError(f"{label}(): {error}.") from None


def _unpacked_keys(hint: Any) -> set[str] | None:
    if hint is None or get_origin(hint) not in _UNPACK:
        return None
    return set(_hints(get_args(hint)[0]))


def _verdict(hint: Any, value: Any) -> str | None:
    """``None`` when `value` fits `hint`, else whether its type (`_TYPE`) or its value (`_VALUE`) is wrong."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        verdict = _verdict(args[0], value)
        if verdict is not None:
            return verdict
        return _VALUE if any(not rule.holds(value) for rule in args[1:]) else None
    if origin in (Union, types.UnionType):
        verdicts = [_verdict(arg, value) for arg in args]
        return None if None in verdicts else (_VALUE if _VALUE in verdicts else _TYPE)
    if origin is Literal:
        if any(type(value) is type(choice) and value == choice for choice in args):
            return None
        return _VALUE if any(type(value) is type(choice) for choice in args) else _TYPE
    if origin in (tuple, list) or origin is Sequence:
        kinds: tuple[type, ...] = {tuple: (tuple, list), list: (list,)}.get(origin, (tuple, list))
        if not isinstance(value, kinds):
            return _TYPE
        value = list(typing.cast("Sequence[Any]", value))
        if not args:
            return None
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        if fixed and len(value) != len(args):
            return _VALUE
        hints = args if fixed else [args[0]] * len(value)
        items = [_verdict(arg, item) for arg, item in zip(hints, value, strict=True)]
        return _TYPE if _TYPE in items else (_VALUE if _VALUE in items else None)
    if origin is Mapping or origin is dict:
        return None if isinstance(value, Mapping) and all(isinstance(k, str) for k in value) else _TYPE
    if origin is Callable or hint is Callable:
        return None if callable(value) else _TYPE
    check = _CHECKS.get(hint)
    if check is not None:
        return check(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and not isinstance(value, hint):
        values = [member.value for member in hint]
        if value in values:
            return None
        return _VALUE if any(type(value) is type(v) for v in values) else _TYPE
    if hint is Any or hint is object or not isinstance(hint, type):
        return None
    return None if isinstance(value, hint) else _TYPE


def _float(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _TYPE
    return None if math.isfinite(value) else _VALUE


_CHECKS: dict[Any, Callable[[Any], str | None]] = {
    type(None): lambda value: None if value is None else _TYPE,
    None: lambda value: None if value is None else _TYPE,
    bool: lambda value: None if isinstance(value, bool) else _TYPE,
    int: lambda value: None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else _TYPE,
    float: _float,
    str: lambda value: None if isinstance(value, str) else _TYPE,
    Path: lambda value: None if isinstance(value, os.PathLike) else _TYPE,
}
_DESCRIBED = {int: "an int", float: "a finite number", bool: "True or False", str: "a string",
              Path: "a path", Any: "anything", type(None): "None"}  # fmt: skip


def _choices(hint: Any) -> list[str]:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return [choice for choice in args if isinstance(choice, str)]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [member.value for member in hint if isinstance(member.value, str)]
    if origin is Annotated:
        found = [c for rule in args[1:] if isinstance(rule, OneOf) for c in rule.choices()]
        return found + _choices(args[0])
    if origin in (Union, types.UnionType):
        return [choice for arg in args for choice in _choices(arg)]
    return []


def _dataclass_in(hint: Any) -> type | None:
    if get_origin(hint) in (Union, types.UnionType):
        return next((found for arg in get_args(hint) if (found := _dataclass_in(arg))), None)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _close(value: object, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value), list(names), n=3, cutoff=0.6)
    return " Did you mean " + " or ".join(repr(name) for name in close) + "?" if close else ""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
