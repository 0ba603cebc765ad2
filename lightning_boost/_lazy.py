"""Names a package exports, loaded on first use (PEP 562): one helper for every lazy package."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of `package`: `exports` maps each name to
    the module defining it, imported at the name's first use and then kept in the package.

    Example:
        >>> getattr_, dir_ = lazy_exports("json", {"JSONDecoder": "json.decoder"}, ["JSONDecoder"])
        >>> getattr_("JSONDecoder").__name__
        'JSONDecoder'
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
